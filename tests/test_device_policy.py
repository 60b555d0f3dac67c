"""The NVIDIA device probe and the bounded restart for a late driver (gpuwatchd/daemon/device_policy.py),
with real device nodes (mknod 195:255, 195:0, 511:1 in a temporary /dev) opened from a process in
a real v1 devices cgroup: EPERM where the cgroup denies them, ENXIO where it allows them and no
driver answers. The booted-systemd version (the unit, Restart=, re-expansion) is in
tests/test_systemd_boot.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpuwatchd.daemon.device_policy import EXIT_REEXPAND, MARKER, DevicePolicyGuard
from gpuwatchd.sources.nvidia_devices import DeviceProbe, nvidia_drivers

ROOT = Path(__file__).resolve().parent.parent
NO_NVIDIA = "Character devices:\n  1 mem\n  4 tty\n\nBlock devices:\n  8 sd\n"
WITH_NVIDIA = (
    "Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-uvm\n511 nvidia-caps\n"
    "\nBlock devices:\n  8 sd\n195 nvidia-not-a-char-device\n"
)
PROBE = (
    "import json, sys\nfrom gpuwatchd.sources.nvidia_devices import probe\n"
    "r = probe(sys.argv[1], sys.argv[2])\n"
    "print(json.dumps([[n.path, n.major, n.minor, n.error] for n in r.nodes]))\n"
)


def _fake_dev(tmp: Path) -> Path:
    dev = tmp / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name, major, minor in (("nvidiactl", 195, 255), ("nvidia0", 195, 0), ("nvidia-caps/nvidia-cap1", 511, 1)):
        os.mknod(dev / name, 0o20666, os.makedev(major, minor))
    (dev / "nvidia-uvm-tools").write_text("")  # not a node NVML opens: never probed
    return dev


def _probe_in_cgroup(tmp: Path, rules: list[str], proc_devices: Path) -> list[list[object]]:
    cg = Path(f"/sys/fs/cgroup/devices/gwsystemd-devprobe-{os.getpid()}")
    cg.mkdir()
    try:
        (cg / "devices.deny").write_text("a\n")
        for rule in rules:
            (cg / "devices.allow").write_text(rule + "\n")
        out = subprocess.run(
            [
                "sh",
                "-c",
                f'echo $$ > {cg}/cgroup.procs && exec "$@"',
                "sh",
                sys.executable,
                "-c",
                PROBE,
                str(tmp / "dev"),
                str(proc_devices),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
            check=True,
        )
        result: list[list[object]] = json.loads(out.stdout)
        return result
    finally:
        cg.rmdir()


def test_eperm_means_denied_by_the_device_cgroup_enxio_means_allowed(tmp_path: Path) -> None:
    _fake_dev(tmp_path)
    devices = tmp_path / "devices"
    devices.write_text(WITH_NVIDIA)
    denied = _probe_in_cgroup(tmp_path, ["c 1:3 rwm"], devices)
    assert sorted(n[3] for n in denied) == ["EPERM"] * 3, denied
    allowed = _probe_in_cgroup(tmp_path, ["c 195:* rw", "c 511:* rw"], devices)
    assert sorted(n[3] for n in allowed) == ["ENXIO"] * 3, allowed


def test_proc_devices_names_only_nvidia_character_majors() -> None:
    assert nvidia_drivers(WITH_NVIDIA) == {195: "nvidia-frontend", 236: "nvidia-uvm", 511: "nvidia-caps"}
    assert nvidia_drivers(NO_NVIDIA) == {}
    assert nvidia_drivers("garbage\n\0\xff 12\n195\n") == {}


def _real_probe(tmp: Path, devices_text: str) -> DeviceProbe:
    """What the probe says from inside a devices cgroup that denies the nodes, rebuilt here."""
    from gpuwatchd.sources.nvidia_devices import NodeResult

    devices = tmp / "devices"
    devices.write_text(devices_text)
    nodes = _probe_in_cgroup(tmp, ["c 1:3 rwm"], devices)
    return DeviceProbe(
        tuple(NodeResult(str(p), int(str(ma)), int(str(mi)), str(e)) for p, ma, mi, e in nodes),
        nvidia_drivers(devices_text),
    )


def test_one_restart_per_boot_and_majors_and_none_without_a_driver(tmp_path: Path) -> None:
    _fake_dev(tmp_path)
    state = tmp_path / "state"
    no_driver = _real_probe(tmp_path, NO_NVIDIA)
    guard = DevicePolicyGuard(str(state), "boot-a", probe_fn=lambda: no_driver)
    why = guard.diagnose()
    assert "no driver in /proc/devices" in why and "a restart would not help" in why
    assert str(tmp_path / "dev" / "nvidiactl") in why
    assert guard.restart_reason() == ""  # a restart would not help: no exit, no marker
    assert not (state / MARKER).exists()

    late = _real_probe(tmp_path, WITH_NVIDIA)
    guard = DevicePolicyGuard(str(state), "boot-a", probe_fn=lambda: late)
    assert "'nvidia-frontend' in /proc/devices" in guard.diagnose()
    why = guard.restart_reason()
    assert f"status {EXIT_REEXPAND}" in why
    assert (state / MARKER).read_text() == "boot-a 195,511\n"
    # the restarted daemon still denied (a drop-in, a container): no second exit this boot
    again = DevicePolicyGuard(str(state), "boot-a", probe_fn=lambda: late)
    again.diagnose()
    assert again.restart_reason() == ""
    # the next boot may restart once more
    nextboot = DevicePolicyGuard(str(state), "boot-b", probe_fn=lambda: late)
    nextboot.diagnose()
    assert nextboot.restart_reason() != ""


def test_probe_is_rate_limited(tmp_path: Path) -> None:
    calls = []
    now = [0.0]

    def counted() -> DeviceProbe:
        calls.append(now[0])
        return DeviceProbe((), {})

    guard = DevicePolicyGuard(str(tmp_path), "b", probe_fn=counted, clock=lambda: now[0])
    for t in (0.0, 1.0, 14.0, 15.0, 16.0, 31.0):
        now[0] = t
        assert guard.diagnose() == ""
    assert calls == [0.0, 15.0, 31.0]
