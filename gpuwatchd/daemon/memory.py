"""The memory subsystem of the daemon: host memory per rank and per node, each cycle, and the
evidence snapshots of ``rank_memory_pressure``.

``track``: for every live rank, the memory cgroup level that bounds it, its tree's RSS and
their growth (sources/memcg.py, memory_tracker.py), plus the node's MemAvailable and PSI; handed to
the join as ``rank_memory`` / ``node_memory`` (exported) and to findings/rank_memory_pressure.py,
with the ``memory`` collector status. ``after_join``: when ``rank_memory_pressure`` is raised for a
rank, or gets worse, one snapshot (memory_evidence.py) is taken in the background: a non-blocking
py-spy dump never holds up the cycle. Snapshots go into the daemon's event log (one
writer, daemon/services.py), where a following OOM kill of the rank links to the last one.

Cost: a few small /sys and /proc reads per rank per cycle (sources/memcg.py); one py-spy dump per
snapshot (~10-100 ms of py-spy's CPU, nothing measurable on the target: ``--nonblocking``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from gpuwatchd.config.schema import Config
from gpuwatchd.daemon.memory_evidence import snapshot_event, worse
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.findings.rank_memory_pressure import KIND
from gpuwatchd.isolation import guarded
from gpuwatchd.join.memory_tracker import MemoryTracker, TrackedRank
from gpuwatchd.model import (
    CgroupMemory,
    CgroupPaths,
    CollectorStatus,
    Finding,
    NodeMemoryState,
    NodeState,
    ProcessInfo,
    RankId,
    RankMemory,
    RankProcess,
    rank_alive,
)
from gpuwatchd.model.parts import MemoryOutput
from gpuwatchd.sources.memcg import MemcgReader
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import PySpyError

log = logging.getLogger(__name__)


class MemorySubsystem(Subsystem):
    name = "memory"

    def __init__(
        self, config: Config, services: Services, *, reader: MemcgReader | None = None, spy: PySpy | None = None
    ) -> None:
        """``reader``: the memcg reader (default: the host's, under ``memory.cgroup_root``);
        ``spy``: the py-spy runner (default: the daemon's one, and its concurrency limit)."""
        self.config = config
        self.reader = reader or MemcgReader(services.paths, config.memory.cgroup_root)
        self.spy = spy or services.spy
        self.events = services.events  # snapshots go into the one event log
        self.tracker = MemoryTracker()
        # per rank process: (snapshots taken, last snapshot time, the finding it was taken for)
        self._snaps: dict[tuple[str, str, str], tuple[int, float, Finding]] = {}
        self._busy = threading.Lock()  # one py-spy dump at a time; a second request is dropped
        self._seq = 0
        self._last_ok: float | None = None

    # -- each cycle --------------------------------------------------------------------------

    def track(self, daemon: DaemonContext, ranks: Ranks) -> MemoryOutput:
        reader = self.reader
        t0 = time.monotonic()
        now = float(ranks.now)
        cfg = daemon.config.memory
        processes: Mapping[int, ProcessInfo] = ranks.processes
        descendants: Mapping[int, tuple[int, ...]] = ranks.descendants
        readings: list[RankMemory] = []
        live: list[TrackedRank] = []
        seen: set[RankId] = set()
        memo: dict[tuple[int, str], Any] = {}  # cgroup levels read this cycle, shared by ranks
        shared: dict[CgroupPaths, CgroupMemory | None] = {}  # and each cgroup's bounding level
        for e in ranks.entries:
            proc = processes.get(e.pid)
            if e.rank_id in seen or not rank_alive(proc, e.start_ticks):
                continue
            seen.add(e.rank_id)
            key = TrackedRank(e.job_id, e.rank, e.pid, proc.start_ticks)
            live.append(key)
            where = ranks.cgroups.get(e.pid)  # the daemon's process view (re-read every 30 s)
            if where is not None and where not in shared:  # the ranks of a job share one cgroup
                # isolated per cgroup: one that cannot be read is "no memory controller" this cycle
                shared[where] = guarded("memory: memcg", functools.partial(reader.read, where, memo), None)
            cg = shared[where] if where is not None else None
            tree = (e.pid, *descendants.get(e.pid, ()))
            readings.append(
                self.tracker.observe(now, key, tree, processes, cg, cfg.window_seconds, cfg.min_window_seconds)
            )
        self.tracker.forget(live, ((p.pid, p.start_ticks) for p in processes.values()))
        n = guarded("memory: /proc/meminfo", reader.node, None)
        node = (
            None
            if n is None
            else NodeMemoryState(
                n.total_bytes,
                n.available_bytes,
                n.pressure.some_avg10 if n.pressure else None,
                n.pressure.some_total_seconds if n.pressure else None,
                n.pressure.full_total_seconds if n.pressure else None,
            )
        )
        ok = node is not None
        if ok:
            self._last_ok = now
        status = CollectorStatus(
            "memory", ok, time.monotonic() - t0, self._last_ok, "" if ok else "cannot read /proc/meminfo"
        )
        return MemoryOutput(tuple(readings), node, status)

    def after_join(self, daemon: DaemonContext, ranks: Ranks, state: NodeState) -> None:
        """A snapshot for each rank whose ``rank_memory_pressure`` is new or worse, of its memory
        reading in the state (``NodeState.rank_memory``: this part's output, live ranks only)."""
        cfg = daemon.config.memory
        readings = {RankProcess(m.job_id, m.rank, m.pid): m for m in state.rank_memory}
        now = daemon.clock()
        current = {(f.job_id, f.rank, f.pid): f for f in state.findings if f.kind == KIND}
        live = {(r.job_id, str(r.rank), str(r.pid)) for r in state.ranks if r.alive}
        self._snaps = {k: v for k, v in self._snaps.items() if k in live}  # bounded by live ranks
        for k, f in current.items():
            count, last_t, last_f = self._snaps.get(k, (0, float("-inf"), f))
            raised = count == 0
            if count >= cfg.snapshots_per_rank or now - last_t < cfg.snapshot_min_interval_seconds:
                continue
            if not raised and not worse(f, last_f):
                continue
            m = readings.get(RankProcess(f.job_id, int(f.rank), int(f.pid)))
            if m is not None and self._snapshot(f, m, now):
                self._snaps[k] = (count + 1, now, f)

    # -- evidence ----------------------------------------------------------------------------

    def _snapshot(self, f: Finding, m: RankMemory, now: float) -> bool:
        """Start one snapshot in the background; False when one is still running."""
        if not self._busy.acquire(blocking=False):
            return False
        self._seq += 1
        seq = self._seq

        def run() -> None:
            try:
                guarded("memory snapshot", lambda: self._take(f, m, now, seq), None)
            finally:
                self._busy.release()

        threading.Thread(target=run, name="memory-snapshot", daemon=True).start()
        return True

    def _take(self, f: Finding, m: RankMemory, now: float, seq: int) -> None:
        stacks, error = None, ""
        try:
            stacks = self.spy.dump(m.pid, slot_wait=2.0)  # off the cycle: may wait a little
        except PySpyError as e:
            error = f"{e.reason}: {e.detail}"[:200]
        ev = snapshot_event(f, m, now, stacks, error, seq)
        self.events.add(ev)
        log.info("memory snapshot: %s", ev.summary)

    def stop(self) -> None:
        """Nothing to release: a running snapshot thread ends with its py-spy run."""
