"""Stall detection: is each rank alive *and* making progress, and if not, where is it stuck?

Progress comes first from heartbeats: ``gpuwatchd.heartbeat(step)`` (or a shell ``touch``) updates
the mtime of the rank's heartbeat file (the rank file's ``heartbeat`` field); that mtime is the
progress timestamp and a rank is stalled when it is older than ``stall.after_seconds``.

Without a heartbeat, progress is inferred from repeated non-blocking ``py-spy dump``s: a rank whose
Python threads keep exactly the same frames (function, file, line), the same thread states and
wchan, and the same set of CPU-burning threads across dumps spanning ``after_seconds`` is stalled.
A hang is not always 0 % CPU (a CUDA spin-wait sits at 100 % in ``.item()``, research §3.1), so the
CPU pattern is compared, not required to be zero. Without py-spy (absent, not permitted) the same
comparison runs on the /proc thread view alone. A process in state ``T`` (SIGSTOP, a debugger) for
``after_seconds`` is stalled whatever else it shows.

On a node with several ranks of one job, the odd one out is named: when the peers all sit in the
same place (typically one collective) and one rank is elsewhere, progressing alone, or dead, that
rank is the suspect (research §3.2, NVIDIA/nccl#1063: "29 pods blocked in NCCL, 1 pod stuck in an
arbitrary CUDA op"; ``name_suspects`` in join/stall_verdicts.py; the probe and verdict types in model/stall.py).

A thread that burns a core at the one line of every dump is ambiguous (a healthy loop that syncs
each step looks the same): join/stall_spin.py says when that is a stall (the GPU's readings, the
peers) and otherwise the verdict is ``ambiguous``, a warning, never a page.

Conclusive shapes are stalled at ``stall.conclusive_seconds`` instead (CONCLUSIVE_SECONDS: a
lock-order deadlock, the GIL held at one line while the main thread waits, a GPU-confirmed spin
here; a stopped rank, a dead peer and the odd one out of a collective with the job's other ranks,
join/stall_verdicts.py ``judge_jobs``), which also says that a rank waiting in a collective while
a peer of its job progresses is not stalled (``waits_for``: the ``rank_waiting`` info).

Pure given its looker: this module decides which looks are due and turns what they read into
verdicts; the reads themselves are the looker's (``Looker``; the daemon's is
sources/stall_looks.py ``StallLooks``): the heartbeat file's mtime, ``/proc/PID/task/*/schedstat``
(and ``{stat,wchan}`` of the tasks that ran since the last look), ``py-spy dump``.
Cost: one stat per heartbeat rank per cycle (done by the daemon); per-thread reads per
heartbeat-less or stalled *process* every ``dump interval`` (after_seconds/5, at least one cycle,
at most 60 s and, until it is stalled, a third of the conclusive bound: 13.3 s at the shipped
defaults, 4 x the looks of before): one ``schedstat`` per task, two more for a task that ran; and one dump (~10 ms)
when that /proc view changed and settled (at the old pace, after_seconds/5, for a rank whose
Python threads are awake), else once per after_seconds, or at the conclusive bound for a rank
asleep or burning a core, where a conclusive shape can be (issue 22: the dumps were
what a heartbeat-less rank cost beside a beating one), none while no task ran since the last dump
(the same tasks with the same schedstat run time and slice count prove its stacks still hold),
none at first sight (the first dump waits for the second look, which knows each thread's CPU
share: a node's ranks are not all dumped when the daemon or a job starts), for a rank quiet since
first sight (QUIET_SHARE: asleep at the same place at every look, its main thread waking without
working) none before a dump interval ahead of the comparison, and for a stalled one quiet since
its last dump none before QUIET_REDUMP x after_seconds; and none while its
Python threads work in the working band or its own GPU moves data (that is progress already);
never every cycle: between looks a rank's verdict comes from its last look and its heartbeat,
and a stalled rank's hang analysis (join/hang.py) from its last look's and last dump's (for a
quiet one whose Python threads' view holds, the analysis made at its dump stands: ``_analysis_stale``).
Bounded whatever the input: a process listed by many ranks is looked at once per cycle (per-PID
memo), at most ``max_threads`` of its tasks are read, and one ``observe`` spends at most
``budget_seconds`` on looks; the looks over budget are deferred to the next cycle (least recently
looked first) and counted in ``deferred`` (exported as ``gpuwatch_cycle_deferred_probes_total``).
Privilege: as sources/pyspy.py. Shell equivalent: ``stat -c %Y HB``; ``py-spy dump -p PID``
three times a minute apart and ``diff``; ``cat /proc/PID/task/*/{wchan,schedstat}``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any

from gpuwatchd.join.cycle_looks import CycleLooks, Looker
from gpuwatchd.join.hang import analyze, collective_name, wait_tids
from gpuwatchd.join.stall_spin import (
    GpuReading,
    confirm_by_peers,
    confirm_spin,
    new_spinners,
    runnable_shares,
    spinning_python,
)
from gpuwatchd.join.stall_track import RankTrack
from gpuwatchd.join.stall_verdicts import (
    gil_holder,
    judge_jobs,
    main_stack,
    name_suspects,
    summarize_threads,
)
from gpuwatchd.model import RankId
from gpuwatchd.model.stall import RankProbe, StallVerdict
from gpuwatchd.model.threads import ThreadInfo, ThreadStack

log = logging.getLogger(__name__)

SPIN_SHARE = 0.9  # a thread that used >= 90 % of a core between two looks is "burning CPU"
# A thread between WORK_SHARE and SPIN_SHARE alternates between running and waiting: that is work
# being done (a blocked thread uses ~0, a spin-wait ~1 core), and it counts as progress even when
# every dump catches the same line (a loop that spends most of its time in one call).
WORK_SHARE = 0.05
# A rank's Python threads (its main thread before the first dump) are "quiet" at a look when they
# ran at most this share of a core since the last one (schedstat run time: a few wake-ups of a
# sleep or a poll, no work) and the look's /proc view is the last dump's. A stack moves only while
# its thread runs, and one this quiet, asleep at the same place at every look, has had next to no
# chance to: the first dump of a rank quiet since first sight waits until a dump interval before
# the comparison is due, and a stalled rank quiet since its last dump is not dumped again before
# QUIET_REDUMP x after_seconds (issue 22: 64 ranks asleep at one line were dumped each at their
# second look and then once per after_seconds, 2.7 x the cost of the same ranks beating).
QUIET_SHARE = 0.002
QUIET_REDUMP = 6
MAX_FRAMES = 8
# A rank whose first dumps fail for a passing reason (busy slots, a time-out) is tried this many
# times before its /proc view is compared instead (py-spy never reads some processes in time).
MAX_DUMP_MISSES = 4
# At most this many tasks of one process are read per look: a process with 3000 threads costs the
# same as one with 256 (the main thread and the oldest threads come first, by tid).
MAX_PROBE_THREADS = 256
# The conclusive bound (stall.conclusive_seconds): a shape that leaves no doubt (a lock-order
# deadlock, a thread holding the GIL at one line while the main thread waits, a GPU-confirmed
# spin; with the job's other ranks: a stopped rank, a dead peer, the odd one out of a collective,
# join/stall_verdicts.py judge_jobs) is stalled once proven still this long, not after_seconds.
# The looks come at least every third of it, so that a hang is paged within
# conclusive + conclusive / 3 + a cycle of its start (40 + 13 + 5 s at the shipped defaults).
CONCLUSIVE_SECONDS = 40.0


class StallTracker:
    """Per-rank progress memory. ``observe`` once per cycle; not thread-safe (one caller)."""

    def __init__(
        self,
        after_seconds: float,
        looks: Looker,
        *,
        dump_interval_seconds: float | None = None,
        cycle_seconds: float = 5.0,
        compile_after_seconds: float | None = None,
        budget_seconds: float | None = None,
        max_threads: int = MAX_PROBE_THREADS,
        conclusive_seconds: float = CONCLUSIVE_SECONDS,
    ) -> None:
        """``looks``: what reads the host for a look (sources/stall_looks.py).
        ``compile_after_seconds``: a rank still in torch.compile with its CPU busy is reported
        as compiling, and stalled only after this long without progress (default 6x after).
        ``budget_seconds``: the most one ``observe`` spends on thread looks and dumps (default
        a fifth of a cycle, at least 50 ms); ``max_threads``: tasks read per process per look.
        ``conclusive_seconds``: the bound of the conclusive shapes (CONCLUSIVE_SECONDS), at most
        ``after_seconds``."""
        self.after = after_seconds
        self.conclusive = min(conclusive_seconds, after_seconds)
        self.compile_after = (compile_after_seconds if compile_after_seconds is not None
                              else 6 * after_seconds)  # fmt: skip
        self.budget = budget_seconds if budget_seconds is not None else max(0.05, cycle_seconds / 5)
        self.max_threads = max_threads
        # looks deferred because the budget was spent, by kind ("threads", "dump"); cumulative
        self.deferred: collections.Counter[str] = collections.Counter()
        self.looks = looks
        # an awake rank whose /proc view changed is dumped at most this often (the look cadence
        # before the conclusive bound: a fifth of after_seconds, at most a minute)
        if dump_interval_seconds is None:
            self.redump_interval = min(max(after_seconds / 5, cycle_seconds), 60.0)
            dump_interval_seconds = min(self.redump_interval, max(self.conclusive / 3, cycle_seconds))
        else:
            self.redump_interval = dump_interval_seconds
        self.dump_interval = dump_interval_seconds
        self._tracks: dict[RankId, RankTrack] = {}
        self._clk_tck = looks.clk_tck
        self.cycle = CycleLooks(looks, budget=self.budget, max_threads=max_threads,
                                dump_interval=dump_interval_seconds)

    # -- the cycle --------------------------------------------------------------------------------

    def observe(self, now: float, probes: Iterable[RankProbe]) -> dict[RankId, StallVerdict]:
        verdicts: dict[RankId, StallVerdict] = {}
        seen = set()
        work: list[tuple[RankProbe, RankTrack]] = []
        for p in probes:
            if p.key in seen:
                continue
            seen.add(p.key)
            tr = self._tracks.get(p.key)
            if tr is None or tr.pid != p.pid or (
                p.start_ticks is not None and tr.start_ticks not in (None, p.start_ticks)
            ):
                tr = RankTrack(p.pid, p.start_ticks, first_seen=now, last_change=now)
                self._tracks[p.key] = tr
            work.append((p, tr))
        for key in set(self._tracks) - seen:
            del self._tracks[key]
        # least recently looked at first: what the budget defers this cycle goes first next cycle
        work.sort(key=lambda pt: pt[1].threads_at)
        self.cycle.begin()
        try:
            for p, tr in work:
                verdict = self._observe_one(now, p, tr)
                tr.verdict = verdict
                verdicts[p.key] = verdict
        finally:
            self.cycle.end()
        judged = judge_jobs(verdicts, now, self.conclusive, self.conclusive + self.dump_interval)
        return name_suspects(confirm_by_peers(judged))

    def note_gpus(self, readings: dict[RankId, GpuReading]) -> None:
        """This cycle's NVML view of each rank's GPUs (the daemon calls it after its join, where the
        GPU readings meet the ranks); read by the spin rules at the next look."""
        for key, r in readings.items():
            tr = self._tracks.get(key)
            if tr is not None:
                tr.gpu.add(r)

    def _deferred(self, now: float, p: RankProbe, tr: RankTrack, kind: str) -> StallVerdict:
        """The verdict of a rank whose look the budget defers: its last one, or "not yet"."""
        self.deferred[kind] += 1
        if tr.verdict is not None:
            return tr.verdict
        return StallVerdict(p.job_id, p.rank, p.pid, True, tr.first_seen, False,
                            "heartbeat" if p.heartbeat else "proc", max(0.0, now - tr.first_seen))

    def _observe_one(self, now: float, p: RankProbe, tr: RankTrack) -> StallVerdict:
        if not p.alive:
            return StallVerdict(p.job_id, p.rank, p.pid, False, None, False, "dead", 0.0)
        stopped = p.state in ("T", "t")
        tr.workers.remember(now, p.workers)
        if p.heartbeat_read:
            hb_mtime = p.heartbeat_mtime
        else:
            hb_mtime = self.looks.heartbeat_mtime(p.heartbeat, p.owner_uid) if p.heartbeat else None
        age = now - (hb_mtime or tr.first_seen)
        if p.heartbeat and not stopped and age <= min(self.after / 2, self.conclusive / 3):
            # a beating rank: its heartbeat says it all, no need to look at its threads. One
            # that is late (past a third of the conclusive bound) is looked at like a stalled
            # one, so that by the conclusive bound a look knows each thread's CPU share, the
            # workers' CPU and whether it was compiling, and a dump (at most one a dump interval,
            # from a dump interval before the conclusive bound) where its threads are.
            return StallVerdict(p.job_id, p.rank, p.pid, True, hb_mtime or tr.first_seen, False,
                                "heartbeat", max(0.0, age), doing=f"beats (last heartbeat "
                                f"{max(0.0, age):.0f} s ago)")
        # Per-thread detail only at the look cadence (the dump interval), not every cycle: between
        # looks the verdict keeps the last look's thread view (issue 14: per-thread reads of every
        # torch rank every cycle were most of the daemon's CPU).
        # A rank already stalled is looked at the old pace (a fifth of after_seconds, at most a
        # minute): the conclusive bound's cadence is for seeing a hang begin (64 stalled ranks
        # looked at every 13.3 s cost 1.6 x the 60 s looks of before, bench/cycle_fast.py)
        every = self.redump_interval if tr.verdict is not None and tr.verdict.stalled \
            else self.dump_interval
        look_due = tr.threads_at == 0.0 or now - tr.threads_at >= every
        if look_due and self.cycle.over_budget(p.pid):
            return self._deferred(now, p, tr, "threads")
        if look_due:
            # CPU pattern since the previous look, per thread
            prev_slices = {t.tid: (tr.look_slices[t.tid], t) for t in tr.threads if t.tid in tr.look_slices}
            last_slices = tr.look_slices
            threads, tr.look_slices = self.cycle.threads(p.pid, prev_slices)
            elapsed = now - tr.threads_at if tr.threads else 0.0
            prev = {t.tid: t.cpu_ticks for t in tr.threads}
            shares = {
                t.tid: (t.cpu_ticks - prev[t.tid]) / self._clk_tck / elapsed
                for t in threads if elapsed > 0 and t.tid in prev
            }  # fmt: skip
            shares, tr.sched = runnable_shares(self.looks.schedstat, p.pid, tr.sched, shares, elapsed)
            spinning = frozenset(tid for tid, share in shares.items() if share >= SPIN_SHARE)
            # Python 3.10 dumps carry no tid (py-spy #567): then any task's work band counts;
            # before the first dump only the main thread's does (a native helper thread, a
            # pin-memory or NCCL thread, may work beside a hung main thread)
            python_tids = {s.tid for s in tr.stacks if s.tid} or (set(shares) if tr.stacks else {p.pid})
            if any(WORK_SHARE <= shares[t] < SPIN_SHARE for t in python_tids if t in shares):
                tr.worked, tr.work_at = True, now
            if tr.threads_at:
                self._note_quiet(tr, python_tids, last_slices, elapsed)
            active = tr.gpu.active_at()
            if active is not None and active > tr.last_change and elapsed > 0:
                # its own GPU moved data since the last change: progress (below), no dump needed
                tr.worked = True
            self._look(now, tr, threads, spinning, shares)
            tr.busiest_worker = tr.workers.busiest(p.workers, elapsed)
            tr.summary = summarize_threads(threads, spinning)
            total = self.cycle.task_count(p.pid)
            if total > len(threads):
                tr.summary += f" (first {len(threads)} of {total} read)"
        else:
            threads, spinning, shares = tr.threads, tr.spinning, tr.shares
        busiest_worker = tr.busiest_worker
        if stopped:
            tr.stopped_since = tr.stopped_since if tr.stopped_since is not None else now
        else:
            tr.stopped_since = None

        stalled_so_far = False
        if p.heartbeat:
            # A rank late with its heartbeat that works (its Python threads in the working band
            # at a look, or data moving on a GPU only its job holds) progresses without beating:
            # rank 0 evaluating or saving a checkpoint between two optimizer steps (autobeat
            # beats at each). A spin, a block or an idle GPU is no work: the heartbeat decides.
            method, tr.worked = "heartbeat", False
            progress = max(hb_mtime if hb_mtime is not None else tr.first_seen, tr.work_at,
                           tr.gpu.active_at() or float("-inf"))
            stalled_so_far = now - progress > self.after
        else:
            method, progress = self._stack_progress(now, p, tr, threads, spinning, look_due)
            # a GPU that only its job uses and that moves data is doing the job's work
            active = tr.gpu.active_at()
            if active is not None and active > progress:
                progress = active
            # two identical dumps at least after_seconds apart, with every /proc look between them
            # unchanged (a look that changes dumps again): the same place the whole time
            stalled_so_far = tr.identical >= 1 and now - progress >= self.after and (
                tr.last_dump_at - tr.last_change >= self.after)
        # proven still this long: the heartbeat's age, or the span of the last comparison that
        # found the same stacks (a dump or a proof, join/stall.py _stack_progress)
        if p.heartbeat:
            still = now - progress
        else:
            still = min(now - progress, tr.last_dump_at - tr.last_change) if tr.identical >= 1 else 0.0
        stopped_for = now - tr.stopped_since if tr.stopped_since is not None else None
        if stopped_for is not None and tr.stopped_since is not None and stopped_for >= self.after:
            method, stalled_so_far = "stopped", True
            progress = min(progress, tr.stopped_since)
        held = still >= self.conclusive and not stalled_so_far
        # one thread held the GIL at the same line in every dump for the conclusive bound
        gil_held = tr.gil_key is not None and tr.stacks_at - tr.gil_since >= self.conclusive
        late = bool(p.heartbeat) and not stalled_so_far and \
            now - progress > min(self.after / 2, self.conclusive - self.dump_interval)
        if (stalled_so_far or late) and now - tr.last_dump_at >= self.dump_interval and p.heartbeat:
            # the stuck frames for the explanation (heartbeat ranks are not dumped otherwise)
            stacks, _ = self.cycle.dump(now, p.pid)
            if stacks is not None:
                tr.stacks, tr.last_dump_at = stacks, now
                tr.dump_slices, tr.stacks_at, tr.proven_at = None, now, None
                tr.note_gil(stacks, now)
        if tr.words_of is not tr.stacks:  # once per dump, not per cycle
            main = main_stack(tr.stacks)
            tr.frames = tuple(str(f) for f in main.frames[:MAX_FRAMES]) if main else ()
            tr.location = tuple(f.where for f in main.frames[:3]) if main else ()
            tr.collective = collective_name(main.frames) if main else ""
            tr.words_of = tr.stacks
        frames, location = tr.frames, tr.location
        analysis = None
        compiling = False
        spin = spinning_python(tr.stacks, spinning) if (stalled_so_far or held) and spinning and \
            method in ("stack", "proc") else frozenset()
        if (stalled_so_far or late or held or gil_held) and tr.stacks:
            if tr.analysis is None or self._analysis_stale(p, tr):
                # at the look cadence: its inputs are the last dump's stacks and the last look's
                # threads, and a stalled rank's analysis every cycle was most of what 64 such
                # ranks cost (the syscall of each waiting thread, each thread classified)
                waits = self.looks.waits(p.pid, wait_tids(tr.stacks, threads))
                workers = tr.workers.view(self.looks.context_switches, p.workers)
                tr.analysis = analyze(tr.stacks, threads, shares, waits, workers, busiest_worker)
                tr.analysis_of = (tr.stacks, tr.threads_at)
                tr.analysis_view = tr.look_fp
                if tr.analysis.compiling:
                    tr.compile_busy_at = now
            analysis = tr.analysis
            # The compiler's CPU moves between short-lived children (g++, Triton workers) and
            # the rank itself, and a dump may catch it in C code without a Python frame: within
            # after_seconds of a busy compiling look, it is still compiling unless it now shows
            # another hang (a lock, a collective, the GPU, a starved queue).
            other = {"deadlock", "lock_wait", "collective", "gpu_wait", "starved"}
            if stalled_so_far and now - tr.compile_busy_at <= self.after and \
                    not other & set(analysis.kinds) and method != "stopped":
                compiling = True
                stalled_so_far = now - progress > self.compile_after
                method = "compiling"
        ambiguous, confirmed_by, gpu_words, conclusive = False, "", "", ""
        # a conclusive shape of its own (the stacks dumped since its last heartbeat, for a rank
        # with one): stalled at the conclusive bound, and whatever its threads burn
        own = analysis is not None and not compiling and method != "stopped" and (
            not p.heartbeat or tr.stacks_at >= progress)
        if own and (stalled_so_far or held) and analysis is not None and "deadlock" in analysis.kinds:
            stalled_so_far, conclusive = True, "deadlock" if held else ""
        elif own and gil_held and analysis is not None and gil_holder(analysis):
            conclusive = "" if stalled_so_far else "gil"
            stalled_so_far, spin, progress = True, frozenset(), min(progress, tr.gil_since)
            still = max(still, tr.stacks_at - tr.gil_since)
        if spin and (stalled_so_far or held) and not compiling:
            bound = self.after if stalled_so_far else self.conclusive
            confirmed_by, gpu_words = confirm_spin(tr.gpu, progress, now, bound, analysis)
            if stalled_so_far:
                stalled_so_far = bool(confirmed_by)
                ambiguous = not stalled_so_far
            elif confirmed_by == "gpu_spin":  # a kernel that never ends: conclusive
                stalled_so_far, conclusive = True, "gpu_spin"
            else:
                confirmed_by = ""  # not stalled (yet): nothing to confirm
        return StallVerdict(
            job_id=p.job_id, rank=p.rank, pid=p.pid, alive=True, progress_timestamp=progress,
            stalled=stalled_so_far, method=method, no_progress_seconds=max(0.0, now - progress),
            stuck_frames=frames, threads_summary=tr.summary,
            location=location, analysis=analysis, compiling=compiling,
            ambiguous=ambiguous, confirmed_by=confirmed_by, gpu_evidence=gpu_words,
            unchanged=(tr.stacks_at, tr.proven_at) if tr.proven_at is not None and method == "stack"
            else None,
            unchanged_quiet_ms=tr.quiet_run_ns / 1e6 if tr.proven_at is not None and tr.quiet_proof
            and method == "stack" else None,
            still_seconds=max(0.0, still), stopped_seconds=stopped_for, conclusive=conclusive,
            doing=self._doing(now, p, tr, progress, shares, stalled_so_far or ambiguous),
            watch=self._watch(now, p, tr, age),
        )  # fmt: skip

    def _watch(self, now: float, p: RankProbe, tr: RankTrack, age: float) -> str:
        """Why the job's own view (NCCL RAS) is worth asking about a rank that may be progressing:
        its heartbeat is late (past the bound where its threads are looked at: working or not, a
        rank that stopped beating may be one whose work is only local), or its last dump shows
        its main thread in a collective and no look since found its Python threads working (a
        rank waiting in one at every dump is at work only if its collectives complete). ""
        otherwise: a rank beating on time, or working since its last dump, costs no query."""
        if p.heartbeat and age > min(self.after / 2, self.conclusive / 3):
            return f"heartbeat late ({age:.0f} s)"
        if tr.collective and tr.stacks and tr.work_at < tr.stacks_at:
            return f"in {tr.collective} at its last dump"
        return ""

    def _doing(self, now: float, p: RankProbe, tr: RankTrack, progress: float,
               shares: dict[int, float], stuck: bool) -> str:
        """What a rank that progresses does, in words (a waiting peer's page or its absence says
        it); "" for a rank with no progress seen within the conclusive bound."""
        if stuck or now - progress > self.conclusive + self.dump_interval:
            return ""
        if progress <= tr.first_seen and not p.heartbeat:
            return ""  # nothing seen move since first sight
        if p.heartbeat and tr.work_at < progress and (tr.gpu.active_at() or 0.0) < progress:
            return f"beats (last heartbeat {now - progress:.0f} s ago)"
        active = tr.gpu.active_at()
        if active is not None and now - active <= self.dump_interval:
            return "moves data on its GPU"
        busiest = max(shares.values(), default=0.0)
        if busiest >= WORK_SHARE:
            return f"works on its CPU ({min(busiest, 1.0):.0%} of a core)"
        return "moved its Python stack since the last dump"

    @staticmethod
    def _analysis_stale(p: RankProbe, tr: RankTrack) -> bool:
        """Whether the rank's hang analysis (there is one) must be made again: a new dump, or a
        new look that may change it. A look of a rank quiet since its dump (QUIET_SHARE), with
        its Python threads' view unchanged since the analysis and no workers, changes none of the
        inputs that its words show: the same frames, states, wchan and futex waits, each thread
        under the idle share (issue 22: the analysis at each look of 64 stalled ranks asleep at
        one line was half of what they cost beside the same ranks beating)."""
        if tr.analysis_of[0] is not tr.stacks:
            return True
        if tr.analysis_of[1] == tr.threads_at:
            return False
        return not (tr.quiet and not p.workers and tr.look_fp == tr.analysis_view)

    @staticmethod
    def _note_quiet(tr: RankTrack, python_tids: set[int], last: dict[int, tuple[int, int]],
                    elapsed: float) -> None:
        """Whether the Python threads stayed quiet since the last look (the view is compared in
        ``_stack_progress``): each read at both looks (schedstat), with little run time."""
        now = tr.look_slices
        if not tr.quiet or elapsed <= 0 or not python_tids or \
                any(t not in now or t not in last for t in python_tids):
            tr.quiet = False
            return
        ran = sum(now[t][0] - last[t][0] for t in python_tids)
        tr.quiet_run_ns += ran
        tr.quiet = ran <= QUIET_SHARE * elapsed * 1e9

    @staticmethod
    def _look(now: float, tr: RankTrack, threads: tuple[ThreadInfo, ...],
              spinning: frozenset[int], shares: dict[int, float]) -> None:
        tr.threads, tr.threads_at, tr.spinning, tr.shares = threads, now, spinning, shares
        tr.looks += 1

    def _stack_progress(
        self, now: float, p: RankProbe, tr: RankTrack, threads: tuple[ThreadInfo, ...],
        spinning: frozenset[int], looked: bool = True,
    ) -> tuple[str, float]:  # fmt: skip
        """Compare this look with the last one; returns (method, last change time)."""
        # The view of the Python threads of the last dump (all tasks when it gave no tids, or
        # before the first): native helper threads (CUDA, NCCL, gloo) wake on their own, and a view
        # with them in it rarely holds for two looks (the device run: 20-thread torch ranks).
        # Computed only where used (a look, a dump): most cycles of most ranks use neither.
        def view() -> Any:
            python_tids = {s.tid for s in tr.stacks if s.tid}
            if not python_tids or any(not s.tid for s in tr.stacks):
                python_tids = {t.tid for t in threads}
            return tuple((t.tid, t.state, t.wchan, t.tid in spinning) for t in threads
                         if t.tid in python_tids)  # fmt: skip

        before_second_look = tr.fingerprint is None and tr.looks < 2
        never = tr.fingerprint is None and tr.last_dump_at == float("-inf")  # no dump, no work
        if looked:
            proc_fp = view()
            main_fp = tuple(v for v in proc_fp if v[0] == p.pid)
            if tr.fingerprint is None and tr.look_fp is not None and \
                    main_fp != tuple(v for v in tr.look_fp if v[0] == p.pid):
                tr.last_change = now  # its main thread moved between the looks before its first dump
            if never:
                # before the first dump only the main thread's view counts, against the one at
                # first sight (native helper threads wake on their own)
                tr.proc_fp = main_fp if tr.proc_fp is None else tr.proc_fp
                tr.quiet = tr.quiet and main_fp == tr.proc_fp
            else:
                tr.quiet = tr.quiet and proc_fp == tr.proc_fp
                # a view that differs from the one at the last dump and held for one look: the
                # rank has moved and settled (a dump in the middle of a move would see neither place)
                if proc_fp != tr.proc_fp and proc_fp == tr.look_fp:
                    tr.dump_due = True
            if proc_fp != tr.look_fp:
                tr.view_since = now
            tr.look_fp = proc_fp
        if before_second_look and self.looks.can_dump:
            # No dump at first sight (issue 22: a node's ranks were all dumped at once when the
            # daemon or a job started): the next look, a dump interval on, knows each thread's
            # CPU share, and a rank that works needs no dump at all. The stall bound is unchanged:
            # the second dump is due after_seconds after the first look.
            return "proc", tr.last_change
        if tr.worked:
            # Python threads used CPU in the working band since the last look, or its own GPU
            # moved data: that is progress whatever a stack dump would show, so spare the target
            # and ourselves the py-spy run.
            tr.worked = False
            tr.identical = 0
            tr.last_change = now
            tr.last_dump_at = now  # this look counts as the comparison: next one a dump interval on
            # a burn seen after this work is a new one, dumped a dump interval on (a dump while
            # it started up, CUDA's init at 100 % of a core, left it set through the training)
            tr.spin_dumped = False
            tr.proc_fp, tr.dump_due, tr.proven_at = view(), False, None
            tr.quiet, tr.quiet_run_ns, tr.analysis_view = True, 0, None
            return ("stack" if tr.stacks else "proc"), now
        # The dump cadence (issue 22: the dumps were what a rank without heartbeat cost beside one
        # with). A /proc view (each thread's state, wchan, burning a core or not) that changed
        # since the last dump and held for a look is dumped at once: a hang usually starts with
        # such a change. Otherwise the next dump comes after_seconds after the last change of
        # stack (the one that can make a stall), and for a rank already stalled after_seconds
        # after the last dump. A stall is two identical dumps after_seconds apart with no settled
        # change of view between them: a hang is seen after_seconds after the first look that
        # shows it settled, plus a look or two.
        stalled = tr.identical >= 1 and tr.last_dump_at - tr.last_change >= self.after
        # proven still for the conclusive bound: the next comparison is the after_seconds one
        held = tr.identical >= 1 and tr.last_dump_at - tr.last_change >= self.conclusive
        burning = spinning_python(tr.stacks, spinning)
        # Only where a conclusive shape can be are comparisons due at look pace: its Python
        # threads asleep at the last look (a lock, a collective: the schedstat proof usually
        # spares the dump) or one burning a core (a GPU spin, the GIL). A rank awake at changing
        # places keeps the pace of after_seconds (at the shipped defaults, a dump every
        # conclusive bound of a rank at 1 % CPU whose stacks move was 23 dumps in 900 s, not 3).
        settled = bool(burning) or not any(v[1] == "R" for v in tr.look_fp or ())
        changed_at = now
        if tr.dump_due and tr.view_since > tr.last_change:
            # the view changed at a look and held at the next: the new place dates from the first
            changed_at = tr.view_since
        if not self.looks.can_dump:
            due = tr.last_dump_at + self.dump_interval  # (without py-spy the view is the comparison)
        elif tr.dump_due:
            due = tr.last_dump_at + (self.dump_interval if settled else self.redump_interval)
        elif never:
            # The first dump is due at once, unless the rank has been quiet since first sight:
            # then it is the first of the two a stall needs, a dump interval before the second.
            due = tr.last_change + self.conclusive - self.dump_interval if tr.quiet else now
        elif stalled:
            due = tr.last_dump_at + max(self.dump_interval, self.after)
        else:
            bound = self.conclusive if settled and not held else self.after
            due = max(tr.last_dump_at + self.dump_interval, tr.last_change + bound)
        # A Python thread that starts burning a core is dumped at once (a dump interval after the
        # last), and one seen holding the GIL again a conclusive bound after: the GIL shape needs
        # two dumps that far apart, and the main thread that polls for the GIL every 5 ms makes
        # the view flicker (no settled change to dump on)
        if not burning:
            tr.spin_dumped = False
        elif not tr.spin_dumped:
            due = min(due, tr.last_dump_at + self.dump_interval)
        # A thread burning a core that the last dump did not show is dumped the same way: the
        # view holds only that dump's Python threads, and the main thread waiting for a GIL the
        # new thread keeps flickers between R and S (no settled change). Undumped, the GIL fault
        # of the catalog was first dumped after_seconds after the last change (the device: paged
        # 61.6 s after the fault at after_seconds 30, not within the conclusive bound).
        if new_spinners(tr.stacks, spinning, tr.spin_native):
            due = min(due, tr.last_dump_at + self.dump_interval)
        if tr.gil_key is not None:
            due = min(due, max(tr.last_dump_at + self.dump_interval, tr.gil_since + self.conclusive))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("stall pacing: pid %d due in %.1f s (identical %d, settled %s, burning %s, "
                      "new spinners %s, gil held since %.1f s, dump_due %s, last change %.1f s ago)",
                      p.pid, due - now, tr.identical, settled, sorted(burning),
                      sorted(new_spinners(tr.stacks, spinning, tr.spin_native)),
                      now - tr.gil_since if tr.gil_key is not None else -1.0, tr.dump_due,
                      now - tr.last_change)
        if now < due:
            return ("stack" if tr.stacks else "proc"), tr.last_change
        if self.cycle.dump_over_budget(p.pid):
            self.deferred["dump"] += 1
            return ("stack" if tr.stacks else "proc"), tr.last_change
        asleep = bool(tr.stacks) and not any(t.state == "R" for t in threads)
        if asleep and tr.dump_slices is not None and self.cycle.run_slices(p.pid) == tr.dump_slices:
            # The same tasks, none ran since the last dump (schedstat's numbers grow while a task
            # runs; one on a CPU throughout, which a tickless CPU may not count, reads R): a Python
            # stack changes only when its thread runs, so the stacks are that dump's. A rank
            # blocked at 0 % CPU is dumped once per episode (issue 22: the dumps were its cost).
            stacks: tuple[ThreadStack, ...] | None = tr.stacks
            hopeless, proven, tr.quiet_proof = False, True, False
        elif asleep and held and tr.quiet and now - tr.stacks_at < QUIET_REDUMP * self.after:
            # Stalled, and its Python threads quiet at every look since the dump (QUIET_SHARE):
            # that dump still stands, re-checked by a dump every QUIET_REDUMP x after_seconds.
            stacks, hopeless, proven, tr.quiet_proof = tr.stacks, False, True, True
        else:
            stacks, hopeless = self.cycle.dump(now, p.pid)
            proven = False
        if stacks is None and not hopeless and (tr.stacks or tr.dump_misses < MAX_DUMP_MISSES):
            # busy slots / timed out (then dumps pause an interval) / odd output this time: try
            # again, change nothing. A rank not yet dumped is tried MAX_DUMP_MISSES times (the
            # cycles of a pause not counted) before its /proc view stands in for its stacks: a
            # failed first dump taken as the comparison made the next, real one a change, and
            # the stall a second after_seconds late.
            if self.cycle.dump_tried(p.pid):
                tr.dump_misses += 1
            return ("stack" if tr.stacks else "proc"), tr.last_change
        tr.dump_misses = 0
        by_tid = {t.tid: t for t in threads}
        tr.proc_fp, tr.dump_due = view(), False
        if stacks:
            if not proven:
                tr.dump_slices = self.cycle.slices_before_dump(p.pid)
                tr.stacks_at = now
                tr.quiet, tr.quiet_run_ns = True, 0
                tr.note_gil(stacks, now)
                tr.spin_dumped = bool(burning)
                tr.spin_native = spinning - {s.tid for s in stacks if s.tid}
            tr.proven_at = now if proven else None
            tr.stacks, tr.last_dump_at = stacks, now
            method = "stack"
            # only Python threads: native helper threads (NCCL watchdog, CUDA) wake on their own
            fp: Any = tuple(sorted(
                (s.tid or -1, tuple((f.name, f.filename, f.line) for f in s.frames),
                 by_tid[s.tid].state if s.tid in by_tid else "",
                 by_tid[s.tid].wchan if s.tid in by_tid else "",
                 s.tid in spinning)
                for s in stacks
            ))  # fmt: skip
        else:
            tr.last_dump_at = now
            method = "proc"
            fp = tuple((t.tid, t.state, t.wchan, t.tid in spinning) for t in threads)
        if fp != tr.fingerprint or tr.worked:
            if tr.fingerprint is not None:
                tr.last_change = changed_at
            tr.worked = False
            tr.fingerprint, tr.identical = fp, 0
        else:
            tr.identical += 1
        return method, tr.last_change
