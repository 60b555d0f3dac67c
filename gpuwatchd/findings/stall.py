"""rank_stalled: a rank that is alive but has made no progress for ``stall.after_seconds``.

Input: the stall verdicts of gpuwatchd/join/stall.py (``ctx.stall``: (job_id, rank) ->
``StallVerdict``: last progress, method, the stuck frames of the rank's main Python thread, the
thread states, and whether it is the job's odd one out on this node). The explanation shows where
the rank is stuck and names the suspect rank, so that the on-call engineer looks at the rank that
never reached the collective instead of the fifteen that wait in it.
Shell equivalent: ``stat -c %y HEARTBEAT``; ``py-spy dump --nonblocking -p PID`` repeated;
``cat /proc/PID/task/*/wchan``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from gpuwatchd.findings.context import FindingContext, rank_label
from gpuwatchd.join.stall import StallVerdict
from gpuwatchd.model import PAGE, Finding

HOW = {
    "heartbeat": "no heartbeat",
    "stack": "the same Python stack in every dump",
    "proc": "the same thread states, wchan and CPU pattern in every look",
    "stopped": "the process is stopped (state T, SIGSTOP or a debugger)",
}


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def find(ctx: FindingContext) -> Iterable[Finding]:
    verdicts: Mapping[tuple[str, int], StallVerdict] = ctx.stall
    for r in ctx.ranks:
        v = verdicts.get((r.job_id, r.rank))
        if v is None or not r.alive or not r.stalled or not v.stalled or v.pid != r.pid:
            continue
        since = ""
        if v.progress_timestamp is not None:
            since = time.strftime(" (last progress %H:%M:%S UTC)", time.gmtime(v.progress_timestamp))
        where = " <- ".join(v.stuck_frames[:5]) if v.stuck_frames else "stack unknown (no py-spy)"
        suspects = [
            s for s in verdicts.values() if s.job_id == r.job_id and s.suspect and s.rank != r.rank
        ]
        if v.suspect:
            odd = f"; suspect: this rank is the odd one out ({v.suspect_reason})"
        elif suspects:
            odd = "; suspect: " + "; ".join(
                f"rank {s.rank} (pid {s.pid}) {s.suspect_reason}" for s in suspects
            )
        else:
            odd = ""
        yield Finding(
            kind="rank_stalled",
            severity=PAGE,
            job_id=r.job_id,
            rank=str(r.rank),
            pid=str(r.pid),
            explanation=(
                f"{rank_label(r)} made no progress for {_duration(v.no_progress_seconds)}{since}: "
                f"{HOW.get(v.method, v.method)}; stuck in {where}; {v.threads_summary}{odd}"
            ),
            evidence={
                "method": v.method,
                "no_progress_seconds": round(v.no_progress_seconds, 1),
                "stuck_frames": list(v.stuck_frames),
                "threads": v.threads_summary,
                "suspect": v.suspect,
                "suspect_ranks": sorted(s.rank for s in suspects) or ([r.rank] if v.suspect else []),
            },
        )
