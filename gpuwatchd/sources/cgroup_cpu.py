"""CPU throttling of a process's cgroup: ``cpu.stat`` (CFS bandwidth control).

Finds the process's cpu cgroup from its ``/proc/PID/cgroup`` as the process view read it
(``CgroupPaths``, sources/memcg.py), then reads that cgroup's ``cpu.stat``:
cgroup v1 (``/sys/fs/cgroup/cpu,cpuacct/PATH/cpu.stat``: ``nr_periods``, ``nr_throttled``,
``throttled_time`` in ns) or v2 (``/sys/fs/cgroup/PATH/cpu.stat``: ``throttled_usec``). A quota
(``cpu.cfs_quota_us`` / ``cpu.max``) that the rank keeps hitting shows as ``nr_throttled`` growing.
Cost: two small reads per rank per cycle. Privilege: none (world-readable).
Shell equivalent: ``cat /sys/fs/cgroup/cpu$(grep -Po '(?<=:cpu,cpuacct:|:cpu:).*' /proc/PID/cgroup)/cpu.stat``.
"""

from __future__ import annotations

import os

from gpuwatchd.model import CgroupPaths, CpuStat
from gpuwatchd.paths import HostPaths

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


def cpu_stat_path(paths: HostPaths, where: CgroupPaths) -> str | None:
    """The cpu.stat of the cpu cgroup ``where`` names (the process view's reading of
    /proc/PID/cgroup), or None (no cpu controller, or not there)."""
    root = paths.sys("fs", "cgroup")
    if where.cpu_v1:
        rel = where.cpu_v1.lstrip("/")
        if ".." not in rel.split("/"):
            for mount in V1_MOUNTS:
                candidate = os.path.join(root, mount, rel, "cpu.stat")
                if os.path.exists(candidate):
                    return candidate
    rel = where.unified.lstrip("/")
    if where.unified and ".." not in rel.split("/"):
        for base in (root, os.path.join(root, "unified")):
            candidate = os.path.join(base, rel, "cpu.stat")
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
