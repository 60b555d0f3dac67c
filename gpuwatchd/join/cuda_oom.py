"""CUDA out-of-memory events, daemon side: count the events the rank hook wrote (read and removed by
sources/cuda_oom_events.py) as ``cuda_oom_errors{job_id,rank,gpu}`` and attribute each (host PID,
GPU index, who the co-tenants of the GPU were at that moment), kept ``FINDING_SECONDS`` for the
``cuda_oom`` rule (findings/cuda_oom.py), which builds the finding. Pure: no I/O, no cost beyond
the events of the cycle.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.model import AttributedOom, CoTenant, NodeState, OomEvent

FINDING_SECONDS = 600.0  # a cuda_oom finding stays active this long after the error


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


class OomTracker:
    """Turns the CUDA OOM events read this cycle (sources/cuda_oom_events.py) into counter
    increments and attributed events, each kept ``FINDING_SECONDS`` after the error (the newest
    per job, rank and PID). Pure: no I/O."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.active: list[AttributedOom] = []

    def observe(
        self,
        events: Sequence[OomEvent],
        inc: Callable[[str, tuple[str, ...]], None],
        state: NodeState | None,
        orphan_reasons: Mapping[int, str] | None = None,
        comms: Mapping[int, str] | None = None,
    ) -> list[AttributedOom]:
        for ev in events:
            oom = attribute(ev, state, orphan_reasons, comms)
            inc("cuda_oom_errors", (ev.job_id, str(ev.rank), oom.gpu))
            self.active = [a for a in self.active if a.key != oom.key] + [oom]
        now = self.clock()
        self.active = [a for a in self.active if now - a.since <= FINDING_SECONDS]
        return list(self.active)
