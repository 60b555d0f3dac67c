"""The stall tracker's dump pacing: when a rank without heartbeat is dumped (py-spy) and what the
comparison of this look and dump with the last ones proves (join/stall.py turns that into its
verdict; the reads are the cycle's, join/cycle_looks.py).

Cost: one dump (~10 ms) when the rank's /proc view (each Python thread's state, wchan, burning a
core or not) changed and settled (at the old pace, after_seconds/5, for a rank whose Python
threads are awake), else once per after_seconds, or at the conclusive bound for a rank asleep or
burning a core, where a conclusive shape can be (measured: the dumps were what a heartbeat-less
rank cost beside a beating one); none while no task ran since the last dump (the same tasks with
the same schedstat run time and slice count prove its stacks still hold); none at first sight
(the first dump waits for the second look, which knows each thread's CPU share: a node's ranks
are not all dumped when the daemon or a job starts); for a rank quiet since first sight
(QUIET_SHARE, join/stall_track.py: asleep at the same place at every look, its main thread waking
without working) none before a dump interval ahead of the comparison, and for a stalled one quiet
since its last dump none before QUIET_REDUMP x after_seconds; and none while its Python threads
work in the working band or its own GPU moves data (that is progress already). A dump over the
cycle's budget is deferred to the next cycle and counted (``deferred["dump"]``). Pure given the
cycle's looks; the pacing of each rank is logged at DEBUG ("stall pacing"). Shell equivalent:
``py-spy dump -p PID`` when ``cat /proc/PID/task/*/{stat,wchan,schedstat}`` changed and held.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from gpuwatchd.join.cycle_looks import CycleLooks, Looker
from gpuwatchd.join.stall_spin import new_spinners, spinning_python
from gpuwatchd.join.stall_track import RankTrack
from gpuwatchd.model.stall import RankProbe
from gpuwatchd.model.threads import ThreadInfo, ThreadStack

log = logging.getLogger(__name__)

# A stalled rank quiet since its last dump (QUIET_SHARE) is not dumped again before this many
# after_seconds: the dump still stands, re-checked that often (measured: 64 ranks asleep at one
# line were dumped once per after_seconds, 2.7 x the cost of the same ranks beating).
QUIET_REDUMP = 6
# A rank whose first dumps fail for a passing reason (busy slots, a time-out) is tried this many
# times before its /proc view is compared instead (py-spy never reads some processes in time).
MAX_DUMP_MISSES = 4


class DumpPacing:
    """The dump cadence of ``StallTracker`` (join/stall.py), which builds it with its bounds and
    shares its cycle's looks and its ``deferred`` counter."""

    def __init__(
        self,
        after: float,
        conclusive: float,
        dump_interval: float,
        redump_interval: float,
        looks: Looker,
        cycle: CycleLooks,
        deferred: collections.Counter[str],
    ) -> None:
        self.after = after
        self.conclusive = conclusive
        self.dump_interval = dump_interval  # the look cadence before the conclusive bound
        self.redump_interval = redump_interval  # an awake rank whose view changed, at most this often
        self.looks = looks
        self.cycle = cycle
        self.deferred = deferred

    def progress(
        self, now: float, p: RankProbe, tr: RankTrack, threads: tuple[ThreadInfo, ...],
        spinning: frozenset[int], looked: bool = True,
    ) -> tuple[str, float]:  # fmt: skip
        """Compare this look with the last one, dumping when due; returns (method, last change
        time). ``looked``: a look was made this cycle (``threads``, ``spinning`` are its)."""

        # The view of the Python threads of the last dump (all tasks when it gave no tids, or
        # before the first): native helper threads (CUDA, NCCL, gloo) wake on their own, and a view
        # with them in it rarely holds for two looks (the device run: 20-thread torch ranks).
        # Computed only where used (a look, a dump): most cycles of most ranks use neither.
        def view() -> Any:
            python_tids = {s.tid for s in tr.dump.stacks if s.tid}
            if not python_tids or any(not s.tid for s in tr.dump.stacks):
                python_tids = {t.tid for t in threads}
            return tuple((t.tid, t.state, t.wchan, t.tid in spinning) for t in threads
                         if t.tid in python_tids)  # fmt: skip

        before_second_look = tr.dump.fingerprint is None and tr.look.count < 2
        never = tr.dump.fingerprint is None and tr.dump.last_at == float("-inf")  # no dump, no work
        if looked:
            proc_fp = view()
            main_fp = tuple(v for v in proc_fp if v[0] == p.pid)
            if (
                tr.dump.fingerprint is None
                and tr.view.at_look is not None
                and main_fp != tuple(v for v in tr.view.at_look if v[0] == p.pid)
            ):
                tr.dump.last_change = now  # its main thread moved between the looks before its first dump
            if never:
                # before the first dump only the main thread's view counts, against the one at
                # first sight (native helper threads wake on their own)
                tr.view.at_dump = main_fp if tr.view.at_dump is None else tr.view.at_dump
                tr.quiet.kept = tr.quiet.kept and main_fp == tr.view.at_dump
            else:
                tr.quiet.kept = tr.quiet.kept and proc_fp == tr.view.at_dump
                # a view that differs from the one at the last dump and held for one look: the
                # rank has moved and settled (a dump in the middle of a move would see neither place)
                if proc_fp != tr.view.at_dump and proc_fp == tr.view.at_look:
                    tr.view.dump_due = True
            if proc_fp != tr.view.at_look:
                tr.view.since = now
            tr.view.at_look = proc_fp
        if before_second_look and self.looks.can_dump:
            # No dump at first sight (measured: a node's ranks were all dumped at once when the
            # daemon or a job started): the next look, a dump interval on, knows each thread's
            # CPU share, and a rank that works needs no dump at all. The stall bound is unchanged:
            # the second dump is due after_seconds after the first look.
            return "proc", tr.dump.last_change
        if tr.look.worked:
            # Python threads used CPU in the working band since the last look, or its own GPU
            # moved data: that is progress whatever a stack dump would show, so spare the target
            # and ourselves the py-spy run.
            tr.look.worked = False
            tr.dump.identical = 0
            tr.dump.last_change = now
            tr.dump.last_at = now  # this look counts as the comparison: next one a dump interval on
            # a burn seen after this work is a new one, dumped a dump interval on (a dump while
            # it started up, CUDA's init at 100 % of a core, left it set through the training)
            tr.dump.spin_dumped = False
            tr.view.at_dump, tr.view.dump_due, tr.dump.proven_at = view(), False, None
            tr.quiet.restart()
            tr.hang.view = None
            return ("stack" if tr.dump.stacks else "proc"), now
        # The dump cadence (measured: the dumps were what a rank without heartbeat cost beside one
        # with). A /proc view (each thread's state, wchan, burning a core or not) that changed
        # since the last dump and held for a look is dumped at once: a hang usually starts with
        # such a change. Otherwise the next dump comes after_seconds after the last change of
        # stack (the one that can make a stall), and for a rank already stalled after_seconds
        # after the last dump. A stall is two identical dumps after_seconds apart with no settled
        # change of view between them: a hang is seen after_seconds after the first look that
        # shows it settled, plus a look or two.
        stalled = tr.dump.identical >= 1 and tr.dump.last_at - tr.dump.last_change >= self.after
        # proven still for the conclusive bound: the next comparison is the after_seconds one
        held = tr.dump.identical >= 1 and tr.dump.last_at - tr.dump.last_change >= self.conclusive
        # both spinner walks are empty with nothing spinning: skipped then (they ran every cycle
        # of every heartbeat-less rank, 0.7 ms a cycle at 64 ranks on the 2-core VM)
        burning = spinning_python(tr.dump.stacks, spinning) if spinning else frozenset()
        # Only where a conclusive shape can be are comparisons due at look pace: its Python
        # threads asleep at the last look (a lock, a collective: the schedstat proof usually
        # spares the dump) or one burning a core (a GPU spin, the GIL). A rank awake at changing
        # places keeps the pace of after_seconds (at the shipped defaults, a dump every
        # conclusive bound of a rank at 1 % CPU whose stacks move was 23 dumps in 900 s, not 3).
        settled = bool(burning) or not any(v[1] == "R" for v in tr.view.at_look or ())
        changed_at = now
        if tr.view.dump_due and tr.view.since > tr.dump.last_change:
            # the view changed at a look and held at the next: the new place dates from the first
            changed_at = tr.view.since
        if not self.looks.can_dump:
            due = tr.dump.last_at + self.dump_interval  # (without py-spy the view is the comparison)
        elif tr.view.dump_due:
            due = tr.dump.last_at + (self.dump_interval if settled else self.redump_interval)
        elif never:
            # The first dump is due at once, unless the rank has been quiet since first sight:
            # then it is the first of the two a stall needs, a dump interval before the second.
            due = tr.dump.last_change + self.conclusive - self.dump_interval if tr.quiet.kept else now
        elif stalled:
            due = tr.dump.last_at + max(self.dump_interval, self.after)
        else:
            bound = self.conclusive if settled and not held else self.after
            due = max(tr.dump.last_at + self.dump_interval, tr.dump.last_change + bound)
        # A Python thread that starts burning a core is dumped at once (a dump interval after the
        # last dump: a look that found work since is no dump, and waiting on it put the GIL and
        # GPU_SLEEP faults of the catalog a dump interval later, 65 s from the fault at the
        # shipped defaults), and one seen holding the GIL again a conclusive bound after: the
        # GIL shape needs two dumps that far apart, and the main thread that polls for the GIL
        # every 5 ms makes the view flicker (no settled change to dump on)
        if not burning:
            tr.dump.spin_dumped = False
        elif not tr.dump.spin_dumped:
            due = min(due, tr.dump.stacks_at + self.dump_interval)
        # A thread burning a core that the last dump did not show is dumped the same way: the
        # view holds only that dump's Python threads, and the main thread waiting for a GIL the
        # new thread keeps flickers between R and S (no settled change). Undumped, the GIL fault
        # of the catalog was first dumped after_seconds after the last change (the device: paged
        # 61.6 s after the fault at after_seconds 30, not within the conclusive bound).
        fresh = new_spinners(tr.dump.stacks, spinning, tr.dump.spin_native) if spinning else frozenset()
        if fresh:
            due = min(due, tr.dump.stacks_at + self.dump_interval)
        if tr.gil.key is not None:
            # A thread held the GIL at the last dump: the next dump is the one a conclusive bound
            # after the first that showed it, neither sooner (a dump at the bound of the last
            # change of view, a look before that first one, found the hold 5 s short and put the
            # proving dump a dump interval on: the GIL fault paged 65 s after it at the shipped
            # defaults) nor later. A release before then is seen by that dump, as by any other.
            due = max(tr.dump.last_at + self.dump_interval, tr.gil.since + self.conclusive)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "stall pacing: pid %d due in %.1f s (identical %d, settled %s, burning %s, "
                "new spinners %s, gil held since %.1f s, dump_due %s, last change %.1f s ago)",
                p.pid,
                due - now,
                tr.dump.identical,
                settled,
                sorted(burning),
                sorted(fresh),
                now - tr.gil.since if tr.gil.key is not None else -1.0,
                tr.view.dump_due,
                now - tr.dump.last_change,
            )
        if now < due:
            return ("stack" if tr.dump.stacks else "proc"), tr.dump.last_change
        if self.cycle.dump_over_budget(p.pid):
            self.deferred["dump"] += 1
            return ("stack" if tr.dump.stacks else "proc"), tr.dump.last_change
        asleep = bool(tr.dump.stacks) and not any(t.state == "R" for t in threads)
        if asleep and tr.dump.slices is not None and self.cycle.run_slices(p.pid) == tr.dump.slices:
            # The same tasks, none ran since the last dump (schedstat's numbers grow while a task
            # runs; one on a CPU throughout, which a tickless CPU may not count, reads R): a Python
            # stack changes only when its thread runs, so the stacks are that dump's. A rank
            # blocked at 0 % CPU is dumped once per episode (the dumps were its cost).
            stacks: tuple[ThreadStack, ...] | None = tr.dump.stacks
            hopeless, proven, tr.quiet.proof = False, True, False
        elif asleep and held and tr.quiet.kept and now - tr.dump.stacks_at < QUIET_REDUMP * self.after:
            # Stalled, and its Python threads quiet at every look since the dump (QUIET_SHARE):
            # that dump still stands, re-checked by a dump every QUIET_REDUMP x after_seconds.
            stacks, hopeless, proven, tr.quiet.proof = tr.dump.stacks, False, True, True
        else:
            stacks, hopeless = self.cycle.dump(now, p.pid)
            proven = False
        if stacks is None and not hopeless and (tr.dump.stacks or tr.dump.misses < MAX_DUMP_MISSES):
            # busy slots / timed out (then dumps pause an interval) / odd output this time: try
            # again, change nothing. A rank not yet dumped is tried MAX_DUMP_MISSES times (the
            # cycles of a pause not counted) before its /proc view stands in for its stacks: a
            # failed first dump taken as the comparison made the next, real one a change, and
            # the stall a second after_seconds late.
            if self.cycle.dump_tried(p.pid):
                tr.dump.misses += 1
            return ("stack" if tr.dump.stacks else "proc"), tr.dump.last_change
        tr.dump.misses = 0
        by_tid = {t.tid: t for t in threads}
        tr.view.at_dump, tr.view.dump_due = view(), False
        if stacks:
            if not proven:
                tr.dump.slices = self.cycle.slices_before_dump(p.pid)
                tr.dump.stacks_at = now
                tr.quiet.restart()
                tr.gil.note(stacks, now)
                tr.dump.spin_dumped = bool(burning)
                tr.dump.spin_native = spinning - {s.tid for s in stacks if s.tid}
            tr.dump.proven_at = now if proven else None
            tr.dump.stacks, tr.dump.last_at = stacks, now
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
            tr.dump.last_at = now
            method = "proc"
            fp = tuple((t.tid, t.state, t.wchan, t.tid in spinning) for t in threads)
        if fp != tr.dump.fingerprint or tr.look.worked:
            if tr.dump.fingerprint is not None:
                tr.dump.last_change = changed_at
            tr.look.worked = False
            tr.dump.fingerprint, tr.dump.identical = fp, 0
        else:
            tr.dump.identical += 1
        return method, tr.dump.last_change
