"""Why NVML cannot open the GPUs: the device cgroup (systemd's DevicePolicy=) or no driver.

systemd expands the unit's ``DeviceAllow=char-nvidia* rw`` from /proc/devices when the service
starts. A driver part registered later (the driver loaded by udev after gpuwatchd started,
``nvidia-caps``, a reinstalled driver with new majors) stays denied until the service restarts:
every open(2) of its nodes fails with EPERM, which NVML reports as "no permission" or "driver not
loaded". This probe tells the cases apart by opening each node NVML needs, once, when NVML failed:

- EPERM: denied by the device cgroup. When /proc/devices now lists the node's major under an
  ``nvidia*`` name, the policy was expanded before the driver registered it and a restart fixes
  it (``DeviceProbe.restart_helps``); otherwise no driver owns the major (a stale node).
- ENXIO/ENODEV: allowed; no driver behind the node. EACCES: file mode (nvidia-caps are 0400 root).

Reads: /proc/devices (about 1 KB), the names under /dev (nvidiactl, nvidia[0-9]*,
nvidia-caps/*); opens each node O_RDONLY|O_NONBLOCK and closes it at once. Only runs after NVML
failed, in the NVML collector's thread (under its time-out). Privilege: none. Shell equivalent::

    cat /proc/devices; for d in /dev/nvidiactl /dev/nvidia[0-9]*; do head -c0 $d; done
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import stat

_GPU_NODE = re.compile(r"nvidia(ctl|[0-9]+)\Z")
MAX_NODES = 256  # 8 GPUs, nvidiactl and MIG caps fit many times over; bounded on a hostile /dev
MAX_PROC_DEVICES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class NodeResult:
    path: str
    major: int
    minor: int
    error: str  # "" when the open succeeded, else the errno name (EPERM, ENXIO, ...)


@dataclasses.dataclass(frozen=True)
class DeviceProbe:
    nodes: tuple[NodeResult, ...]
    drivers: dict[int, str]  # char major -> name, the nvidia* groups /proc/devices lists now

    @property
    def denied(self) -> tuple[NodeResult, ...]:
        return tuple(n for n in self.nodes if n.error == "EPERM")

    @property
    def restart_helps(self) -> tuple[NodeResult, ...]:
        """Denied nodes whose major a driver registered: a restart re-expands char-nvidia*."""
        return tuple(n for n in self.denied if n.major in self.drivers)

    def explain(self) -> str:
        """One line saying why the nodes are denied (cause first: the collector's error is kept
        to 300 characters), or "" when nothing is denied."""
        if not self.denied:
            return ""
        by_major: dict[int, list[str]] = {}
        for n in self.denied:
            by_major.setdefault(n.major, []).append(n.path)
        groups = "; ".join(
            f"major {m} ({self.drivers[m]!r} in /proc/devices)"
            if m in self.drivers
            else f"major {m} (no driver in /proc/devices)"
            for m in sorted(by_major)
        )
        nodes = ", ".join(p for m in sorted(by_major) for p in by_major[m])
        if self.restart_helps:
            why = (
                "EPERM: the device cgroup denies NVIDIA devices that a driver registered after "
                "systemd expanded the unit's DeviceAllow=char-nvidia* at service start; a "
                "restart re-expands it"
            )
        else:
            why = (
                "EPERM: the device cgroup denies NVIDIA device nodes that no driver owns now "
                "(driver not loaded, or stale nodes); a restart would not help"
            )
        return f"{why}: {groups}: {nodes}"


def nvidia_drivers(proc_devices: str) -> dict[int, str]:
    """Character-device majors whose group name starts with "nvidia" (nvidia-frontend, nvidiactl,
    nvidia-uvm, nvidia-caps, ...), from the text of /proc/devices."""
    out: dict[int, str] = {}
    in_char = False
    for line in proc_devices.splitlines():
        if line.strip().endswith(":"):
            in_char = line.strip() == "Character devices:"
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[0].isdigit() and fields[1].startswith("nvidia"):
            out[int(fields[0])] = fields[1]
    return out


def _candidates(dev: str) -> list[str]:
    try:
        names = sorted(n for n in os.listdir(dev) if _GPU_NODE.match(n))
    except OSError:
        return []
    paths = [os.path.join(dev, n) for n in names]
    caps = os.path.join(dev, "nvidia-caps")
    with contextlib.suppress(OSError):
        paths += [os.path.join(caps, n) for n in sorted(os.listdir(caps))]
    return paths[:MAX_NODES]


def probe(dev: str = "/dev", proc_devices: str = "/proc/devices") -> DeviceProbe:
    """Open each NVIDIA node NVML needs once and record the errno (see the module docstring)."""
    nodes: list[NodeResult] = []
    for path in _candidates(dev):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, str(e.errno))
            nodes.append(NodeResult(path, major, minor, name))
            continue
        os.close(fd)
        nodes.append(NodeResult(path, major, minor, ""))
    try:
        with open(proc_devices, encoding="ascii", errors="replace") as f:
            text = f.read(MAX_PROC_DEVICES)
    except OSError:
        text = ""
    return DeviceProbe(tuple(nodes), nvidia_drivers(text))
