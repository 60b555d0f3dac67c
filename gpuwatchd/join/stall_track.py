"""The stall tracker's memory of one rank (``RankTrack``), in small records grouped by what writes
them: the last /proc look (``Look``), the /proc view that paces the dumps (``View``), the last
py-spy dump and the comparison it made (``LastDump``), the quiet proof (``QuietProof``), the GIL
holder of the dumps (``GilWatch``), the verdict's words (``Words``) and the hang analysis
(``HangMemo``), beside the GPU window (join/stall_spin.py) and the workers (join/rank_workers.py).
Each record carries the methods that write it where they are more than a field or two; the rules
that read them and write the rest are in join/stall.py (the verdict) and join/stall_pacing.py
(the dump pacing). Kept by (job, rank) while the rank lives, dropped when it leaves. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.join.hang import collective_name
from gpuwatchd.join.rank_workers import RankWorkers
from gpuwatchd.join.stall_spin import GpuWindow
from gpuwatchd.join.stall_verdicts import main_stack
from gpuwatchd.model.stall import HangAnalysis, StallVerdict
from gpuwatchd.model.threads import ThreadInfo, ThreadStack

# A rank's Python threads (its main thread before the first dump) are "quiet" at a look when they
# ran at most this share of a core since the last one (schedstat run time: a few wake-ups of a
# sleep or a poll, no work) and the look's /proc view is the last dump's. A stack moves only while
# its thread runs, and one this quiet, asleep at the same place at every look, has had next to no
# chance to: the first dump of a rank quiet since first sight waits until a dump interval before
# the comparison is due, and a stalled rank quiet since its last dump is not dumped again before
# QUIET_REDUMP x after_seconds (join/stall_pacing.py; measured: 64 ranks asleep at one line were
# dumped each at their second look and then once per after_seconds, 2.7 x the cost of the same
# ranks beating).
QUIET_SHARE = 0.002
MAX_FRAMES = 8  # of the main thread, in the verdict's stuck frames


@dataclass
class Look:
    """The last /proc look at the rank's tasks (at the look cadence, not every cycle)."""

    threads: tuple[ThreadInfo, ...] = ()
    at: float = 0.0  # its time (0.0: none yet)
    spinning: frozenset[int] = frozenset()
    shares: dict[int, float] = field(default_factory=dict)
    sched: dict[int, tuple[int, int]] = field(default_factory=dict)  # tid -> schedstat (run, wait)
    slices: dict[int, tuple[int, int]] = field(default_factory=dict)  # of threads: (run ns, slices)
    count: int = 0  # /proc looks so far
    summary: str = ""  # summarize_threads of the last look
    busiest_worker: float | None = None  # of the last look (rank_workers.py)
    # Python threads in the working band, or its own GPU moving data, at a look since the last
    # comparison (a dump, a proof or a heartbeat verdict clears it)
    worked: bool = False
    work_at: float = float("-inf")  # the last look or glance that found its Python threads working
    # The last glance (join/stall.py ``StallTracker._glance``): a look at a rank that was working,
    # cut to its Python threads' schedstat (run, wait), read at ``glance_at``; cleared by a look
    glance_at: float = 0.0
    glance: dict[int, tuple[int, int]] = field(default_factory=dict)
    tasks: int = 0  # the rank's number of tasks at the last look or glance
    # the look followed a glance that found no work: the next comes a cycle on, not a look
    # interval (it gives every thread a share over a window after the work stopped)
    soon: bool = False

    @property
    def last(self) -> float:
        """The time of the last look or glance: the next is due a look interval on."""
        return max(self.at, self.glance_at)

    def base(self, tid: int) -> tuple[float, int, int | None] | None:
        """(when, run ns, wait ns) of a thread at the last look or glance that read it: the glance
        reads both; a look reads both for a thread in the working band, the run time alone for
        the others (wait None: their share is their run time's); None when neither read it."""
        if self.glance_at > self.at:
            got = self.glance.get(tid)
            return (self.glance_at, *got) if got is not None else None
        sched = self.sched.get(tid)
        if sched is not None:
            return self.at, *sched
        ran = self.slices.get(tid)
        return (self.at, ran[0], None) if ran is not None else None

    def glanced(self, now: float, readings: dict[int, tuple[int, int]]) -> None:
        self.glance_at, self.glance, self.soon = now, readings, False
        self.worked, self.work_at = True, now

    def record(
        self,
        now: float,
        threads: tuple[ThreadInfo, ...],
        spinning: frozenset[int],
        shares: dict[int, float],
        tasks: int,
        after_glance: bool,
    ) -> None:
        self.threads, self.at, self.spinning, self.shares = threads, now, spinning, shares
        self.glance_at, self.glance, self.tasks, self.soon = 0.0, {}, tasks, after_glance
        self.count += 1


@dataclass
class View:
    """The /proc view of the Python threads (tid, state, wchan, spinning) that paces the dumps."""

    at_dump: Any = None  # the view at the last dump
    at_look: Any = None  # the view at the last look
    since: float = 0.0  # the time of the first look that showed at_look
    dump_due: bool = False  # the view changed since the last dump and held for a look


@dataclass
class LastDump:
    """The last py-spy dump (or the proof that stood for one) and the comparison it made."""

    last_change: float  # the last time the compared place changed
    fingerprint: Any = None
    identical: int = 0  # comparisons in a row that found the same place
    last_at: float = float("-inf")  # the last comparison (a dump, a proof or a look that worked)
    stacks: tuple[ThreadStack, ...] = ()
    # every task's (run ns, run slices) read right before the last py-spy dump (None: unknown),
    # and that dump's time: the same numbers later prove the stacks are still that dump's
    slices: dict[int, tuple[int, int]] | None = None
    stacks_at: float = 0.0
    proven_at: float | None = None  # the last comparison was that proof (not a py-spy run)
    misses: int = 0  # dumps in a row that failed for a passing reason
    spin_dumped: bool = False  # dumped since its Python threads started burning a core
    # threads burning a core at the last dump that it showed with no Python stack (native
    # helpers: an OpenMP pool, NCCL's proxy): a spinner outside both is new since the dump
    spin_native: frozenset[int] = frozenset()

    def took(self, stacks: tuple[ThreadStack, ...], now: float) -> None:
        """A dump taken for a heartbeat rank's words (no comparison, no proof)."""
        self.stacks, self.last_at = stacks, now
        self.slices, self.stacks_at, self.proven_at = None, now, None


@dataclass
class QuietProof:
    """Quiet (QUIET_SHARE) at every look since the last dump or, before the first, since first
    sight; and whether the last comparison rested on that."""

    kept: bool = True
    run_ns: int = 0  # its Python threads' run time since then (the quiet proof's words)
    proof: bool = False  # the last proof was the quiet one (not "no task ran")

    def restart(self) -> None:
        self.kept, self.run_ns = True, 0

    def note(
        self, python_tids: set[int], last: dict[int, tuple[int, int]], now: dict[int, tuple[int, int]], elapsed: float
    ) -> None:
        """Whether the Python threads stayed quiet since the last look (the view is compared by
        the pacing, join/stall_pacing.py): each read at both looks (schedstat), little run time."""
        if not self.kept or elapsed <= 0 or not python_tids or any(t not in now or t not in last for t in python_tids):
            self.kept = False
            return
        ran = sum(now[t][0] - last[t][0] for t in python_tids)
        self.run_ns += ran
        self.kept = ran <= QUIET_SHARE * elapsed * 1e9


@dataclass
class GilWatch:
    """A thread other than the main one holding the GIL in the dumps: (its tid or name, its
    frames, the main thread's frames) of the last dump, and the time of the first dump that showed
    it (the main thread's state flickers between R and S as it polls for the GIL every 5 ms, so
    the stacks' fingerprint does not hold; these frames do)."""

    key: Any = None
    since: float = 0.0

    def note(self, stacks: tuple[ThreadStack, ...], now: float) -> None:
        """Remember who held the GIL in this dump, where (join/stall_verdicts.py gil_holder)."""
        owner = next((s for s in stacks if s.owns_gil), None)
        main = next((s for s in stacks if s.name == "MainThread"), None)
        key = (
            None
            if owner is None or main is None or owner is main
            else (
                owner.tid or owner.name,
                tuple((f.name, f.filename, f.line) for f in owner.frames),
                tuple((f.name, f.filename, f.line) for f in main.frames),
            )
        )
        if key is None or key != self.key:
            self.since = now
        self.key = key


@dataclass
class Words:
    """The main thread's frames and place in the stacks of ``of`` (the verdict's words)."""

    of: tuple[ThreadStack, ...] | None = None
    frames: tuple[str, ...] = ()
    location: tuple[str, ...] = ()
    collective: str = ""  # the c10d collective the main thread was in at that dump ("" none)

    def update(self, stacks: tuple[ThreadStack, ...]) -> None:
        """Once per dump, not per cycle."""
        if self.of is not stacks:
            main = main_stack(stacks)
            self.frames = tuple(str(f) for f in main.frames[:MAX_FRAMES]) if main else ()
            self.location = tuple(f.where for f in main.frames[:3]) if main else ()
            self.collective = collective_name(main.frames) if main else ""
            self.of = stacks


@dataclass
class HangMemo:
    """The last hang analysis (join/hang.py) and what it was made of."""

    analysis: HangAnalysis | None = None  # of the stacks and look in ``of``
    of: tuple[tuple[ThreadStack, ...], float] = ((), 0.0)
    view: Any = None  # the look's view (View.at_look) when it was made
    compile_busy_at: float = float("-inf")  # last look at which it compiled with the CPU busy

    def keep(
        self, analysis: HangAnalysis, stacks: tuple[ThreadStack, ...], looked_at: float, view: Any, now: float
    ) -> None:
        self.analysis = analysis
        self.of = (stacks, looked_at)
        self.view = view
        if analysis.compiling:
            self.compile_busy_at = now

    def stale(
        self, stacks: tuple[ThreadStack, ...], looked_at: float, quiet: bool, has_workers: bool, view: Any
    ) -> bool:
        """Whether the analysis (there is one) must be made again: a new dump, or a new look that
        may change it. A look of a rank quiet since its dump (QUIET_SHARE), with its Python
        threads' view unchanged since the analysis and no workers, changes none of the inputs
        that its words show: the same frames, states, wchan and futex waits, each thread under
        the idle share (measured: the analysis at each look of 64 stalled ranks asleep at one
        line was half of what they cost beside the same ranks beating)."""
        if self.of[0] is not stacks:
            return True
        if self.of[1] == looked_at:
            return False
        return not (quiet and not has_workers and view == self.view)


@dataclass
class RankTrack:
    """One rank process's stall memory across cycles. Written only by ``StallTracker``
    (join/stall.py) and its pacing (join/stall_pacing.py), through the records above."""

    pid: int
    start_ticks: int | None
    first_seen: float
    dump: LastDump
    verdict: StallVerdict | None = None  # the last one, reused while a look is deferred
    stopped_since: float | None = None
    look: Look = field(default_factory=Look)
    view: View = field(default_factory=View)
    quiet: QuietProof = field(default_factory=QuietProof)
    gil: GilWatch = field(default_factory=GilWatch)
    words: Words = field(default_factory=Words)
    hang: HangMemo = field(default_factory=HangMemo)
    workers: RankWorkers = field(default_factory=RankWorkers)
    gpu: GpuWindow = field(default_factory=GpuWindow)  # NVML readings of its GPUs (stall_spin.py)
