"""Stale GPU processes: who holds GPU memory without belonging to a live rank, and why.

Pure logic over one cycle's readings (NVML processes, /proc identities, rank trees) plus the small
memory this needs across cycles (``OrphanTracker``): when each holder was first seen outside every
live rank tree (the grace period, ``orphans.grace_seconds``, default 60 s, keeps a job that is still
starting from being flagged), which job a PID belonged to while its rank was alive (so that
``job_ended`` can be told), and its parent at first sight (so that a parent that died is noticed
even where the orphan is adopted by a sub-reaper instead of PID 1).

Reasons, most specific first:

``defunct``            zombie, or NVML reports memory for a PID that /proc no longer has
``reparented_to_init`` its parent died: PPID is 1 (or changed since we first saw it)
``job_ended``          it was in the tree of a rank whose job now has no live rank
``unregistered``       ranks are registered on this node but none claims it

The shell equivalent is ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv`` followed
by ``ps -o pid,ppid,user,etime,comm -p PID`` for each PID, compared with the rank files.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatchd.model import (
    DEFUNCT,
    JOB_ENDED,
    REPARENTED,
    UNREGISTERED,
    GpuProcess,
    Orphan,
    ProcessInfo,
    RankEntry,
    RankId,
    RankProcess,
    rank_alive,
)


@dataclass(frozen=True)
class RankTrees:
    """Which PIDs belong to which live rank; which jobs have a live rank at all."""

    owner: Mapping[int, RankId] = field(default_factory=dict)  # pid -> (job_id, rank)
    live_jobs: frozenset[str] = frozenset()
    known_jobs: frozenset[str] = frozenset()  # every job with a rank entry, alive or not
    # uids whose rank files were not all read (caps): a process of theirs may be a registered
    # rank that was not seen, so ``check --kill`` never signals it (0: nobody may be signalled)
    unread_owners: frozenset[int] = frozenset()
    alive: frozenset[RankProcess] = frozenset()  # the live ranks' (job_id, rank, pid)

    def may_signal(self, uid: int | None) -> bool:
        return not self.unread_owners or (
            0 not in self.unread_owners and uid is not None and uid not in self.unread_owners
        )

    @property
    def any_registered(self) -> bool:
        return bool(self.known_jobs)


def trees_from_entries(
    entries: Iterable[RankEntry],
    processes: Mapping[int, ProcessInfo],
    descendants: Mapping[int, Sequence[int]],
    known_ticks: Mapping[RankProcess, int] | None = None,
) -> RankTrees:
    """Each accepted rank's liveness and process tree, computed once per cycle (the daemon's
    ``Ranks.trees``): alive by ``model.rank_alive`` against the claim's start time, else the one
    the join first saw (``known_ticks``: ``JoinMemory.start_ticks``); its tree the rank and its
    live descendants, a PID in two trees the first rank's by (job id, rank). The join, the NVML
    part's orphans and the stall part's GPU readings all read this."""
    owner: dict[int, RankId] = {}
    live: set[str] = set()
    known: set[str] = set()
    alive: set[RankProcess] = set()
    ticks = known_ticks or {}
    for e in sorted(entries, key=lambda e: (e.job_id, e.rank)):
        known.add(e.job_id)
        expected = e.start_ticks if e.start_ticks is not None else ticks.get(e.rank_process)
        if not rank_alive(processes.get(e.pid), expected):
            continue
        live.add(e.job_id)
        alive.add(e.rank_process)
        for pid in (e.pid, *descendants.get(e.pid, ())):
            owner.setdefault(pid, e.rank_id)
    return RankTrees(owner, frozenset(live), frozenset(known), alive=frozenset(alive))


def classify(
    gp: GpuProcess,
    proc: ProcessInfo | None,
    trees: RankTrees,
    past_job: str | None = None,
    first_ppid: int | None = None,
    strict: bool = False,
) -> str | None:
    """Why ``gp`` is stale, or None when it belongs to a live rank (or we cannot say it is stale).

    ``strict`` (``gpuwatchd check``): any holder outside a live rank tree is an offender, even on a
    node where no job is registered at all.
    """
    if gp.pid in trees.owner:
        return None
    if proc is None or proc.state in ("Z", "X"):
        return DEFUNCT
    if proc.ppid in (0, 1) or (first_ppid is not None and proc.ppid != first_ppid):
        return REPARENTED
    if past_job is not None and past_job not in trees.live_jobs:
        return JOB_ENDED
    if trees.any_registered or strict:
        return UNREGISTERED
    return None


@dataclass
class _Seen:
    first_seen: float
    start_ticks: int | None
    first_ppid: int | None


class OrphanTracker:
    """Carries first-sight times and past job membership between cycles. Not thread-safe: one
    cycle at a time (the daemon's cycle lock)."""

    def __init__(self, grace_seconds: float = 60.0) -> None:
        self.grace_seconds = grace_seconds
        self._seen: dict[tuple[int, str], _Seen] = {}  # (pid, gpu uuid) -> first sight outside
        self._past_job: dict[tuple[int, int | None], str] = {}  # (pid, start_ticks) -> job_id
        self._ppid_seen: dict[tuple[int, int | None], int] = {}  # first parent seen

    def update(
        self,
        gpu_processes: Iterable[GpuProcess],
        processes: Mapping[int, ProcessInfo],
        trees: RankTrees,
        now: float,
    ) -> tuple[Orphan, ...]:
        orphans: list[Orphan] = []
        live_keys: set[tuple[int, str]] = set()
        live_ids: set[tuple[int, int | None]] = set()
        for gp in gpu_processes:
            proc = processes.get(gp.pid)
            ident = (gp.pid, proc.start_ticks if proc else None)
            live_ids.add(ident)
            if proc is not None:
                self._ppid_seen.setdefault(ident, proc.ppid)
            owner = trees.owner.get(gp.pid)
            if owner is not None:
                self._past_job[ident] = owner[0]
                self._seen.pop((gp.pid, gp.uuid), None)
                continue
            reason = classify(gp, proc, trees, self._past_job.get(ident), self._ppid_seen.get(ident))
            if reason is None:
                self._seen.pop((gp.pid, gp.uuid), None)
                continue
            key = (gp.pid, gp.uuid)
            live_keys.add(key)
            seen = self._seen.get(key)
            ticks = proc.start_ticks if proc else None
            if seen is None or (ticks is not None and seen.start_ticks not in (None, ticks)):
                seen = _Seen(now, ticks, proc.ppid if proc else None)
                self._seen[key] = seen
            if now - seen.first_seen < self.grace_seconds:
                continue
            orphans.append(_orphan(gp, proc, reason, seen.first_seen))
        for key in set(self._seen) - live_keys:
            del self._seen[key]
        for ident in set(self._past_job) - live_ids:
            del self._past_job[ident]
        for ident in set(self._ppid_seen) - live_ids:
            del self._ppid_seen[ident]
        return tuple(sorted(orphans, key=lambda o: (o.gpu_index, o.pid)))

    def past_job(self, pid: int, start_ticks: int | None) -> str | None:
        return self._past_job.get((pid, start_ticks))


def _orphan(gp: GpuProcess, proc: ProcessInfo | None, reason: str, first_seen: float) -> Orphan:
    return Orphan(
        gpu_index=gp.gpu_index,
        uuid=gp.uuid,
        pid=gp.pid,
        used_memory_bytes=gp.used_memory_bytes,
        comm=proc.comm if proc else "",
        user=proc.user if proc else "",
        reason=reason,
        first_seen=first_seen,
    )


def offenders(
    gpu_processes: Iterable[GpuProcess],
    processes: Mapping[int, ProcessInfo],
    trees: RankTrees,
    now: float | None = None,
) -> tuple[Orphan, ...]:
    """One-shot strict classification for ``gpuwatchd check``: no grace, no history."""
    now = time.time() if now is None else now
    out = []
    for gp in gpu_processes:
        proc = processes.get(gp.pid)
        reason = classify(gp, proc, trees, strict=True)
        if reason is not None:
            out.append(_orphan(gp, proc, reason, now))
    return tuple(sorted(out, key=lambda o: (o.gpu_index, o.pid)))
