"""The GPU subsystem inside the real daemon: NVML replayed from the H200 recording, real local
processes as rank and stale holder, real rank files, the real join, findings and exporter."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import generate_latest

from gpuwatchd.config.schema import Config, load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.stall import StallSubsystem
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.join.stall_spin import GpuReading
from gpuwatchd.model import RankId
from gpuwatchd.model.parts import StallOutput
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.nvml_fixture import fixture_source
from gpuwatchd.sources.pyspy import PySpy

FIX = Path(__file__).parent / "fixtures" / "nvml"
UUID = "GPU-d6a79800-1da5-699b-0f9c-f55eb218f8b2"


class RecordedUevents:
    """What the udev thread reads a pyudev ``Monitor`` through (``fileno``, ``poll``), handing it
    recorded uevents: no GPU here to unplug (tests/test_nvml.py sends a real one through netlink)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        self._queue: collections.deque[types.SimpleNamespace] = collections.deque()
        self._lock = threading.Lock()
        self._drained = threading.Event()

    def start(self) -> None:
        pass

    def fileno(self) -> int:
        return self._r

    def send(self, action: str, props: dict[str, str]) -> None:
        """One uevent; returns once the watcher has handled it (asked for the next one)."""
        with self._lock:
            self._drained.clear()
            self._queue.append(types.SimpleNamespace(action=action, properties=props))
        os.write(self._w, b"x")
        assert self._drained.wait(10), "the udev thread did not take the uevent"

    def poll(self, timeout: float = 0) -> types.SimpleNamespace | None:
        with self._lock:
            if self._queue:
                os.read(self._r, 1)
                return self._queue.popleft()
            self._drained.set()
            return None

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def _daemon(
    tmp_path: Path,
    fixture: Path,
    pid_map: dict[int, int],
    watch_xid: bool = True,
    udev: RecordedUevents | None = None,
) -> tuple[Daemon, NvmlSubsystem]:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"rank_dir: {tmp_path / 'ranks'}\nstate_dir: {tmp_path / 'state'}\n"
        "orphans:\n  grace_seconds: 0\ngil:\n  enabled: false\ndiscovery:\n  enabled: false\n"
    )
    cfg = load_config(str(cfg_file))
    # the fixture's Xid events replay through the same RecordedNvml
    d = Daemon(
        cfg,
        parts=lambda c, s: Parts(
            nvml=NvmlSubsystem(
                c,
                s,
                source=fixture_source(str(fixture), pid_map),
                watch_xid=watch_xid,
                watch_udev=udev is not None,
                udev_monitor=udev,
            )
        ),
    )
    sub = d.parts.nvml
    assert isinstance(sub, NvmlSubsystem)
    sub.start(d)
    return d, sub


def test_daemon_joins_gpu_memory_to_ranks_and_flags_the_orphan(tmp_path: Path) -> None:
    # the rank and two children (DataLoader-like workers): its process tree
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; cs=[subprocess.Popen([sys.executable,'-c',"
            "'import time; time.sleep(120)']) for _ in range(2)]; "
            "print(*[c.pid for c in cs], flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    assert rank.stdout is not None
    kids = [int(x) for x in rank.stdout.readline().split()]
    wrapper = subprocess.Popen(
        ["sh", "-c", f"nohup {sys.executable} -c 'import time; time.sleep(120)' >/dev/null 2>&1 & echo $!; wait"],
        stdout=subprocess.PIPE,
    )
    assert wrapper.stdout is not None
    stale = int(wrapper.stdout.readline())
    wrapper.kill()
    wrapper.wait()
    write_rank_file(
        str(tmp_path / "ranks"),
        {"version": 1, "job_id": "dflash", "world_size": 1, "ranks": [{"rank": 0, "pid": rank.pid}]},
        "dflash.json",
    )
    d, sub = _daemon(
        tmp_path, FIX / "derived_gpu_lost_xid.json", {447: rank.pid, 449: kids[0], 450: kids[1], 453: stale}
    )
    try:
        state = d.cycle()
        deadline = time.monotonic() + 5
        while d.counters.get("gpu_xid_errors", ("0", UUID, "79")) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        state = d.cycle()
        text = generate_latest(d.registry).decode()
    finally:
        sub.stop()
        for pid in (stale, *kids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        rank.kill()
        rank.wait()
    assert [g.index for g in state.gpus] == [0]  # GPU 1 of this recording is lost
    nvml = next(c for c in state.collectors if c.name == "nvml")
    assert nvml.success
    rows = {r.pid: r for r in state.gpu_processes}
    assert rows[rank.pid].job_id == "dflash" and rows[rank.pid].rank == "0"
    assert rows[stale].job_id == ""
    assert [(o.pid, o.reason) for o in state.orphans] == [(stale, "reparented_to_init")]
    kinds = {f.kind for f in state.findings}
    assert "orphan_gpu_memory" in kinds
    assert (
        f'gpuwatch_orphan_gpu_memory_bytes{{comm="{rows[stale].comm}",gpu="0",pid="{stale}",'
        f'reason="reparented_to_init",user="root",uuid="{UUID}"}} 6.00834048e+09'
    ) in text
    # the rank's tree (rank + 2 children) holds the memory of recorded PIDs 447, 449 and 450
    assert {r.pid for r in state.gpu_processes if r.job_id == "dflash"} == {rank.pid, *kids}
    held = sum(r.used_memory_bytes or 0 for r in state.gpu_processes if r.job_id == "dflash")
    assert held == 2787115008 + 2 * 660602880
    assert 'gpuwatch_rank_gpu_memory_bytes{gpu="0",job_id="dflash",rank="0"} 4.108320768e+09' in text
    assert f'gpuwatch_gpu_xid_errors_total{{gpu="0",uuid="{UUID}",xid="79"}} 1.0' in text
    assert 'gpuwatch_collector_success{collector="nvml"} 1.0' in text
    # gpuwatchd ps reads the state file the daemon just wrote: GPU memory per rank and the
    # stale holder under its GPU
    ps = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "ps", "--config.file", str(tmp_path / "config.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).parent.parent),
    )
    assert ps.returncode == 0, ps.stderr
    (rank_line,) = [ln for ln in ps.stdout.splitlines() if ln.startswith("dflash")]
    assert " 3.8 GiB " in rank_line, ps.stdout
    (stale_line,) = [ln for ln in ps.stdout.splitlines() if f"pid {stale:>7}" in ln]
    assert "reparented_to_init" in stale_line and "5.6" in stale_line
    assert 'gpuwatch_gpu_info{gpu="0",name="NVIDIA H200",pci_bus_id="00000000:00:06.0"' in text


def test_nvml_failing_mid_run_marks_the_collector_down_and_the_daemon_goes_on(tmp_path: Path) -> None:
    # no Xid thread here: its registration would consume one replayed cycle
    d, sub = _daemon(tmp_path, FIX / "derived_raise_mid_cycle.json", {}, watch_xid=False)
    try:
        first = d.cycle()
        second = d.cycle()  # GPU_IS_LOST on the only GPU
        third = d.cycle()  # nvmlDeviceGetCount fails
        fourth = d.cycle()  # re-initialised, reading again
    finally:
        sub.stop()
    status = [next(c for c in s.collectors if c.name == "nvml") for s in (first, second, third, fourth)]
    assert [s.success for s in status] == [True, False, False, True]
    assert "GPU 0" in status[1].error
    assert second.gpus == first.gpus  # last good reading kept while recent
    assert fourth.gpus and json.dumps([g.uuid for g in fourth.gpus]) == json.dumps([UUID])


def test_udev_remove_raises_gpu_lost_at_once_and_reinitialises_nvml(tmp_path: Path) -> None:
    from gpuwatchd.sources.udev import parse_uevent_file

    udev = RecordedUevents()
    d, sub = _daemon(tmp_path, FIX / "h200_orphan_dataloader.json", {}, watch_xid=False, udev=udev)
    try:
        d.cycle()
        lib = sub.source.library
        assert lib.init_calls == 1
        props = parse_uevent_file((FIX / "h200_pci_uevent.txt").read_text())
        udev.send("remove", props)
        state = d.cycle()
        (lost,) = [f for f in state.findings if f.kind == "gpu_lost"]
        assert lost.severity == "page" and f"GPU 0 ({UUID}, PCI 0000:00:06.0)" in lost.explanation
        assert lib.init_calls == 2  # NVML re-initialised: its device list is fixed at nvmlInit
        udev.send("add", props)
        state = d.cycle()
        assert not [f for f in state.findings if f.kind == "gpu_lost"]
    finally:
        sub.stop()
        udev.close()


def test_nvml_gpu_is_lost_becomes_one_gpu_lost_finding(tmp_path: Path) -> None:
    d, sub = _daemon(tmp_path, FIX / "derived_gpu_lost_xid.json", {}, watch_xid=False)
    try:
        state = d.cycle()
    finally:
        sub.stop()
    assert [g.index for g in state.gpus] == [0]
    (lost,) = [f for f in state.findings if f.kind == "gpu_lost"]
    assert lost.explanation.startswith("GPU 1: NVML reports the GPU is lost")
    nvml = next(c for c in state.collectors if c.name == "nvml")
    assert nvml.success  # the other GPU is still read


class SeenGpus(StallSubsystem):
    """The real stall part, keeping the GPU readings the track stage hands it each cycle."""

    def __init__(self, config: Config, services: Services) -> None:
        super().__init__(config, services, spy=PySpy(None, unavailable_reason="not needed here"))
        self.seen: list[dict[RankId, GpuReading]] = []

    def track(
        self, daemon: DaemonContext, ranks: Ranks, beats: Mapping[RankId, float], gpus: Mapping[RankId, GpuReading]
    ) -> StallOutput:
        self.seen.append(dict(gpus))
        return super().track(daemon, ranks, beats, gpus)


def test_the_stall_part_gets_this_cycles_gpu_readings_of_a_rank_that_names_no_gpu(tmp_path: Path) -> None:
    """NVML is read before the stall part, which is handed each rank's GPU readings of the same
    cycle as an argument (not the last state's, after the join): at the first cycle already, for
    a rank whose rank file names no GPU (the tree's GPU memory makes the GPU its own)."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    write_rank_file(
        str(tmp_path / "ranks"),
        {"version": 1, "job_id": "gpus-now", "world_size": 1, "ranks": [{"rank": 0, "pid": rank.pid}]},
        "gpus-now.json",
    )
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"rank_dir: {tmp_path / 'ranks'}\nstate_dir: {tmp_path / 'state'}\n"
        "gil:\n  enabled: false\ndiscovery:\n  enabled: false\n"
    )
    d = Daemon(
        load_config(str(cfg_file)),
        parts=lambda c, s: Parts(
            stall=SeenGpus(c, s),
            nvml=NvmlSubsystem(
                c,
                s,
                source=fixture_source(str(FIX / "h200_orphan_dataloader.json"), {447: rank.pid}),
                watch_xid=False,
                watch_udev=False,
            ),
        ),
    )
    try:
        state = d.cycle()
    finally:
        d.shutdown()
        rank.kill()
        rank.wait()
    stall = d.parts.stall
    assert isinstance(stall, SeenGpus)
    (gpu,) = [g for g in state.gpus if g.index == 0]
    assert stall.seen == [
        {("gpus-now", 0): GpuReading(state.timestamp, gpu.utilization_ratio, gpu.memory_utilization_ratio, False)}
    ]
