"""One cycle's looks at the ranks' processes, for the stall tracker (join/stall.py): each PID read
once however many ranks list it, new looks only within the cycle's time budget, and py-spy paused
for a dump interval after a dump timed out.

The tracker decides which looks are due; the ``Looker`` (sources/stall_looks.py) reads the host;
this holds what one ``StallTracker.observe`` shares across its ranks (per-PID memos, the deadline)
and the dump pause, which outlives a cycle. It reads nothing itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gpuwatchd.model.threads import Dump, SyscallWait, ThreadInfo, ThreadStack

log = logging.getLogger(__name__)

Slices = dict[int, tuple[int, int]]  # tid -> schedstat (run ns, run slices)


class Looker(Protocol):
    """The host reads a look performs (sources/stall_looks.py ``StallLooks``)."""

    clk_tck: int  # clock ticks per second of ThreadInfo.cpu_ticks

    @property
    def can_dump(self) -> bool: ...  # py-spy is there to ask
    def heartbeat_mtime(self, path: str, owner_uid: int | None = None) -> float | None: ...
    def dump(self, pid: int) -> Dump: ...
    def task_ids(self, pid: int) -> list[int]: ...
    def threads_since(
        self,
        pid: int,
        tids: Sequence[int],
        prev: Mapping[int, tuple[tuple[int, int], ThreadInfo]],
    ) -> tuple[tuple[ThreadInfo, ...], dict[int, tuple[int, int]]]: ...
    def run_slices(self, pid: int, max_tasks: int) -> dict[int, tuple[int, int]] | None: ...
    def schedstat(self, pid: int, tid: int) -> tuple[int, int] | None: ...
    def waits(self, pid: int, tids: Iterable[int]) -> Mapping[int, SyscallWait]: ...
    def context_switches(self, pid: int) -> int | None: ...
    def thread_count(self, pid: int) -> int | None: ...


class CycleLooks:
    """``begin`` before a cycle's looks, ``end`` after them; not thread-safe (one caller)."""

    def __init__(self, looker: Looker, *, budget: float, max_threads: int, dump_interval: float) -> None:
        self.looker = looker
        self.budget = budget
        self.max_threads = max_threads
        self.dump_interval = dump_interval
        self._dumps_disabled_until = float("-inf")
        self._threads: dict[int, tuple[ThreadInfo, ...]] = {}
        self._dumps: dict[int, tuple[tuple[ThreadStack, ...] | None, bool]] = {}
        self._dump_slices: dict[int, Slices | None] = {}  # read right before this cycle's dump
        self._look_slices: dict[int, Slices] = {}  # of this cycle's look
        self._task_count: dict[int, int] = {}
        self._deadline = float("inf")

    def begin(self) -> None:
        self.end()
        self._deadline = time.monotonic() + self.budget

    def end(self) -> None:
        for memo in (self._threads, self._dumps, self._dump_slices, self._look_slices, self._task_count):
            memo.clear()

    @property
    def can_dump(self) -> bool:
        return self.looker.can_dump

    def over_budget(self, pid: int) -> bool:
        """True when a new (not memoised) look at ``pid`` would exceed this cycle's budget. The
        first look of a cycle always goes ahead, so every rank is looked at within (ranks needing
        a look) cycles whatever the budget."""
        return bool(self._threads) and pid not in self._threads and time.monotonic() > self._deadline

    def dump_over_budget(self, pid: int) -> bool:
        """The same for a dump: the first dump of a cycle always goes ahead."""
        return bool(self._dumps) and pid not in self._dumps and time.monotonic() > self._deadline

    def threads(self, pid: int, prev: Mapping[int, tuple[tuple[int, int], ThreadInfo]],
                ) -> tuple[tuple[ThreadInfo, ...], Slices]:  # fmt: skip
        """The first ``max_threads`` tasks of ``pid`` and their schedstat, read once a cycle
        (``prev``: the last look's, so that a task that did not run is not read again)."""
        memo = self._threads.get(pid)
        if memo is None:
            tids = self.looker.task_ids(pid)
            self._task_count[pid] = len(tids)
            memo, self._look_slices[pid] = self.looker.threads_since(pid, tids[: self.max_threads], prev)
            self._threads[pid] = memo
        return memo, self._look_slices.get(pid, {})

    def task_count(self, pid: int) -> int:
        return self._task_count.get(pid, 0)

    def run_slices(self, pid: int) -> Slices | None:
        """Every task's (run ns, run slices), None past ``max_threads`` tasks; from this cycle's
        look when it read every task (a look comes before the cycle's dumps and comparisons)."""
        looked = self._look_slices.get(pid)
        if looked is not None and len(looked) == self._task_count.get(pid, -1) <= self.max_threads:
            return looked
        return self.looker.run_slices(pid, self.max_threads)

    def slices_before_dump(self, pid: int) -> Slices | None:
        return self._dump_slices.get(pid)

    def dump_tried(self, pid: int) -> bool:
        """Whether this cycle ran py-spy on ``pid`` (not when dumps pause after a time-out)."""
        return pid in self._dumps

    def dump(self, now: float, pid: int) -> tuple[tuple[ThreadStack, ...] | None, bool]:
        """(a non-blocking dump or None, whether py-spy cannot help with this rank at all).

        Never waits for a py-spy slot (the GIL sampler may hold them): a busy slot is "no dump
        this time". After a time-out, dumps pause for one interval so that a hung py-spy cannot
        hold every cycle for ``dump_timeout`` per rank."""
        if not self.looker.can_dump:
            return None, True
        if now < self._dumps_disabled_until:
            return None, False
        memo = self._dumps.get(pid)
        if memo is not None:
            return memo
        # read before the dump, so that the same numbers later prove nothing ran since its stacks
        self._dump_slices[pid] = self.run_slices(pid)
        dump = self.looker.dump(pid)
        out: tuple[tuple[ThreadStack, ...] | None, bool] = (dump.stacks, False)
        if dump.error:
            if dump.timed_out:
                self._dumps_disabled_until = now + self.dump_interval
            log.debug("stall dump of pid %d failed: %s", pid, dump.error)
            out = None, dump.hopeless
        self._dumps[pid] = out
        return out
