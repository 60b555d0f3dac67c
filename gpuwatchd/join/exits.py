"""Rank exits joined with what the kernel said and ordered within their job: the cause of each
death, the first of a job to fail, and the ranks the launcher tore down after it.

Pure: given the exits the watcher read (sources/exits.py), the kernel's fault lines
(join/kernel_faults.py) and the recent OOM-kill and Xid events (join/kernel_events.py). ``ExitLedger``
keeps the exits of the last ``ACTIVE_SECONDS`` (and those of ranks still registered, which stay
dead), bounded by ``limit``; the findings read it each cycle (findings/rank_down.py,
findings/job_crashed.py), the event log gets one event per exit.

The verdict of a job's first failure (the earliest exit that is not exit 0):
- ``node``: an OOM killer named the PID or one of its workers, SIGBUS (a hardware memory error, a
  vanished mapping), or a critical Xid named it: the node ended it;
- ``killed``: SIGKILL that no OOM killer named, or a registered rank's status that could not be
  read: nothing in the process's own code ends it that way (a discovered rank's unread status is
  ``crashed``: it pages only when it leaves a peer waiting);
- ``stopped``: SIGTERM, SIGINT or SIGHUP: a stop request (the scheduler, a user, the launcher);
- ``crashed``: everything else that is not exit 0 (an exception's exit 1, SIGSEGV, SIGABRT ...);
- ``finished``: exit 0.
A later exit of the same job within ``TEARDOWN_SECONDS`` of the first failure is "torn down after
it" (torchrun SIGTERMs the other ranks at once and SIGKILLs them 30 s later).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from gpuwatchd.join.kernel_faults import KernelFaults
from gpuwatchd.model.events import Event
from gpuwatchd.model.exits import (
    CRASHED,
    EXIT_0,
    EXIT_NONZERO,
    FINISHED,
    KILLED,
    NODE,
    OOM_KILL,
    SIGNAL_CAUSES,
    SIGNAL_OTHER,
    STOPPED,
    UNKNOWN,
    RankExit,
)
from gpuwatchd.model.kernel import CRITICAL_XIDS
from gpuwatchd.units import fmt_bytes, fmt_clock_ms

ACTIVE_SECONDS = 600.0  # an exit is kept (and may be a finding) this long, or while registered
TEARDOWN_SECONDS = 60.0  # exits of a job this long after its first failure are its teardown
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
NODE_SIGNALS = ("SIGBUS",)
OOM_WINDOW = (-30.0, 2.0)  # an OOM-kill event this long before / after the exit names it
XID_WINDOW_SECONDS = 120.0  # a critical Xid naming the PID this long before its exit
REFRESH_SECONDS = 30.0  # kernel events this late still join an exit


def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def describe_status(status: int | None, unknown: str = "") -> tuple[str, str]:
    """(cause label, words) of a wait status: ("exit_nonzero", "exited with code 1"),
    ("SIGSEGV", "was killed by SIGSEGV (core dumped)"), ("unknown", "ended (cause unknown: ...)")."""
    if status is None:
        return UNKNOWN, f"ended (cause unknown: {unknown or 'not read'})"
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return (EXIT_0, "exited with code 0") if code == 0 else (EXIT_NONZERO, f"exited with code {code}")
    if os.WIFSIGNALED(status):
        name = signal_name(os.WTERMSIG(status))
        core = " (core dumped)" if os.WCOREDUMP(status) else ""
        return (name if name in SIGNAL_CAUSES else SIGNAL_OTHER), f"was killed by {name}{core}"
    return UNKNOWN, f"ended with wait status {status:#x}"


def _oom_event(pid: int, t: float, events: Iterable[Event]) -> Event | None:
    """The OOM kill of ``pid`` itself, else of a process of its tree (a DataLoader worker, whose
    death the rank then dies of: "DataLoader worker ... is killed by signal: Killed")."""
    worker = None
    for ev in events:
        if ev.kind != "oom_kill" or not OOM_WINDOW[0] <= ev.time - t <= OOM_WINDOW[1]:
            continue
        if ev.pid == pid:
            return ev
        if ev.worker and ev.fields.get("rank_pid") == pid:
            worker = ev
    return worker


def _xid_event(pid: int, t: float, events: Iterable[Event]) -> Event | None:
    for ev in events:
        if ev.kind == "xid" and ev.pid == pid and t - XID_WINDOW_SECONDS <= ev.time <= t + 2.0:
            return ev
    return None


def classify(x: RankExit, faults: KernelFaults | None, events: Sequence[Event]) -> RankExit:
    """``x`` with its cause, words, the kernel's words and the verdict of its own death."""
    cause, how = describe_status(x.status, x.unknown)
    kernel, verdict = "", FINISHED if cause == EXIT_0 else CRASHED
    if cause in STOP_SIGNALS:
        verdict = STOPPED
    elif cause in NODE_SIGNALS:
        verdict = NODE
    elif cause == "SIGKILL" or (cause == UNKNOWN and x.registered):
        verdict = KILLED  # an unread death of a registered rank pages, as it did before exits
    fault = faults.lookup(x.pid, x.time) if faults is not None else None
    if fault is not None:
        kernel = f"kernel: {fault.words}"
    oom = _oom_event(x.pid, x.time, events)
    if oom is not None:
        rss = oom.fields.get("rss_bytes")
        held = f" holding {fmt_bytes(rss)} RSS" if isinstance(rss, int) else ""
        by = "the kernel OOM killer" if oom.killer == "kernel" else oom.killer
        if oom.pid == x.pid:
            kernel, cause = f"killed by {by}{held}", OOM_KILL
        else:  # the rank ended of its worker's kill: its own status stays its cause
            kernel = f"its worker pid {oom.pid} ({oom.comm}) was killed by {by}{held} before it"
        verdict = NODE
    xid = _xid_event(x.pid, x.time, events)
    if xid is not None:
        n = xid.fields.get("xid")
        kernel = "; ".join(w for w in (kernel, f"Xid {n} on GPU {xid.fields.get('gpu', '') or '?'}") if w)
        if isinstance(n, int) and n in CRITICAL_XIDS:
            verdict = NODE
    return replace(
        x, cause=cause, how=how, kernel=kernel, verdict=verdict, oom_event=oom.key if oom is not None else ""
    )


def order(exits: Sequence[RankExit], started: Callable[[int], float] | None = None) -> list[RankExit]:
    """The exits of one job (any order) with their first failure named: the earliest exit that
    is not exit 0, and for each later one within TEARDOWN_SECONDS how long after it ended.
    ``started``: a process's start (its /proc start ticks) as a Unix time; an exit of a process
    that started after the first failure is no teardown of it but its launcher's restart of the
    job (torchrun --max-restarts), whose own failure is a first again."""
    ranked = sorted(exits, key=lambda x: (x.time, x.seq))
    first: RankExit | None = None
    out = []
    for x in ranked:
        if first is not None and x.time - first.time > TEARDOWN_SECONDS:
            first = None  # a failure of its own, long after the last one's teardown
        if first is not None and started is not None and x.start_ticks and started(x.start_ticks) > first.time:
            first = None  # a rank of the restarted job: not torn down after that failure
        if first is None and x.cause != EXIT_0:
            first = x
        if first is None:
            out.append(replace(x, first_rank=None, first_pid=None, after_seconds=None))
        else:
            out.append(
                replace(x, first_rank=first.rank, first_pid=first.pid, after_seconds=round(x.time - first.time, 3))
            )
    return out


def exit_words(x: RankExit) -> str:
    """The event's line: who, how and when, what the kernel said, and its place in the job."""
    who = f"rank {x.rank} of job {x.job_id} (pid {x.pid}, {x.comm})"
    text = f"{who} {x.how} at {fmt_clock_ms(x.time)}"
    if x.kernel:
        text += f"; {x.kernel}"
    if x.first:
        text += "; the first of its job to fail on this node"
    elif x.first_rank is not None and x.after_seconds is not None:
        text += (
            f"; {x.after_seconds:.3f} s after rank {x.first_rank} failed: "
            f"{'torn down by the launcher' if x.cause in ('SIGTERM', 'SIGKILL', 'SIGINT') else 'ended'} "
            "after it"
        )
    return text


class ExitLedger:
    """The recent exits, joined and ordered (see the module docstring). Thread-safe: the exit
    thread adds, the cycle reads."""

    def __init__(
        self, faults: KernelFaults | None = None, limit: int = 4096, started: Callable[[int], float] | None = None
    ) -> None:
        self.faults = faults
        self.limit = limit
        self.started = started  # start ticks -> Unix time (order's restarts)
        self._lock = threading.Lock()
        self._exits: list[RankExit] = []

    def add(self, new: Iterable[RankExit], events: Sequence[Event]) -> list[RankExit]:
        """Classify ``new`` and keep them; the new ones as ordered within their jobs."""
        with self._lock:
            have = {(x.pid, x.start_ticks) for x in self._exits}
            fresh = [classify(x, self.faults, events) for x in new if (x.pid, x.start_ticks) not in have]
            self._exits.extend(fresh)
            self._exits = self._exits[-self.limit :]
            self._reorder({x.job_id for x in fresh})
            keys = {(x.pid, x.start_ticks) for x in fresh}
            return [x for x in self._exits if (x.pid, x.start_ticks) in keys]

    def refresh(self, events: Sequence[Event], now: float) -> None:
        """Join the exits of the last REFRESH_SECONDS again with kernel events that arrived after
        the exit was read (the journal source's latency): bounded by the exits of that window."""
        with self._lock:
            old = self._exits
            self._exits = [
                classify(x, self.faults, events) if now - x.time <= REFRESH_SECONDS and x.verdict != NODE else x
                for x in old
            ]
            changed = {x.job_id for x, y in zip(old, self._exits, strict=False) if x != y}
            if changed:
                self._reorder(changed)

    def _reorder(self, jobs: set[str]) -> None:
        for job in jobs:
            mine = [x for x in self._exits if x.job_id == job]
            ordered = {(x.pid, x.start_ticks): x for x in order(mine, self.started)}
            self._exits = [ordered.get((x.pid, x.start_ticks), x) for x in self._exits]

    def prune(self, now: float, registered: set[tuple[str, int, int]]) -> None:
        """Drop exits older than ACTIVE_SECONDS, unless their rank is still registered."""
        with self._lock:
            self._exits = [
                x for x in self._exits if now - x.time <= ACTIVE_SECONDS or (x.job_id, x.rank, x.pid) in registered
            ]

    def recent(self) -> tuple[RankExit, ...]:
        with self._lock:
            return tuple(self._exits)
