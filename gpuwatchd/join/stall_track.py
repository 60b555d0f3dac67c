"""The stall tracker's memory of one rank (``RankTrack``): what its last /proc look and its last
py-spy dump read, what they proved (the fingerprints compared, the quiet and "no task ran" proofs),
and the words and analysis made from them. The rules that read and write it are in join/stall.py;
kept by (job, rank) while the rank lives, dropped when it leaves. No I/O.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.join.rank_workers import RankWorkers
from gpuwatchd.join.stall_spin import GpuWindow
from gpuwatchd.model.stall import HangAnalysis, StallVerdict
from gpuwatchd.model.threads import ThreadInfo, ThreadStack


@dataclass
class RankTrack:
    """One rank process's stall memory across cycles: its last look, its last dump and what
    they proved. Written only by ``StallTracker`` (join/stall.py, whose rules name each field)."""

    pid: int
    start_ticks: int | None
    first_seen: float
    last_change: float
    fingerprint: Any = None
    identical: int = 0
    last_dump_at: float = float("-inf")
    stacks: tuple[ThreadStack, ...] = ()
    threads: tuple[ThreadInfo, ...] = ()
    threads_at: float = 0.0
    spinning: frozenset[int] = frozenset()
    worked: bool = False
    stopped_since: float | None = None
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    shares: dict[int, float] = field(default_factory=dict)
    workers: RankWorkers = field(default_factory=RankWorkers)
    compile_busy_at: float = float("-inf")  # last look at which it compiled with the CPU busy
    verdict: StallVerdict | None = None  # the last one, reused while a look is deferred
    summary: str = ""  # summarize_threads of the last look
    busiest_worker: float | None = None  # of the last look (rank_workers.py)
    gpu: GpuWindow = field(default_factory=GpuWindow)  # NVML readings of its GPUs (stall_spin.py)
    proc_fp: Any = None  # the /proc view at the last dump: (tid, state, wchan, spinning)
    look_fp: Any = None  # the /proc view at the last look
    view_since: float = 0.0  # the time of the first look that showed look_fp
    dump_due: bool = False  # the view changed since the last dump and held for a look
    sched: dict[int, tuple[int, int]] = field(default_factory=dict)  # tid -> schedstat (run, wait)
    # every task's (run ns, run slices) read right before the last py-spy dump (None: unknown),
    # and that dump's time: the same numbers later prove the stacks are still that dump's
    dump_slices: dict[int, tuple[int, int]] | None = None
    stacks_at: float = 0.0
    proven_at: float | None = None  # the last comparison was that proof (not a py-spy run)
    # quiet (QUIET_SHARE) at every look since the last dump or, before the first, since first sight
    quiet: bool = True
    quiet_run_ns: int = 0  # its Python threads' run time since then (the quiet proof's words)
    quiet_proof: bool = False  # the last proof was the quiet one (not "no task ran")
    look_slices: dict[int, tuple[int, int]] = field(default_factory=dict)  # of tr.threads
    looks: int = 0  # /proc looks so far
    dump_misses: int = 0  # dumps in a row that failed for a passing reason
    analysis: HangAnalysis | None = None  # of the stacks and look in analysis_of
    analysis_of: tuple[tuple[ThreadStack, ...], float] = ((), 0.0)
    analysis_view: Any = None  # look_fp when the analysis was made
    # the main thread's frames and place in the stacks of words_of (the verdict's words)
    words_of: tuple[ThreadStack, ...] | None = None
    frames: tuple[str, ...] = ()
    location: tuple[str, ...] = ()
    collective: str = ""  # the c10d collective the main thread was in at that dump ("" none)
    # a thread other than the main one holding the GIL in the dumps: (its tid or name, its frames,
    # the main thread's frames) of the last dump, and the time of the first dump that showed it
    # (the main thread's state flickers between R and S as it polls for the GIL every 5 ms, so
    # the stacks' fingerprint does not hold; these frames do)
    gil_key: Any = None
    gil_since: float = 0.0
    spin_dumped: bool = False  # dumped since its Python threads started burning a core
    # threads burning a core at the last dump that it showed with no Python stack (native
    # helpers: an OpenMP pool, NCCL's proxy): a spinner outside both is new since the dump
    spin_native: frozenset[int] = frozenset()
    work_at: float = float("-inf")  # the last look that found its Python threads working

    def note_gil(self, stacks: tuple[ThreadStack, ...], now: float) -> None:
        """Remember who held the GIL in this dump, where (join/stall_verdicts.py gil_holder)."""
        owner = next((s for s in stacks if s.owns_gil), None)
        main = next((s for s in stacks if s.name == "MainThread"), None)
        key = None if owner is None or main is None or owner is main else (
            owner.tid or owner.name, tuple((f.name, f.filename, f.line) for f in owner.frames),
            tuple((f.name, f.filename, f.line) for f in main.frames))
        if key is None or key != self.gil_key:
            self.gil_since = now
        self.gil_key = key
