"""NVML source on readings recorded on an H200 (tests/fixtures/nvml/), Xid de-duplication, udev.

The real ``NvmlSource`` code runs against ``RecordedNvml`` (the replay of what nvidia-ml-py
returned on the GPU node); on this CI host the real library finds no driver, which is tested too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from gpuwatchd.counters import CounterStore
from gpuwatchd.findings.gpu_lost import lost_finding
from gpuwatchd.isolation import Collector, NotPresent
from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.model import SOURCE_KERNEL, SOURCE_NVML
from gpuwatchd.sources.nvml import NvmlNotPresent, NvmlReadError, NvmlSource, select_devices
from gpuwatchd.sources.nvml_events import XidEventWatcher
from gpuwatchd.sources.nvml_fixture import RecordedNvml, fixture_source
from gpuwatchd.sources.udev import UdevWatcher, classify, parse_uevent_file
from gpuwatchd.units import normalize_pci_bus_id

FIX = Path(__file__).parent / "fixtures" / "nvml"
H200 = FIX / "h200_orphan_dataloader.json"
UUID = "GPU-d6a79800-1da5-699b-0f9c-f55eb218f8b2"


def _doc(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def test_h200_recording_matches_nvidia_smi_within_one_percent() -> None:
    doc = _doc(H200.name)
    src = NvmlSource(pynvml=RecordedNvml(doc))
    for cycle in doc["cycles"]:
        devices, procs = src.read()
        assert [(d.index, d.uuid, d.name, d.pci_bus_id) for d in devices] == [
            (0, UUID, "NVIDIA H200", "00000000:00:06.0")
        ]
        assert devices[0].memory_total_bytes == 150754820096
        assert devices[0].memory_used_bytes == cycle["devices"][0]["memory"]["used"]
        assert devices[0].utilization_ratio == cycle["devices"][0]["utilization"]["gpu"] / 100
        smi = {r["pid"]: r["used_memory_mib"] for r in cycle["nvidia_smi_compute_apps"]}
        assert {p.pid for p in procs} == set(smi)
        for p in procs:
            assert p.kind == "compute" and p.uuid == UUID
            assert p.used_memory_bytes is not None
            assert abs(p.used_memory_bytes / (1 << 20) - smi[p.pid]) <= 0.01 * smi[p.pid]
    # the 5 GiB nohup'ed holder (PID 453 on the node) held 5730 MiB including its CUDA context
    assert next(p for p in procs if p.pid == 453).used_memory_bytes == 6008340480


def test_a_poll_does_not_ask_for_per_process_utilisation() -> None:
    """nvmlDeviceGetProcessUtilization cost more CPU than the process lists on the H200 (1.4 ms
    per GPU per poll at 64 processes) for a value nothing used: a poll no longer calls it."""
    calls: list[str] = []

    class Counting(RecordedNvml):
        def nvmlDeviceGetProcessUtilization(self, handle: int, since: int) -> list[object]:
            calls.append("util")
            return list(super().nvmlDeviceGetProcessUtilization(handle, since))

    src = NvmlSource(pynvml=Counting(_doc(H200.name)))
    for _ in range(3):
        _, procs = src.read()
    assert procs and calls == []


def test_mig_style_not_available_memory_is_unknown_never_zero() -> None:
    src = fixture_source(str(FIX / "derived_mig_na.json"))
    devices, procs = src.read()
    assert len(procs) == 4
    assert all(p.used_memory_bytes is None for p in procs)  # null and 0xFFFFFFFFFFFFFFFF alike
    assert devices[0].memory_used_bytes == 10788405248  # device totals still known


def test_nvml_raising_mid_cycle_then_recovering() -> None:
    lib = RecordedNvml(_doc("derived_raise_mid_cycle.json"))
    src = NvmlSource(pynvml=lib)
    _, procs = src.read()
    assert len(procs) == 4
    with pytest.raises(NvmlReadError, match="GPU 0"):
        src.read()  # GPU_IS_LOST from the process list: the only GPU cannot be read
    assert "15" in src.device_errors[0]
    with pytest.raises(NvmlReadError, match="nvmlDeviceGetCount"):
        src.read()
    assert lib.init_calls == 1
    _devices, procs = src.read()  # a failed count forces a fresh nvmlInit, then reading resumes
    assert lib.init_calls == 2 and len(procs) == 4


def test_one_lost_gpu_does_not_hide_the_others() -> None:
    src = fixture_source(str(FIX / "derived_gpu_lost_xid.json"))
    devices, procs = src.read()
    assert [d.index for d in devices] == [0]
    assert set(src.device_errors) == {1}
    assert {p.gpu_index for p in procs} == {0}


def test_no_driver_on_this_host_is_not_present_not_a_crash() -> None:
    # This CI host has nvidia-ml-py but no libnvidia-ml: the real library path.
    src = NvmlSource()
    with pytest.raises(NvmlNotPresent, match="not present"):
        src.read()
    assert issubclass(NvmlNotPresent, NotPresent)
    col = Collector("nvml", src.read, timeout=5, max_age=10)
    assert col.run() is None
    assert col.status.success is False and col.status.error.startswith("not present")


def test_recorded_not_present_document() -> None:
    src = fixture_source(str(FIX / "not_present.json"))
    with pytest.raises(NvmlNotPresent):
        src.read()


def test_hung_nvml_call_times_out_in_the_collector() -> None:
    release = threading.Event()

    class Hanging(RecordedNvml):
        def nvmlDeviceGetCount(self) -> int:
            release.wait(10)
            return super().nvmlDeviceGetCount()

    src = NvmlSource(pynvml=Hanging(_doc(H200.name)))
    col = Collector("nvml", src.read, timeout=0.2, max_age=1)
    t0 = time.monotonic()
    assert col.run() is None
    assert time.monotonic() - t0 < 2
    assert "timed out" in col.status.error
    release.set()


def test_select_devices_by_index_uuid_and_prefix() -> None:
    devices, _ = fixture_source(str(H200)).read()
    assert select_devices(devices, []) == devices
    assert select_devices(devices, ["0"]) == devices
    assert select_devices(devices, [UUID]) == devices
    assert select_devices(devices, ["GPU-d6a7"]) == devices
    with pytest.raises(ValueError):
        select_devices(devices, ["3"])


# --- Xid ----------------------------------------------------------------------------------------


def test_normalize_pci_bus_id_variants() -> None:
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00"
    assert normalize_pci_bus_id("PCI:0000:3b:00") == "0000:3b:00"
    assert normalize_pci_bus_id("3b:00.0") == "0000:3b:00"


def test_dedup_counts_one_occurrence_reported_by_both_sides_once() -> None:
    d = XidDeduper(window_seconds=30)
    assert d.record("00000000:3B:00.0", 79, 100.0, SOURCE_NVML) is True
    assert d.record("PCI:0000:3b:00", 79, 101.5, SOURCE_KERNEL) is False  # same occurrence
    assert d.record("PCI:0000:3b:00", 79, 102.0, SOURCE_KERNEL) is True  # a second one
    assert d.record("PCI:0000:3b:00", 48, 102.0, SOURCE_KERNEL) is True  # other Xid
    assert d.record("PCI:0000:3c:00", 79, 102.0, SOURCE_KERNEL) is True  # other GPU
    assert d.record("00000000:3B:00.0", 79, 200.0, SOURCE_NVML) is True  # outside the window
    d.learn_device("00000000:3B:00.0", "GPU-x", 2)
    assert d.labels_for("PCI:0000:3b:00") == ("2", "GPU-x")


def test_nvml_xid_event_counted_once_with_kernel_line() -> None:
    counters = CounterStore()
    dedup = XidDeduper()
    lib = RecordedNvml(_doc("derived_gpu_lost_xid.json"))
    w = XidEventWatcher(counters.inc, dedup, pynvml=lib, clock=lambda: 1000.0)
    lib.nvmlInit()
    lib.nvmlDeviceGetCount()
    event_set = w.register_xid_events(lib)
    assert w.poll_once(lib, event_set) is True
    assert w.poll_once(lib, event_set) is False  # time-out: nothing more
    assert counters.get("gpu_xid_errors", ("0", UUID, "79")) == 1
    # the kernel log reports the same Xid 2 s later: not counted again
    assert dedup.record("PCI:0000:00:06", 79, 1002.0, SOURCE_KERNEL) is False


def test_xid_watcher_thread_runs_and_stops() -> None:
    counters = CounterStore()
    lib = RecordedNvml(_doc("derived_gpu_lost_xid.json"))
    w = XidEventWatcher(counters.inc, XidDeduper(), pynvml=lib, wait_ms=50)
    w.start()
    deadline = time.monotonic() + 5
    while counters.get("gpu_xid_errors", ("0", UUID, "79")) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    w.stop()
    assert counters.get("gpu_xid_errors", ("0", UUID, "79")) == 1
    assert w.error == ""


# --- udev ---------------------------------------------------------------------------------------


def test_recorded_h200_uevent_is_a_gpu_and_remove_is_lost() -> None:
    props = parse_uevent_file((FIX / "h200_pci_uevent.txt").read_text())
    ev = classify("remove", props, 5.0)
    assert ev is not None and ev.lost and ev.pci_bus_id == "0000:00:06"
    f = lost_finding(ev, "0", UUID)
    assert f.kind == "gpu_lost" and "GPU 0" in f.explanation and "0000:00:06.0" in f.explanation
    add = classify("add", props, 6.0)
    assert add is not None and not add.lost
    assert classify("change", props, 6.0) is None
    other = {**props, "PCI_ID": "8086:1234"}
    assert classify("remove", other, 6.0) is None


def _local_pci_device() -> tuple[str, dict[str, str]] | None:
    base = "/sys/bus/pci/devices"
    for name in sorted(os.listdir(base)):
        props = parse_uevent_file(Path(base, name, "uevent").read_text())
        if props.get("PCI_CLASS", "").startswith("3") and "PCI_ID" in props:
            return name, props
    for name in sorted(os.listdir(base)):
        props = parse_uevent_file(Path(base, name, "uevent").read_text())
        if "PCI_ID" in props:
            return name, props
    return None


def test_udev_watcher_receives_a_real_kernel_uevent() -> None:
    """A synthetic 'add' uevent (write to /sys/.../uevent) travels through the real netlink
    monitor; the watcher is pointed at this host's PCI vendor instead of NVIDIA's."""
    import pyudev

    found = _local_pci_device()
    assert found is not None
    name, props = found
    vendor = props["PCI_ID"].split(":")[0]
    seen: list = []
    mon = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
    mon.filter_by("pci")
    w = UdevWatcher(seen.append, monitor=mon, vendor=vendor, poll_seconds=0.2)
    if not props.get("PCI_CLASS", "").startswith("3"):
        # classify() only accepts display class devices; test the path with this host's device
        w.handle = lambda action, p: UdevWatcher.handle(  # type: ignore[method-assign]
            w, action, {**p, "PCI_CLASS": "30200"}
        )
    w.start()
    try:
        Path("/sys/bus/pci/devices", name, "uevent").write_text("add")
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        w.stop()
    assert seen and seen[0].action == "add" and seen[0].slot == name


def test_graphics_processes_are_listed_again_on_a_cadence_or_when_memory_moves(tmp_path: Path) -> None:
    """The graphics-process list (0.9 ms of CPU per GPU per poll on the H200, usually empty on a
    training node) is taken again every graphics_relist_seconds or when the GPU's used memory
    moves by more than GRAPHICS_MEMORY_STEP; in between, the last list less the processes that
    exited. The compute list is read every poll."""
    import subprocess

    from gpuwatchd.sources.nvml import GRAPHICS_MEMORY_STEP

    holder = subprocess.Popen(["sleep", "600"])
    try:
        doc = _doc(H200.name)
        cycle = doc["cycles"][0]
        cycle["devices"][0]["graphics"] = [{"pid": holder.pid, "usedGpuMemory": 1 << 30}]
        doc["cycles"] = [cycle, json.loads(json.dumps(cycle))]
        doc["cycles"][1]["devices"][0]["memory"]["used"] += GRAPHICS_MEMORY_STEP + 1
        replay = RecordedNvml(doc, loop=False)
        src = NvmlSource(pynvml=replay, graphics_relist_seconds=3600)
        _, procs = src.read()  # cycle 0: listed
        assert [p.pid for p in procs if p.kind == "graphics"] == [holder.pid]
        assert src.graphics_listings == 1
        replay.cycles[1]["devices"][0]["graphics"] = []  # NVML would now say: none
        replay.cycles[1]["devices"][0]["memory"]["used"] = cycle["devices"][0]["memory"]["used"]
        _, procs = src.read()  # same memory, within the cadence: the last list
        assert [p.pid for p in procs if p.kind == "graphics"] == [holder.pid]
        assert src.graphics_listings == 1 and any(p.kind == "compute" for p in procs)
        holder.kill()
        holder.wait()
        _, procs = src.read()  # exited: dropped without asking NVML
        assert [p for p in procs if p.kind == "graphics"] == [] and src.graphics_listings == 1
        replay.cycles[1]["devices"][0]["graphics"] = [{"pid": os.getpid(), "usedGpuMemory": 1}]
        replay.cycles[1]["devices"][0]["memory"]["used"] += GRAPHICS_MEMORY_STEP + 1
        _, procs = src.read()  # the memory moved: listed again
        assert [p.pid for p in procs if p.kind == "graphics"] == [os.getpid()]
        assert src.graphics_listings == 2
        now_src = NvmlSource(pynvml=RecordedNvml(doc), graphics_relist_seconds=0.0)
        for _ in range(3):
            now_src.read()
        assert now_src.graphics_listings == 3  # a cadence of 0: every poll, as before
    finally:
        holder.kill()
        holder.wait()
