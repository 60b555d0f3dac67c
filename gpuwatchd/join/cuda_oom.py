"""CUDA out-of-memory events, daemon side: count the events the rank hook wrote (read once each by
sources/cuda_oom_events.py) as ``cuda_oom_errors{job_id,rank,gpu}`` and attribute each (host PID,
GPU index, who the co-tenants of the GPU were at that moment), kept ``FINDING_SECONDS`` for the
``cuda_oom`` rule (findings/cuda_oom.py), which builds the finding. Pure: no I/O, no cost beyond
the events of the cycle.

Whose event counts: the event file's owner must be root or the uid of a rank that claims the
event's ``(job_id, rank)`` (the accepted claims of this cycle, or of the last
``CLAIM_MEMORY_SECONDS``: a rank that dies of its OOM may be unregistered before the next cycle).
Any other event is refused (logged): no user can put a CUDA OOM on another user's job, and no
job id or rank that is not a known rank becomes a label value, so the counter's series are bounded
by the ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from gpuwatchd.model import NodeState, ProcessInfo, RankEntry
from gpuwatchd.model.cuda_oom import AttributedOom, CoTenant, OomEvent

FINDING_SECONDS = 600.0  # a cuda_oom finding stays active this long after the error
CLAIM_MEMORY_SECONDS = 120.0  # a rank's claim counts for its events this long after it was seen
MAX_REFUSALS_LOGGED = 16  # per cycle; the rest are counted in one line

log = logging.getLogger(__name__)


def attribute(
    event: OomEvent,
    state: NodeState | None,
    orphan_reasons: Mapping[int, str] | None = None,
    comms: Mapping[int, str] | None = None,
) -> AttributedOom:
    """Who was who on the event's GPU, from ``state`` (the latest NodeState), this cycle's orphan
    reasons and command names: kept with the event, so the finding names them as they were."""
    # A rank in a container wrote the PID it sees; NVML (co-tenants, the state) has host PIDs.
    ns_pid = None
    for r in state.ranks if state else ():
        if (r.job_id, r.rank, r.ns_pid) == (event.job_id, event.rank, event.pid):
            event, ns_pid = dataclasses.replace(event, pid=r.pid), r.ns_pid
            break
    gpus = state.gpus if state else ()
    rows = state.gpu_processes if state else ()
    gpu = next((g for g in gpus if g.uuid == event.device_uuid), None)
    orphan_reasons = dict(orphan_reasons or {})
    for o in state.orphans if state else ():
        orphan_reasons.setdefault(o.pid, o.reason)
    if event.co_tenants is not None:
        tenants: Sequence[tuple[int, int | None]] = event.co_tenants
    else:  # no snapshot from the rank: the daemon's latest reading of that GPU
        tenants = [(r.pid, r.used_memory_bytes) for r in rows if r.uuid == event.device_uuid]
    row_by_pid = {r.pid: r for r in rows if r.uuid == event.device_uuid}
    co = []
    for pid, used in tenants:
        row = row_by_pid.get(pid)
        comm = (comms or {}).get(pid) or (row.comm if row else "")
        if row is not None and row.job_id:
            co.append(CoTenant(pid, used, comm, row.job_id, row.rank))
        else:
            co.append(CoTenant(pid, used, comm, orphan_reason=orphan_reasons.get(pid, "")))
    return AttributedOom(event, str(gpu.index) if gpu else "", ns_pid, tuple(co))


def claimants(
    entries: Iterable[RankEntry],
    processes: Mapping[int, ProcessInfo],
) -> dict[tuple[str, int], frozenset[int]]:
    """(job_id, rank) -> the uids whose event files may report a CUDA OOM of it: the rank
    process's uid (as read this cycle) and the claim's owner (a rank file's owner; a discovered
    process's uid)."""
    out: dict[tuple[str, int], frozenset[int]] = {}
    for e in entries:
        uids = {u for u in (e.owner_uid,) if u is not None}
        proc = processes.get(e.pid)
        if proc is not None:
            uids.add(proc.uid)
        out[(e.job_id, e.rank)] = out.get((e.job_id, e.rank), frozenset()) | uids
    return out


class OomTracker:
    """Turns the CUDA OOM events read this cycle (sources/cuda_oom_events.py) into counter
    increments and attributed events, each kept ``FINDING_SECONDS`` after the error (the newest
    per job, rank and PID); refuses the events no claim of their owner covers (module docstring).
    Pure: no I/O. Memory: the claims of the last ``CLAIM_MEMORY_SECONDS``."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.active: list[AttributedOom] = []
        self.refused = 0  # events refused since start (tests)
        self._claims: dict[tuple[str, int], tuple[frozenset[int], float]] = {}

    def _remember(self, claims: Mapping[tuple[str, int], frozenset[int]], now: float) -> None:
        for key, uids in claims.items():  # a live claim replaces what was remembered of it
            self._claims[key] = (uids, now)
        self._claims = {k: v for k, v in self._claims.items() if now - v[1] <= CLAIM_MEMORY_SECONDS}

    def _why_refused(self, ev: OomEvent) -> str:
        claim = self._claims.get((ev.job_id, ev.rank))
        if claim is None:
            return f"no rank {ev.rank} of job {ev.job_id} is known on this node"
        if ev.owner_uid is not None and ev.owner_uid != 0 and ev.owner_uid not in claim[0]:
            return (
                f"the file is owned by uid {ev.owner_uid}, not root or the uid of rank "
                f"{ev.rank} of job {ev.job_id} ({', '.join(map(str, sorted(claim[0])))})"
            )
        return ""

    def observe(
        self,
        events: Sequence[OomEvent],
        inc: Callable[[str, tuple[str, ...]], None],
        state: NodeState | None,
        orphan_reasons: Mapping[int, str] | None = None,
        comms: Mapping[int, str] | None = None,
        claims: Mapping[tuple[str, int], frozenset[int]] | None = None,
    ) -> list[AttributedOom]:
        """``claims``: this cycle's ``claimants`` (None: none; every event is then refused
        unless an earlier cycle's claim covers it)."""
        now = self.clock()
        self._remember(claims or {}, now)
        refused = []
        for ev in events:
            why = self._why_refused(ev)
            if why:
                refused.append(f"{ev.path or ev.job_id}: {why}")
                continue
            oom = attribute(ev, state, orphan_reasons, comms)
            inc("cuda_oom_errors", (ev.job_id, str(ev.rank), oom.gpu))
            self.active = [a for a in self.active if a.key != oom.key] + [oom]
        self.refused += len(refused)
        for line in refused[:MAX_REFUSALS_LOGGED]:
            log.info("CUDA OOM event refused: %s", line)
        if len(refused) > MAX_REFUSALS_LOGGED:
            log.info("%d more CUDA OOM events refused", len(refused) - MAX_REFUSALS_LOGGED)
        self.active = [a for a in self.active if now - a.since <= FINDING_SECONDS]
        return list(self.active)
