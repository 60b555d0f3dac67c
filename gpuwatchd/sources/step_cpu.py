"""What the straggler tracker (join/straggler.py) reads each cycle: the heartbeat step of each rank
whose heartbeat changed (sources/heartbeat_step.py, in the rank's own root through the daemon's
``HeartbeatRoots.step``), and each heartbeat rank's cgroup ``cpu.stat`` (sources/cgroup_cpu.py).

Cost: one small read per changed heartbeat; one ``cpu.stat`` read per cgroup per cycle (the
ranks of a job share one), its path found once per cgroup the process view reads for the rank
(daemon/proc_view.py: /proc/PID/cgroup re-read every 30 s), again at once when the file is gone.
Privilege: read access to the cgroup file system. Shell equivalent: ``cat /sys/fs/cgroup/$(cut -d: -f3
/proc/PID/cgroup)/cpu.stat``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gpuwatchd.model import CgroupPaths, CpuStat, RankEntry, RankId
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.cgroup_cpu import cpu_stat_path, read_cpu_stat_present
from gpuwatchd.sources.heartbeat_step import read_step


class StepCpuReader:
    def __init__(
        self, paths: HostPaths | None = None, step_of: Callable[[RankEntry], int | None] | None = None
    ) -> None:
        """``step_of``: reads a rank's heartbeat step (the daemon's ``HeartbeatRoots.step``, in
        the rank's own root); by default the heartbeat path in this process's view."""
        self.paths = paths or HostPaths()
        self.step_of = step_of or (lambda e: read_step(e.heartbeat, e.owner_uid) if e.heartbeat else None)
        # each cgroup of the ranks given last -> its cpu.stat path (None: no cpu controller)
        self._paths: dict[CgroupPaths, str | None] = {}
        self.path_lookups = 0  # cpu.stat paths looked for (tests, benchmarks)

    def steps(self, entries: Iterable[RankEntry]) -> dict[RankId, int | None]:
        return {e.rank_id: self.step_of(e) for e in entries}

    def cpu_stats(self, entries: Iterable[RankEntry],
                  cgroups: Mapping[int, CgroupPaths]) -> dict[RankId, CpuStat | None]:  # fmt: skip
        """Each heartbeat rank's cpu.stat throttling counters (None: unknown, or no cpu
        controller), its cgroup as the process view read it (``cgroups``: rank PID -> its
        cgroup); the path cache keeps the cgroups of the ranks given, and only them."""
        out: dict[RankId, CpuStat | None] = {}
        stats: dict[str, tuple[bool, CpuStat | None]] = {}  # cpu.stat path -> this cycle's reading
        keep: dict[CgroupPaths, str | None] = {}
        for e in entries:
            where = cgroups.get(e.pid)
            if not e.heartbeat or where is None:
                continue
            if where in keep or where in self._paths:
                path = keep.get(where, self._paths.get(where))
            else:
                self.path_lookups += 1
                path = cpu_stat_path(self.paths, where)
            keep[where] = path
            if path is not None:
                if path not in stats:
                    stats[path] = read_cpu_stat_present(path)
                present, out[e.rank_id] = stats[path]
                if not present:  # gone (the cgroup was removed): looked for again next cycle
                    keep.pop(where, None)
        self._paths = keep
        return out
