"""CPU throttling of a process's cgroup: ``cpu.stat`` (CFS bandwidth control).

Reads ``/proc/PID/cgroup`` to find the process's cpu cgroup, then that cgroup's ``cpu.stat``:
cgroup v1 (``/sys/fs/cgroup/cpu,cpuacct/PATH/cpu.stat``: ``nr_periods``, ``nr_throttled``,
``throttled_time`` in ns) or v2 (``/sys/fs/cgroup/PATH/cpu.stat``: ``throttled_usec``). A quota
(``cpu.cfs_quota_us`` / ``cpu.max``) that the rank keeps hitting shows as ``nr_throttled`` growing.
Cost: two small reads per rank per cycle. Privilege: none (world-readable).
Shell equivalent: ``cat /sys/fs/cgroup/cpu$(grep -Po '(?<=:cpu,cpuacct:|:cpu:).*' /proc/PID/cgroup)/cpu.stat``.
"""

from __future__ import annotations

import os

from gpuwatchd.model import CpuStat
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.procfs import read_proc_cgroup

V1_MOUNTS = ("cpu,cpuacct", "cpu", "cpuacct,cpu")


def _read(path: str, limit: int = 8192) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def parse_cpu_stat(text: str) -> CpuStat | None:
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            fields[key] = int(value)
    if "nr_throttled" not in fields:
        return None
    if "throttled_time" in fields:  # v1, nanoseconds
        seconds = fields["throttled_time"] / 1e9
    else:  # v2, microseconds
        seconds = fields.get("throttled_usec", 0) / 1e6
    return CpuStat(fields.get("nr_periods", 0), fields["nr_throttled"], seconds)


def cgroup_cpu_stat_path(paths: HostPaths, pid: int) -> str | None:
    """The cpu.stat of ``pid``'s cpu cgroup, or None (gone, no cpu controller)."""
    text = read_proc_cgroup(paths, pid)
    if text is None:
        return None
    root = paths.sys("fs", "cgroup")
    unified = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if ".." in rel.split("/"):
            continue
        if "cpu" in controllers.split(","):
            for mount in V1_MOUNTS:
                candidate = os.path.join(root, mount, rel, "cpu.stat")
                if os.path.exists(candidate):
                    return candidate
        elif controllers == "":
            unified = rel
    if unified is not None:
        for base in (root, os.path.join(root, "unified")):
            candidate = os.path.join(base, unified, "cpu.stat")
            if os.path.exists(candidate):
                return candidate
    return None


def read_cpu_stat_present(path: str) -> tuple[bool, CpuStat | None]:
    """(is the file there, its throttling counters): a cgroup v2 whose ``cpu`` controller is not
    enabled has a ``cpu.stat`` with usage only (None), which is not a reason to look for the
    cgroup again; a file that is gone is."""
    try:
        return True, parse_cpu_stat(_read(path))
    except OSError:
        return False, None
