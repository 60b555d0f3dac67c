"""The daemon's per-cycle process view: each rank tree's /proc reading, its cgroup and its NCCL
environment flags, in one pass with one /proc/PID/stat per process (``ProcfsReader.begin_cycle``
in the spirit of psutil's ``oneshot()``).

Reads, per rank PID: /proc/PID/stat, status, fd count, limits (``ProcfsReader.read_process``),
its descendants' same files, /proc/PID/cgroup (re-read every ``CGROUP_TTL`` seconds per
process) and, once per process, the names of the watched NCCL variables in /proc/PID/environ
(values end here). Cost: a few small reads per process per cycle. Privilege: root or the
processes' owner (environ, fd). Shell: ``cat /proc/PID/{stat,status,cgroup}``, ``ls /proc/PID/fd``.

The daemon reads every rank's tree through one view each cycle; ``gpuwatchd doctor`` reads one
PID's tree through its own, so that both see a process the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.findings import nccl_env
from gpuwatchd.model import CgroupPaths, ProcessInfo, RankProcess, frozen_map
from gpuwatchd.sources.memcg import parse_cgroup_file
from gpuwatchd.sources.procfs import ProcfsReader

CGROUP_TTL = 30.0  # a rank's cgroup rarely changes: /proc/PID/cgroup is re-read this often


@dataclass(frozen=True)
class ProcReading:
    """The view's reading of the rank trees (``ProcView.read``, the only producer)."""

    processes: Mapping[int, ProcessInfo]
    descendants: Mapping[int, tuple[int, ...]]
    env_flags: Mapping[int, tuple[str, ...]]
    # (job_id, rank, pid) -> heartbeat mtime: keyed by the claim's pid, so that only the
    # accepted claim's heartbeat is used (a refused claim on the same rank has another pid);
    # filled by the daemon's procfs collector, which reads the heartbeats with the trees
    progress: Mapping[RankProcess, float] = field(default_factory=frozen_map)
    # rank PID -> its cgroup (/proc/PID/cgroup), re-read every CGROUP_TTL seconds per process
    cgroups: Mapping[int, CgroupPaths] = field(default_factory=frozen_map)


class ProcView:
    """Reads the trees of the given root PIDs; remembers, per (pid, start ticks), the cgroup (for
    ``CGROUP_TTL``) and the NCCL flags (for the process's life), and only of the processes of
    the last reading: nothing grows with job churn."""

    def __init__(self, procfs: ProcfsReader) -> None:
        self.procfs = procfs
        self._env_cache: dict[tuple[int, int], tuple[str, ...]] = {}
        # (pid, start ticks) -> (when read, its cgroup)
        self._cgroup_cache: dict[tuple[int, int], tuple[float, CgroupPaths | None]] = {}

    def read(self, roots: Iterable[int]) -> ProcReading:
        procfs = self.procfs
        processes: dict[int, ProcessInfo] = {}
        descendants: dict[int, tuple[int, ...]] = {}
        env_flags: dict[int, tuple[str, ...]] = {}
        cgroups: dict[int, CgroupPaths] = {}
        live_keys: set[tuple[int, int]] = set()
        now = time.monotonic()
        for pid in roots:
            if pid in processes or pid in descendants:
                continue
            info = procfs.read_process(pid)
            if info is None:
                continue
            processes[pid] = info
            kids = procfs.descendants(pid)
            processes.update(procfs.read_many(k for k in kids if k not in processes))
            descendants[pid] = tuple(k for k in kids if k in processes)  # drop those gone meanwhile
            key = (pid, info.start_ticks)
            live_keys.add(key)
            hit = self._cgroup_cache.get(key)
            if hit is None or now - hit[0] >= CGROUP_TTL:
                text = procfs.cgroup(pid)
                hit = self._cgroup_cache[key] = (now, parse_cgroup_file(text) if text is not None else None)
            if hit[1] is not None:
                cgroups[pid] = hit[1]
            if key not in self._env_cache:
                env = procfs.environ_values(pid, nccl_env.WATCHED_VARS)
                if env is None:  # not readable yet (mid-exec) or not permitted: try next cycle
                    continue
                self._env_cache[key] = nccl_env.env_flags(env)  # names only: values end here
            env_flags[pid] = self._env_cache[key]
        for stale in set(self._env_cache) - live_keys:
            del self._env_cache[stale]
        for stale in set(self._cgroup_cache) - live_keys:
            del self._cgroup_cache[stale]
        procfs.forget(live_keys | {(p.pid, p.start_ticks) for p in processes.values()})
        return ProcReading(processes, descendants, env_flags, cgroups=cgroups)
