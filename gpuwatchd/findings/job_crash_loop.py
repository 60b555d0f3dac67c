"""job_crash_loop: a job whose ranks on this node failed again and again, restarted by its launcher
each time (torchrun ``--max-restarts``, a Slurm requeue, a Kubernetes restart policy): the same
crash over and over burns the job's GPU hours while the job looks alive between failures.

From the exits kept for ``join/exits.py``'s ``ACTIVE_SECONDS`` (10 minutes, ``ctx.parts.exits``):
each first failure of the job on this node (the rank that failed first, not the ranks its launcher
tore down after it) by its own code or a kill, not a stop (SIGTERM / SIGINT / SIGHUP) nor exit 0.
``LOOP_FAILURES`` of them in that window make one ``warning`` for the job, on the rank of the
last failure, listing each failure (rank, how, when) and whether it was the same each time. Each
failure still has its own finding (``job_crashed``, or ``rank_down`` / ``rank_oom_killed`` where
they page). Shell equivalent: ``gpuwatchd events --kind rank_exit`` for the job.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import WARNING, Finding
from gpuwatchd.model.exits import CRASHED, KILLED, NODE, RankExit
from gpuwatchd.units import fmt_clock_ms

LOOP_FAILURES = 3  # first failures of one job within the exits' window (10 minutes)
FAILURES = (CRASHED, KILLED, NODE)


def find(ctx: FindingContext) -> Iterable[Finding]:
    failures: dict[str, list[RankExit]] = defaultdict(list)
    for x in ctx.parts.exits.recent:
        if x.first and x.verdict in FAILURES:
            failures[x.job_id].append(x)
    for job_id, xs in failures.items():
        if len(xs) < LOOP_FAILURES:
            continue
        xs.sort(key=lambda x: x.time)
        last = xs[-1]
        span = last.time - xs[0].time
        parts = [f"rank {x.rank} {x.how} at {fmt_clock_ms(x.time)}" for x in xs[-5:]]
        more = f" (and {len(xs) - 5} earlier)" if len(xs) > 5 else ""
        same = len({(x.rank, x.cause) for x in xs}) == 1
        text = (
            f"job {job_id} failed {len(xs)} times in {span / 60:.0f} min on this node, restarted "
            f"by its launcher each time: {'; '.join(parts)}{more}; "
            + (
                "the same rank and cause each time: a bug or a bad node, not a passing fault"
                if same
                else "not the same rank and cause each time"
            )
        )
        yield Finding(
            kind="job_crash_loop",
            severity=WARNING,
            explanation=text,
            job_id=job_id,
            rank=str(last.rank),
            pid=str(last.pid),
            since=xs[0].time,
            evidence={
                "failures": len(xs),
                "span_seconds": round(span, 3),
                "causes": sorted({x.cause for x in xs}),
                "same": same,
            },
        )
