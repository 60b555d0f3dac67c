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
defaults, 4 x the looks of before): one ``schedstat`` per task, two more for a task that ran
(while a rank's Python threads work, a glance at them stands for the look: one ``schedstat`` per
Python thread, ``StallTracker._glance``);
and the dumps that join/stall_pacing.py (``DumpPacing``) finds due, at most one a dump interval;
never every cycle: between looks a rank's verdict comes from its last look and its heartbeat,
and a stalled rank's hang analysis (join/hang.py) from its last look's and last dump's (for a
quiet one whose Python threads' view holds, the analysis made at its dump stands:
join/stall_track.py ``HangMemo.stale``). The memory of each rank is join/stall_track.py's.
Bounded whatever the input: a process listed by many ranks is looked at once per cycle (per-PID
memo), at most ``max_threads`` of its tasks are read, and one ``observe`` spends at most
``budget_seconds`` on looks; the looks over budget are deferred to the next cycle (least recently
looked first) and counted in ``deferred`` (exported as ``gpuwatch_cycle_deferred_probes_total``).
Privilege: as sources/pyspy.py. Shell equivalent: ``stat -c %Y HB``; ``py-spy dump -p PID``
three times a minute apart and ``diff``; ``cat /proc/PID/task/*/{wchan,schedstat}``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from gpuwatchd.join.cycle_looks import CycleLooks, Looker
from gpuwatchd.join.hang import analyze, wait_tids
from gpuwatchd.join.stall_pacing import DumpPacing
from gpuwatchd.join.stall_spin import (
    GpuReading,
    confirm_by_peers,
    confirm_spin,
    log_held,
    runnable_shares,
    spinning_python,
)
from gpuwatchd.join.stall_track import LastDump, RankTrack
from gpuwatchd.join.stall_verdicts import (
    gil_holder,
    judge_jobs,
    name_suspects,
    summarize_threads,
)
from gpuwatchd.model import RankId
from gpuwatchd.model.stall import RankProbe, StallVerdict

SPIN_SHARE = 0.9  # a thread that used >= 90 % of a core between two looks is "burning CPU"
# A thread between WORK_SHARE and SPIN_SHARE alternates between running and waiting: that is work
# being done (a blocked thread uses ~0, a spin-wait ~1 core), and it counts as progress even when
# every dump catches the same line (a loop that spends most of its time in one call).
WORK_SHARE = 0.05
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
        self.cycle_seconds = cycle_seconds
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
        self.cycle = CycleLooks(looks, budget=self.budget, max_threads=max_threads, dump_interval=dump_interval_seconds)
        self.pacing = DumpPacing(
            after_seconds,
            self.conclusive,
            dump_interval_seconds,
            self.redump_interval,
            looks,
            self.cycle,
            self.deferred,
        )

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
            if (
                tr is None
                or tr.pid != p.pid
                or (p.start_ticks is not None and tr.start_ticks not in (None, p.start_ticks))
            ):
                tr = RankTrack(p.pid, p.start_ticks, now, LastDump(last_change=now))
                self._tracks[p.key] = tr
            work.append((p, tr))
        for key in set(self._tracks) - seen:
            del self._tracks[key]
        # least recently looked at first: what the budget defers this cycle goes first next cycle
        work.sort(key=lambda pt: pt[1].look.at)
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
        return StallVerdict(
            p.job_id,
            p.rank,
            p.pid,
            True,
            tr.first_seen,
            False,
            "heartbeat" if p.heartbeat else "proc",
            max(0.0, now - tr.first_seen),
        )

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
            return StallVerdict(
                p.job_id,
                p.rank,
                p.pid,
                True,
                hb_mtime or tr.first_seen,
                False,
                "heartbeat",
                max(0.0, age),
                doing=f"beats (last heartbeat {max(0.0, age):.0f} s ago)",
            )
        # Per-thread detail only at the look cadence (the dump interval), not every cycle: between
        # looks the verdict keeps the last look's thread view (measured: per-thread reads of every
        # torch rank every cycle were most of the daemon's CPU).
        # A rank already stalled is looked at the old pace (a fifth of after_seconds, at most a
        # minute): the conclusive bound's cadence is for seeing a hang begin (64 stalled ranks
        # looked at every 13.3 s cost 1.6 x the 60 s looks of before, bench/cycle_fast.py)
        every = self.redump_interval if tr.verdict is not None and tr.verdict.stalled else self.dump_interval
        if tr.look.soon:
            every = min(every, self.cycle_seconds)
        look_due = tr.look.at == 0.0 or now - tr.look.last >= every
        glance = self._glance(now, p, tr) if look_due and not p.heartbeat else None
        if (
            glance is not None
            and any(WORK_SHARE <= v < SPIN_SHARE for v in glance[1].values())
            and glance[2] == tr.look.tasks
        ):
            # still working, and no thread came or went: the glance stands for the look
            tr.look.glanced(now, glance[0])
            look_due = False
        if look_due and self.cycle.over_budget(p.pid):
            return self._deferred(now, p, tr, "threads")
        if look_due:
            # CPU pattern since the previous look, per thread
            prev_slices = {t.tid: (tr.look.slices[t.tid], t) for t in tr.look.threads if t.tid in tr.look.slices}
            last_slices = tr.look.slices
            threads, tr.look.slices = self.cycle.threads(p.pid, prev_slices)
            elapsed = now - tr.look.at if tr.look.threads else 0.0
            prev = {t.tid: t.cpu_ticks for t in tr.look.threads}
            shares = {
                t.tid: (t.cpu_ticks - prev[t.tid]) / self._clk_tck / elapsed
                for t in threads if elapsed > 0 and t.tid in prev
            }  # fmt: skip
            shares, tr.look.sched = runnable_shares(self.looks.schedstat, p.pid, tr.look.sched, shares, elapsed)
            if glance is not None:
                # its Python threads over the glance's window, not since the look before the
                # glances (over that one, a rank that stopped working a moment ago still works)
                shares.update(glance[1])
            spinning = frozenset(tid for tid, share in shares.items() if share >= SPIN_SHARE)
            # Python 3.10 dumps carry no tid (py-spy #567): then any task's work band counts;
            # before the first dump only the main thread's does (a native helper thread, a
            # pin-memory or NCCL thread, may work beside a hung main thread)
            python_tids = {s.tid for s in tr.dump.stacks if s.tid} or (set(shares) if tr.dump.stacks else {p.pid})
            if any(WORK_SHARE <= shares[t] < SPIN_SHARE for t in python_tids if t in shares):
                tr.look.worked, tr.look.work_at = True, now
            if tr.look.at:
                tr.quiet.note(python_tids, last_slices, tr.look.slices, elapsed)
            active = tr.gpu.active_at()
            if active is not None and active > tr.dump.last_change and elapsed > 0:
                # its own GPU moved data since the last change: progress (below), no dump needed
                tr.look.worked = True
            tr.look.record(now, threads, spinning, shares, self.cycle.task_count(p.pid), glance is not None)
            tr.look.busiest_worker = tr.workers.busiest(p.workers, elapsed)
            tr.look.summary = summarize_threads(threads, spinning)
            total = self.cycle.task_count(p.pid)
            if total > len(threads):
                tr.look.summary += f" (first {len(threads)} of {total} read)"
        else:
            threads, spinning, shares = tr.look.threads, tr.look.spinning, tr.look.shares
        busiest_worker = tr.look.busiest_worker
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
            method, tr.look.worked = "heartbeat", False
            progress = max(
                hb_mtime if hb_mtime is not None else tr.first_seen,
                tr.look.work_at,
                tr.gpu.active_at() or float("-inf"),
            )
            stalled_so_far = now - progress > self.after
        else:
            method, progress = self.pacing.progress(now, p, tr, threads, spinning, look_due)
            # a GPU that only its job uses and that moves data is doing the job's work
            active = tr.gpu.active_at()
            if active is not None and active > progress:
                progress = active
            # two identical dumps at least after_seconds apart, with every /proc look between them
            # unchanged (a look that changes dumps again): the same place the whole time
            stalled_so_far = (
                tr.dump.identical >= 1
                and now - progress >= self.after
                and (tr.dump.last_at - tr.dump.last_change >= self.after)
            )
        # proven still this long: the heartbeat's age, or the span of the last comparison that
        # found the same stacks (a dump or a proof, join/stall_pacing.py ``DumpPacing.progress``)
        if p.heartbeat:
            still = now - progress
        else:
            still = min(now - progress, tr.dump.last_at - tr.dump.last_change) if tr.dump.identical >= 1 else 0.0
        stopped_for = now - tr.stopped_since if tr.stopped_since is not None else None
        if stopped_for is not None and tr.stopped_since is not None and stopped_for >= self.after:
            method, stalled_so_far = "stopped", True
            progress = min(progress, tr.stopped_since)
        held = still >= self.conclusive and not stalled_so_far
        # one thread held the GIL at the same line in every dump for the conclusive bound
        gil_held = tr.gil.key is not None and tr.dump.stacks_at - tr.gil.since >= self.conclusive
        late = (
            bool(p.heartbeat)
            and not stalled_so_far
            and now - progress > min(self.after / 2, self.conclusive - self.dump_interval)
        )
        if (stalled_so_far or late) and now - tr.dump.last_at >= self.dump_interval and p.heartbeat:
            # the stuck frames for the explanation (heartbeat ranks are not dumped otherwise)
            stacks, _ = self.cycle.dump(now, p.pid)
            if stacks is not None:
                tr.dump.took(stacks, now)
                tr.gil.note(stacks, now)
        tr.words.update(tr.dump.stacks)
        # a dump from before a stop is not where the rank stopped (the H100: "stuck in" its imports)
        frames = tr.words.frames if tr.dump.stacks_at >= (tr.stopped_since or 0.0) else ()
        analysis = None
        compiling = False
        spin = (
            spinning_python(tr.dump.stacks, spinning)
            if (stalled_so_far or held) and spinning and method in ("stack", "proc")
            else frozenset()
        )
        if (stalled_so_far or late or held or gil_held) and tr.dump.stacks:
            analysis = tr.hang.analysis
            if analysis is None or tr.hang.stale(
                tr.dump.stacks, tr.look.at, tr.quiet.kept, bool(p.workers), tr.view.at_look
            ):
                # at the look cadence: its inputs are the last dump's stacks and the last look's
                # threads, and a stalled rank's analysis every cycle was most of what 64 such
                # ranks cost (the syscall of each waiting thread, each thread classified)
                waits = self.looks.waits(p.pid, wait_tids(tr.dump.stacks, threads))
                workers = tr.workers.view(self.looks.context_switches, p.workers)
                analysis = analyze(tr.dump.stacks, threads, shares, waits, workers, busiest_worker)
                tr.hang.keep(analysis, tr.dump.stacks, tr.look.at, tr.view.at_look, now)
            # The compiler's CPU moves between short-lived children (g++, Triton workers) and
            # the rank itself, and a dump may catch it in C code without a Python frame: within
            # after_seconds of a busy compiling look, it is still compiling unless it now shows
            # another hang (a lock, a collective, the GPU, a starved queue).
            other = {"deadlock", "lock_wait", "collective", "gpu_wait", "starved"}
            if (
                stalled_so_far
                and now - tr.hang.compile_busy_at <= self.after
                and not other & set(analysis.kinds)
                and method != "stopped"
            ):
                compiling = True
                stalled_so_far = now - progress > self.compile_after
                method = "compiling"
        ambiguous, confirmed_by, gpu_words, conclusive = False, "", "", ""
        # a conclusive shape of its own (the stacks dumped since its last heartbeat, for a rank
        # with one): stalled at the conclusive bound, and whatever its threads burn
        own = (
            analysis is not None
            and not compiling
            and method != "stopped"
            and (not p.heartbeat or tr.dump.stacks_at >= progress)
        )
        if own and (stalled_so_far or held) and analysis is not None and "deadlock" in analysis.kinds:
            stalled_so_far, conclusive = True, "deadlock" if held else ""
        elif own and gil_held and analysis is not None and gil_holder(analysis):
            conclusive = "" if stalled_so_far else "gil"
            stalled_so_far, spin, progress = True, frozenset(), min(progress, tr.gil.since)
            still = max(still, tr.dump.stacks_at - tr.gil.since)
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
        if held and not stalled_so_far:  # what it lacks, at DEBUG
            log_held(p.pid, still, spinning, spin, gpu_words, tr.gpu, progress, now, self.conclusive)
        return StallVerdict(
            job_id=p.job_id, rank=p.rank, pid=p.pid, alive=True, progress_timestamp=progress,
            stalled=stalled_so_far, method=method, no_progress_seconds=max(0.0, now - progress),
            stuck_frames=frames, threads_summary=tr.look.summary,
            location=tr.words.location, analysis=analysis, compiling=compiling,
            ambiguous=ambiguous, confirmed_by=confirmed_by, gpu_evidence=gpu_words,
            unchanged=(tr.dump.stacks_at, tr.dump.proven_at) if tr.dump.proven_at is not None and method == "stack"
            else None,
            unchanged_quiet_ms=tr.quiet.run_ns / 1e6 if tr.dump.proven_at is not None and tr.quiet.proof
            and method == "stack" else None,
            still_seconds=max(0.0, still), stopped_seconds=stopped_for, conclusive=conclusive,
            doing=self._doing(now, p, tr, progress, shares, stalled_so_far or ambiguous),
            watch=self._watch(now, p, tr, age),
        )  # fmt: skip

    def _glance(self, now: float, p: RankProbe, tr: RankTrack,
                ) -> tuple[dict[int, tuple[int, int]], dict[int, float], int | None] | None:  # fmt: skip
        """A look cut to the Python threads of a heartbeat-less rank that was working at its last
        look or glance: their schedstat (run, wait), one read each, their share of the window
        since then (its runnable share, as a look's for a thread in the working band), and the
        rank's number of tasks (one ``/proc/PID/stat``). Where a Python thread still works and
        no task came or went, the glance stands for the look (``StallTracker._observe_one``);
        else the look follows at once, with these shares for the Python threads, and the next
        look a cycle after it, which gives every thread a share over a window after the work
        stopped. A look reads every task (measured on the 2-core VM: 0.73 ms for a 48-thread
        rank, a glance 0.02 ms; at 64 such ranks working, the looks at the look cadence were
        most of what the heartbeat-less path cost beyond the heartbeat path). A native thread
        or a spinner beside working Python threads is no hang; once they stop, the two looks
        see it: a thread that starts burning a core (the GIL fault of NVIDIA's catalog starts a
        new one) is seen at most a cycle later than by looks at the look cadence, and a new
        thread earlier (its look comes at the first glance after it started). None where a
        glance cannot stand in: no look yet, not working at the last one, a dump without thread
        ids (Python 3.10), a Python thread with no reading to compare, more Python threads than
        ``max_threads`` (a look reads no more tasks than that, a glance no more). The Python threads are
        the last dump's (a rank dumped while CUDA's init burned a core at start-up has them
        all; those that did not work at the last look are compared by their run time) or, before
        any dump, the main thread."""
        if tr.look.at == 0.0 or tr.look.work_at < tr.look.last:
            return None
        tids = {s.tid or 0 for s in tr.dump.stacks} or {p.pid}
        if 0 in tids or len(tids) > self.max_threads:
            return None  # (past max_threads Python threads the look, which reads at most that many)
        readings: dict[int, tuple[int, int]] = {}
        shares: dict[int, float] = {}
        for tid in sorted(tids):
            got = self.looks.schedstat(p.pid, tid)
            if got is None:
                continue  # gone since the dump: no work of its own (the task count shows it went)
            base = tr.look.base(tid)
            if base is None or now <= base[0]:
                return None
            at, run, wait = base
            readings[tid] = got
            ran = got[0] - run + (got[1] - wait if wait is not None else 0)
            shares[tid] = min(1.0, max(0.0, ran / 1e9 / (now - at)))
        if not readings:
            return None
        return readings, shares, self.looks.thread_count(p.pid)

    def _watch(self, now: float, p: RankProbe, tr: RankTrack, age: float) -> str:
        """Why the job's own view (NCCL RAS) is worth asking about a rank that may be progressing:
        its heartbeat is late (past the bound where its threads are looked at: working or not, a
        rank that stopped beating may be one whose work is only local), or its last dump shows
        its main thread in a collective and no look since found its Python threads working (a
        rank waiting in one at every dump is at work only if its collectives complete). ""
        otherwise: a rank beating on time, or working since its last dump, costs no query."""
        if p.heartbeat and age > min(self.after / 2, self.conclusive / 3):
            return f"heartbeat late ({age:.0f} s)"
        if tr.words.collective and tr.dump.stacks and tr.look.work_at < tr.dump.stacks_at:
            return f"in {tr.words.collective} at its last dump"
        return ""

    def _doing(
        self, now: float, p: RankProbe, tr: RankTrack, progress: float, shares: dict[int, float], stuck: bool
    ) -> str:
        """What a rank that progresses does, in words (a waiting peer's page or its absence says
        it); "" for a rank with no progress seen within the conclusive bound."""
        if stuck or now - progress > self.conclusive + self.dump_interval:
            return ""
        if progress <= tr.first_seen and not p.heartbeat:
            return ""  # nothing seen move since first sight
        if p.heartbeat and tr.look.work_at < progress and (tr.gpu.active_at() or 0.0) < progress:
            return f"beats (last heartbeat {now - progress:.0f} s ago)"
        active = tr.gpu.active_at()
        if active is not None and now - active <= self.dump_interval:
            return "moves data on its GPU"
        busiest = max(shares.values(), default=0.0)
        if busiest >= WORK_SHARE:
            return f"works on its CPU ({min(busiest, 1.0):.0%} of a core)"
        return "moved its Python stack since the last dump"
