"""What the straggler tracker (join/straggler.py) reads each cycle: the heartbeat step of each rank
whose heartbeat changed (sources/heartbeat_step.py, in the rank's own root through the daemon's
``HeartbeatRoots.step``), and each heartbeat rank's cgroup ``cpu.stat`` (sources/cgroup_cpu.py).

Cost: one small read per changed heartbeat; one ``cpu.stat`` read per cgroup per cycle (the
ranks of a job share one), its path looked up from /proc/PID/cgroup once per rank every
``CGROUP_PATH_TTL`` seconds, or at once when the file is gone. Privilege: read access to /proc
and the cgroup file system. Shell equivalent: ``cat /sys/fs/cgroup/$(cut -d: -f3
/proc/PID/cgroup)/cpu.stat``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gpuwatchd.model import CpuStat, RankEntry, RankId, RankProcess
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.cgroup_cpu import cgroup_cpu_stat_path, read_cpu_stat_present
from gpuwatchd.sources.heartbeat_step import read_step

# A process moves to another cgroup only when something moves it (rare for a training rank): its
# cpu.stat path is looked up again this often, or at once when reading it fails.
CGROUP_PATH_TTL = 60.0


class StepCpuReader:
    def __init__(self, paths: HostPaths | None = None,
                 step_of: Callable[[RankEntry], int | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``step_of``: reads a rank's heartbeat step (the daemon's ``HeartbeatRoots.step``, in
        the rank's own root); by default the heartbeat path in this process's view."""
        self.paths = paths or HostPaths()
        self.step_of = step_of or (lambda e: read_step(e.heartbeat, e.owner_uid) if e.heartbeat
                                   else None)
        self.clock = clock
        # (job_id, rank, pid) -> (its cpu.stat path, when looked up)
        self._paths: dict[RankProcess, tuple[str | None, float | None]] = {}
        self.path_lookups = 0  # /proc/PID/cgroup reads for a cpu.stat path (tests, benchmarks)

    def steps(self, entries: Iterable[RankEntry]) -> dict[RankId, int | None]:
        return {e.rank_id: self.step_of(e) for e in entries}

    def cpu_stats(self, entries: Iterable[RankEntry]) -> dict[RankId, CpuStat | None]:
        """Each heartbeat rank's cpu.stat throttling counters (None: unknown, or no cpu
        controller); the path cache keeps the ranks given, and only them."""
        now = self.clock()
        out: dict[RankId, CpuStat | None] = {}
        stats: dict[str, tuple[bool, CpuStat | None]] = {}  # cpu.stat path -> this cycle's reading
        keep: dict[RankProcess, tuple[str | None, float | None]] = {}
        for e in entries:
            if not e.heartbeat:
                continue
            key = e.rank_process
            path, at = self._paths.get(key, (None, None))
            if at is None or abs(now - at) >= CGROUP_PATH_TTL:
                self.path_lookups += 1
                path, at = cgroup_cpu_stat_path(self.paths, e.pid), now
            if path is not None:
                if path not in stats:
                    stats[path] = read_cpu_stat_present(path)
                present, out[e.rank_id] = stats[path]
                if not present:
                    at = None  # gone (the cgroup was removed, the rank moved): look again
            keep[key] = (path, at)
        self._paths = keep
        return out
