"""job_crashed: a job whose ranks on this node all ended after one of them failed by its own code
(a Python exception's exit 1, SIGSEGV, SIGABRT ...) and the launcher tore the rest down. One
``warning`` for the job, naming the first rank to fail and how, never one page per rank: the job's
owner reads its log; nobody is woken for a bug in the training script.

A failure that leaves a peer alive pages as rank_down instead, as does one the node caused
(findings/rank_down.py); a stop (SIGTERM / SIGINT / SIGHUP to the first) and exit 0 say nothing
but their ``rank_exit`` events. Active ``ACTIVE_SECONDS`` from the first failure, then gone, like
the findings of other dead things. Reads ``ctx.parts.exits.recent`` (join/exits.py) and the rank states.
Shell equivalent: the ``ChildFailedError`` torchrun prints in the launcher's log on this node.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext, live_peers
from gpuwatchd.model import WARNING, Finding
from gpuwatchd.model.exits import CRASHED
from gpuwatchd.units import fmt_clock_ms

ACTIVE_SECONDS = 600.0


def find(ctx: FindingContext) -> Iterable[Finding]:
    for x in ctx.parts.exits.recent:
        if not x.first or x.verdict != CRASHED or ctx.now - x.time > ACTIVE_SECONDS:
            continue
        if live_peers(ctx, x.job_id, x.pid, x.time):
            continue  # peers alive since before it: torn down soon, or waiting (rank_down pages)
        restarted = sum(1 for p in ctx.ranks if p.job_id == x.job_id and p.alive)
        after = sorted(
            (y for y in ctx.parts.exits.recent if y.job_id == x.job_id and y.first_pid == x.pid and y.pid != x.pid),
            key=lambda y: y.time,
        )
        text = (
            f"job {x.job_id} crashed: rank {x.rank} (pid {x.pid}, {x.comm}) failed first, "
            f"{x.how} at {fmt_clock_ms(x.time)}"
        )
        if x.kernel:
            text += f"; {x.kernel}"
        if after:
            parts = [f"rank {y.rank} ({y.cause}, {y.after_seconds:.3f} s after)" for y in after[:8]]
            more = f" and {len(after) - 8} more" if len(after) > 8 else ""
            text += f"; the launcher then ended {', '.join(parts)}{more}"
        if restarted:  # ranks started after the crash: the launcher's restart of the job
            text += f"; the launcher restarted the job ({restarted} new rank(s) on this node)"
        yield Finding(
            kind="job_crashed",
            severity=WARNING,
            explanation=text,
            job_id=x.job_id,
            rank=str(x.rank),
            pid=str(x.pid),
            since=x.time,
            evidence={
                "cause": x.cause,
                "status": x.status,
                "kernel": x.kernel,
                "ranks_ended": 1 + len(after),
                "first_rank": x.rank,
            },
        )
