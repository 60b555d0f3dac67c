"""rank_down: a registered rank whose process is gone (or is a zombie, or its PID was reused).

Reads only the joined rank states. Shell equivalent: ``kill -0 PID`` for each PID in the rank file.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext, rank_finding, rank_label
from gpuwatchd.model import PAGE, Finding
from gpuwatchd.units import fmt_clock


def find(ctx: FindingContext) -> Iterable[Finding]:
    for r in ctx.ranks:
        if r.alive:
            continue
        peers = [p for p in ctx.ranks if p.job_id == r.job_id and p.rank != r.rank]
        alive = sum(1 for p in peers if p.alive)
        when = fmt_clock(r.died_at) if r.died_at else "unknown time"
        tail = (
            f"; {alive} peer(s) on this node still alive will wait in their next collective"
            if alive
            else ""
        )
        yield rank_finding(
            r,
            kind="rank_down",
            severity=PAGE,
            explanation=f"{rank_label(r)} is registered but its process is gone (seen dead at {when}){tail}",
            evidence={"died_at": r.died_at, "peers_alive": alive},
        )
