"""nccl_rank_missing: NCCL RAS names the rank(s) a suspect job waits for, on this node or another.

Input: ``ctx.parts.ras.jobs`` (job_id -> RasJob, gpuwatchd/join/nccl_ras.py), asked only for jobs with
a stalled, suspect or watched rank (daemon/nccl_ras.py ``ras_jobs``). One finding per job, on its
lowest live rank here, when RAS reports a rank missing (``dead`` or ``unresponsive``), a rank with
an asynchronous NCCL error or abort, or counts that stopped with some ranks behind. The stall
finding of the same job carries the same statement (findings/context.py ``collective_words``);
this one says it where no rank here is stalled yet (the culprit is on another node). A warning:
RAS sees liveness and counts, not every stall (a collective that times out can read "RUNNING
OK"), and a rank between two collectives is briefly "behind".
Shell equivalent: ``ncclras -f json`` on the node, read ``missing_ranks`` and the counts.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext, rank_finding, rank_label
from gpuwatchd.model import WARNING, Finding


def find(ctx: FindingContext) -> Iterable[Finding]:
    for job_id, ras in sorted(ctx.parts.ras.jobs.items()):
        if not ras.statement or not (ras.missing or ras.errors or ras.behind):
            continue
        live = [r for r in ctx.ranks if r.job_id == job_id and r.alive]
        if not live:
            continue
        r = min(live, key=lambda x: x.rank)
        culprits = ras.missing or ras.behind
        yield rank_finding(
            r,
            kind="nccl_rank_missing",
            severity=WARNING,
            explanation=f"NCCL RAS, asked for {rank_label(r)}'s job: {ras.statement}",
            evidence={
                "nccl_version": ras.nccl_version,
                "size": ras.size,
                "culprits": [
                    {"rank": c.rank, "host": c.host, "pid": c.pid, "ops": c.ops, "why": c.missing or "behind"}
                    for c in culprits[:16]
                ],
                "async_errors": [
                    {"rank": c.rank, "host": c.host, "pid": c.pid, "async_error": c.async_error, "abort": c.abort}
                    for c in ras.errors[:16]
                ],
                "counts_stopped_seconds": round(ras.stopped_seconds, 1),
            },
        )
