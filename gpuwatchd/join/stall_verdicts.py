"""What the stall tracker's verdicts say beyond one rank (its values, ``RankProbe`` and
``StallVerdict``, are in model/stall.py): how a stalled rank's threads read, and the odd one out
of a job's ranks.

Pure, no I/O, no memory across cycles: ``name_suspects`` compares one cycle's verdicts of the
ranks of each job (cost linear in their number). ``join/stall.py`` holds the tracker itself.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping

from gpuwatchd.model import RankId
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.model.threads import ThreadInfo, ThreadStack


def main_stack(stacks: Iterable[ThreadStack]) -> ThreadStack | None:
    """The thread a human looks at first: MainThread, else the GIL owner, else the first."""
    stacks = tuple(stacks)
    for s in stacks:
        if s.name == "MainThread":
            return s
    for s in stacks:
        if s.owns_gil:
            return s
    return stacks[0] if stacks else None


def summarize_threads(threads: Iterable[ThreadInfo], spinning: Iterable[int] = ()) -> str:
    """``5 threads: 4 S futex_do_wait, 1 R``; plus which burn CPU."""
    threads = tuple(threads)
    kinds = collections.Counter(f"{t.state} {t.wchan}".strip() for t in threads)
    text = f"{len(threads)} threads: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common(4))
    spin = tuple(spinning)
    if spin:
        text += f"; {len(spin)} burning CPU"
    return text


def name_suspects(
    verdicts: Mapping[RankId, StallVerdict],
) -> dict[RankId, StallVerdict]:
    """Mark the odd one out per job: only when some rank of the job is stalled or dead.

    Each rank gets a place: "dead", "progressing", or where it is stuck (its top frames without line
    numbers). If one place holds a strict majority (at least two ranks), every rank elsewhere is a
    suspect; a dead rank among live peers always is.
    """
    from dataclasses import replace

    out = dict(verdicts)
    jobs: dict[str, list[StallVerdict]] = collections.defaultdict(list)
    for v in verdicts.values():
        jobs[v.job_id].append(v)
    for ranks in jobs.values():
        if len(ranks) < 2 or not any(v.stalled or not v.alive for v in ranks):
            continue

        def place(v: StallVerdict) -> tuple[str, ...]:
            if not v.alive:
                return ("dead",)
            if not v.stalled:
                return ("progressing",)
            return v.location or ("stalled",)

        counts = collections.Counter(place(v) for v in ranks)
        (top, n), *rest = counts.most_common()
        majority = n >= 2 and all(n > m for _, m in rest)
        for v in ranks:
            where = place(v)
            reason = ""
            if where == ("dead",) and any(r.alive for r in ranks):
                peers = sum(r.rank != v.rank for r in ranks)
                reason = f"dead while {peers} peer(s) on this node are alive"
            elif majority and where != top:
                what = "progressing" if top == ("progressing",) else "stuck in " + " <- ".join(top)
                mine = "still progressing" if where == ("progressing",) else (
                    "stuck in " + " <- ".join(where))
                reason = f"{mine}, while {n} peer(s) are {what}"
            if reason:
                out[v.key] = replace(v, suspect=True, suspect_reason=reason)
    return out
