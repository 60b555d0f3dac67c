"""rank_down: a rank whose process is gone, and whose death pages: a registered rank with no exit
read (its process is gone, a zombie, or its PID was reused), or a rank whose recorded exit
(findings' ``ctx.parts.exits.recent``, join/exits.py) leaves live peers waiting or was the node's doing.

Paging by cause and consequence (docs/runbooks.md, "Rank exits"), for the first rank of its job
to fail on this node (the ranks the launcher tore down after it are named there, not paged):
- the node ended it (an OOM killer, SIGBUS, a critical Xid) or nothing in its own code could have
  (SIGKILL no OOM killer named, a status that could not be read): pages at once;
- its own code or a stop request ended it (exit != 0, SIGSEGV, SIGABRT, SIGTERM ...) and a peer on
  this node is still alive ``TEARDOWN_GRACE_SECONDS`` later: the peer waits for it, pages;
- the launcher tore the rest down by then: no page (findings/job_crashed.py says a crash once);
- exit 0: never.
A registered rank stays a finding while it stays registered and dead (unregistered: the end); a discovered one vanishes
from the rank list with its process and is a finding for ``ACTIVE_SECONDS`` after its exit.

Reads only the joined rank states and exits. Shell equivalent: ``kill -0 PID`` for each PID in the
rank file; ``awk '{print $52}' /proc/PID/stat`` of the zombie for its cause.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext, live_peers, rank_finding, rank_label
from gpuwatchd.model import PAGE, Finding, RankState
from gpuwatchd.model.exits import CRASHED, FINISHED, KILLED, NODE, STOPPED, RankExit
from gpuwatchd.units import fmt_clock, fmt_clock_ms

# torchrun SIGTERMs the other ranks as soon as its monitor (every 0.1 s) sees a failure; a peer
# still alive this long after is waiting for the dead one, not being torn down.
TEARDOWN_GRACE_SECONDS = 10.0
ACTIVE_SECONDS = 600.0  # as rank_oom_killed: as long as the GPURankDown rule looks back
# /proc may show a rank gone a cycle before the exit watcher's record of its exit is joined (its
# event comes 0.8-2.5 s after the death on the H100): a dead rank with no exit read yet waits
# this long for it, so that a stop or a crash the launcher tore down is not paged as "gone, no
# exit read" (the H100: the catalog's TERM fault paged rank_down 3 s after the death)
EXIT_READ_GRACE_SECONDS = 5.0


def pages(x: RankExit, ctx: FindingContext) -> bool:
    """Does this exit page (see the module docstring)?"""
    if not x.first or x.verdict == FINISHED:
        return False
    if x.verdict in (NODE, KILLED):
        return True
    waited = ctx.now - x.time >= TEARDOWN_GRACE_SECONDS
    return x.verdict in (CRASHED, STOPPED) and waited and live_peers(ctx, x.job_id, x.pid, x.time) > 0


def torn_down(ctx: FindingContext, x: RankExit) -> str:
    """ "; the launcher then ended rank 0 (SIGTERM, 0.004 s after)" for the ranks that followed."""
    after = sorted(
        (y for y in ctx.parts.exits.recent if y.job_id == x.job_id and y.first_pid == x.pid and y.pid != x.pid),
        key=lambda y: y.time,
    )
    if not after:
        return ""
    parts = [f"rank {y.rank} ({y.cause}, {y.after_seconds:.3f} s after)" for y in after[:8]]
    more = f" and {len(after) - 8} more" if len(after) > 8 else ""
    return f"; then ended: {', '.join(parts)}{more}"


def cause_words(x: RankExit) -> str:
    """ "exited with SIGSEGV (core dumped) at 14:22:07.123Z; kernel: segfault at 1 ..."."""
    text = f"{x.how} at {fmt_clock_ms(x.time)}"
    return f"{text}; {x.kernel}" if x.kernel else text


def _peers_tail(alive: int) -> str:
    return f"; {alive} peer(s) on this node still alive will wait in their next collective" if alive else ""


def _from_exit(ctx: FindingContext, x: RankExit, r: RankState | None) -> Finding:
    alive = live_peers(ctx, x.job_id, x.pid, x.time)
    who = rank_label(r) if r is not None else f"rank {x.rank} of job {x.job_id} (pid {x.pid})"
    text = f"{who} {cause_words(x)}{torn_down(ctx, x)}{_peers_tail(alive)}"
    evidence = {
        "died_at": x.time,
        "peers_alive": alive,
        "cause": x.cause,
        "verdict": x.verdict,
        "kernel": x.kernel,
        "status": x.status,
    }
    if r is not None:
        return rank_finding(r, kind="rank_down", severity=PAGE, explanation=text, evidence=evidence, since=x.time)
    return Finding(
        kind="rank_down",
        severity=PAGE,
        explanation=text,
        job_id=x.job_id,
        rank=str(x.rank),
        pid=str(x.pid),
        evidence=evidence,
        since=x.time,
    )


def find(ctx: FindingContext) -> Iterable[Finding]:
    exits = {(x.job_id, x.rank, x.pid): x for x in ctx.parts.exits.recent}
    for r in ctx.ranks:
        if r.alive:
            continue
        x = exits.pop((r.job_id, r.rank, r.pid), None)
        if x is not None:
            if pages(x, ctx):
                yield _from_exit(ctx, x, r)
            continue
        if r.died_at is not None and ctx.now - r.died_at < EXIT_READ_GRACE_SECONDS:
            continue  # its exit may not be joined yet
        alive = live_peers(ctx, r.job_id, r.pid, r.died_at)
        when = fmt_clock(r.died_at) if r.died_at else "unknown time"
        yield rank_finding(
            r,
            kind="rank_down",
            severity=PAGE,
            explanation=f"{rank_label(r)} is registered but its process is gone (seen dead at "
            f"{when}; no exit read){_peers_tail(alive)}",
            evidence={"died_at": r.died_at, "peers_alive": alive},
            since=r.died_at or 0.0,
        )
    live = {(r.job_id, r.rank, r.pid) for r in ctx.ranks if r.alive}
    for key, x in exits.items():  # exits of ranks no longer listed (discovered ones vanish)
        if key in live or x.registered or ctx.now - x.time > ACTIVE_SECONDS or x.oom_event:
            continue  # unregistered: cleaned up; an OOM kill pages as rank_oom_killed already
        if pages(x, ctx):
            yield _from_exit(ctx, x, None)
