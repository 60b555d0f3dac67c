"""The stall tracker's values: what it is told of a rank (``RankProbe``), what it concludes
(``StallVerdict``), how a stalled rank's threads read, and the odd one out of a job's ranks.

Pure, no I/O, no memory across cycles: ``name_suspects`` compares one cycle's verdicts of the
ranks of each job (cost linear in their number). ``join/stall.py`` holds the tracker itself.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.join.hang import HangAnalysis
from gpuwatchd.sources.pyspy_output import ThreadStack
from gpuwatchd.sources.threads import ThreadInfo


@dataclass(frozen=True)
class RankProbe:
    """What the stall tracker needs to know about one rank this cycle."""

    job_id: str
    rank: int
    pid: int
    alive: bool
    state: str = ""  # /proc state letter of the rank process
    heartbeat: str | None = None
    start_ticks: int | None = None
    # uid owning the rank file; a heartbeat file owned by someone else is ignored (the daemon must
    # not reveal the mtime of another user's file: docs/security.md)
    owner_uid: int | None = None
    # The daemon already stats each heartbeat once per cycle (with the owner rule): it passes
    # that reading here so the file is not stat'ed twice. heartbeat_read=False: stat it here.
    heartbeat_mtime: float | None = None
    heartbeat_read: bool = False
    # the rank's descendant processes (DataLoader / compile workers): (pid, state, CPU seconds)
    workers: tuple[tuple[int, str, float], ...] = ()

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.rank)


@dataclass(frozen=True)
class StallVerdict:
    job_id: str
    rank: int
    pid: int
    alive: bool
    progress_timestamp: float | None  # last heartbeat / last observed change
    stalled: bool
    method: str  # "heartbeat" | "stack" | "proc" | "stopped" | "dead" | "compiling"
    no_progress_seconds: float
    stuck_frames: tuple[str, ...] = ()  # innermost first, of the thread that matters
    threads_summary: str = ""  # e.g. "5 threads: 4 S futex_do_wait, 1 R; 1.0 cores"
    location: tuple[str, ...] = ()  # frames without line numbers: "the same place"
    suspect: bool = False
    suspect_reason: str = ""
    # every Python thread, folded, and the hang patterns (gpuwatchd/join/hang.py); None: not analysed
    analysis: HangAnalysis | None = None
    compiling: bool = False  # in torch.compile with the CPU busy: not stalled before compile_after
    # A thread burns a core at one line and nothing confirms a stall (join/stall.py, "spin
    # rules"): not stalled, but said so (findings/stall.py: rank_stall_unconfirmed, a warning).
    ambiguous: bool = False
    # what confirmed a stall whose thread burns CPU at one line: "gpu_spin" | "gpu_idle" | "peer"
    confirmed_by: str = ""
    gpu_evidence: str = ""  # the NVML readings of the rank's GPUs over the window, in words
    # (the time of the last py-spy dump, the time of the last comparison) when that comparison
    # was a proof instead of a dump: no task ran in between (schedstat), so the stacks were the
    # dump's; None when the last comparison was a dump
    unchanged: tuple[float, float] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.rank)


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
    verdicts: Mapping[tuple[str, int], StallVerdict],
) -> dict[tuple[str, int], StallVerdict]:
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
            peers = [r.rank for r in ranks if r.rank != v.rank]
            if where == ("dead",) and any(r.alive for r in ranks):
                reason = f"dead while {len(peers)} peer(s) on this node are alive"
            elif majority and where != top:
                what = "progressing" if top == ("progressing",) else "stuck in " + " <- ".join(top)
                mine = "still progressing" if where == ("progressing",) else (
                    "stuck in " + " <- ".join(where))
                reason = f"{mine}, while {n} peer(s) are {what}"
            if reason:
                out[v.key] = replace(v, suspect=True, suspect_reason=reason)
    return out
