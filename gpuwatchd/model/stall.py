"""The stall tracker's values: what it is told about a rank (``RankProbe``), what it concludes
(``StallVerdict``) and the hang analysis it attaches (``HangAnalysis`` of ``ThreadView``s folded
into ``ThreadGroup``s, ``Pattern``s, the rank's ``WorkerView``). Produced by join/stall.py and
join/hang.py, worded by findings/stall.py. No I/O.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gpuwatchd.model import RankId
from gpuwatchd.model.threads import Frame

MAX_GROUPS = 8  # thread groups shown in a verdict's words
MAX_FRAMES = 3  # frames shown of each group


@dataclass(frozen=True)
class ThreadView:
    tid: int | None
    name: str
    state: str  # /proc state letter ("" when the thread was not found in /proc)
    wchan: str
    cpu_share: float | None  # cores since the previous look; None when unknown
    owns_gil: bool
    frames: tuple[Frame, ...]  # innermost first
    kind: str  # compile | collective | gpu | queue | join | lock | idle | native_spin | running | waiting
    waits_on: str  # e.g. "queue.get", "a lock (futex 0x5649..)"
    futex: int | None = None  # the lock's futex word; None when unknown or not the lock's
    parked: bool = False  # waits in CPython's parking lot (3.13+): its futex word is its own


@dataclass(frozen=True)
class ThreadGroup:
    count: int
    names: tuple[str, ...]
    kind: str
    state: str
    cpu_share: float | None
    frames: tuple[Frame, ...]
    owns_gil: bool
    waits_on: str

    def text(self) -> str:
        where = " <- ".join(str(f) for f in self.frames[:MAX_FRAMES]) or "no Python frame"
        cpu = "CPU ?" if self.cpu_share is None else f"{self.cpu_share:.0%} CPU"
        gil = ", GIL" if self.owns_gil else ""
        st = self.state or "?"
        what = "in"
        if self.waits_on and self.kind in ("queue", "idle"):
            what = f"idle in {self.waits_on} at"
        elif self.waits_on and self.kind == "join":
            what = "waiting in Thread.join at"
        elif self.waits_on and self.kind in ("lock", "gpu", "collective"):
            what = f"waiting for {self.waits_on} at"
        if self.count == 1:
            return f'"{self.names[0]}" ({st}, {cpu}{gil}) {what} {where}'
        return f"{self.count} threads ({st}, {cpu} each) {what} {where}"


@dataclass(frozen=True)
class Pattern:
    kind: str  # deadlock | lock_wait | gpu_wait | native_spin | collective | compiling | starved
    text: str
    threads: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerView:
    """The rank's worker processes (its descendants) over the last window."""

    seen: int  # workers ever seen for this rank process
    gone: tuple[int, ...] = ()  # seen before, now exited (or zombies)
    stopped: tuple[int, ...] = ()  # state T / t
    blocked: tuple[int, ...] = ()  # alive, ~0 CPU over the window (S or D)
    running: tuple[int, ...] = ()

    def text(self) -> str:
        parts = []
        for label, pids in (
            ("dead", self.gone),
            ("stopped (T)", self.stopped),
            ("blocked (not woken once)", self.blocked),
            ("running", self.running),
        ):
            if pids:
                parts.append(f"{len(pids)} {label} (pid {', '.join(map(str, pids[:6]))})")
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class HangAnalysis:
    threads: tuple[ThreadView, ...]
    groups: tuple[ThreadGroup, ...]
    patterns: tuple[Pattern, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(p.kind for p in self.patterns)

    @property
    def compiling(self) -> bool:
        return "compiling" in self.kinds

    @property
    def in_compile(self) -> bool:
        """Some thread is in torch.compile frames (busy or not)."""
        return any(t.kind == "compile" for t in self.threads)

    def threads_text(self) -> str:
        return self._threads_text

    @functools.cached_property
    def _threads_text(self) -> str:
        # once per analysis: a stalled rank's page is worded every cycle from the same analysis
        shown = [g.text() for g in self.groups[:MAX_GROUPS]]
        rest = sum(g.count for g in self.groups[MAX_GROUPS:])
        if rest:
            shown.append(f"{rest} more thread(s)")
        return "; ".join(shown)

    def patterns_text(self) -> str:
        return "; ".join(p.text for p in self.patterns)


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
    def key(self) -> RankId:
        return RankId(self.job_id, self.rank)


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
    # when that proof was the quiet one (join/stall_track.py QUIET_SHARE): its Python threads ran only
    # this many ms in all since the dump, asleep at the same place at every look; None: none ran
    unchanged_quiet_ms: float | None = None
    # how long the rank is proven still: the span of its last comparison with the same stacks
    # (two dumps, or a dump and a proof), its heartbeat's age, or how long it has been stopped
    still_seconds: float = 0.0
    stopped_seconds: float | None = None  # in state T this long; None: not stopped
    # why it was stalled within stall.conclusive_seconds instead of after_seconds: "deadlock",
    # "gil", "gpu_spin", "stopped", "peer_down", "odd_one_out", "waits_for_stuck", "ras_missing"
    # (daemon/wiring.py, join/nccl_ras.py ``confirm_by_ras``); "" otherwise
    conclusive: str = ""
    # what a progressing rank does, in words ("works on its CPU (45 % of a core)")
    doing: str = ""
    # a rank that would be stalled but waits for a peer of its job that progresses: not stalled,
    # and the words that say for whom ("waits in barrier for rank 0, which ...")
    waits_for: str = ""
    # why the job's own view (NCCL RAS) is asked about it, stalled or not: "heartbeat late (12 s)",
    # "in all_reduce at its last dump"; "" for a rank beating on time and not last seen in a
    # collective (join/stall.py ``_watch``; daemon/nccl_ras.py ``ras_jobs``)
    watch: str = ""

    @property
    def key(self) -> RankId:
        return RankId(self.job_id, self.rank)
