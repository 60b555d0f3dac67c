"""The dump pacing of a rank whose Python thread burns a core or holds the GIL
(join/stall_pacing.py ``DumpPacing.progress``), driven with a recorded state and a Looker that
counts py-spy runs: when the dumps a conclusive GIL verdict needs are taken, at the shipped
bounds (after_seconds 300, conclusive_seconds 40, a dump interval of 13.3 s). The scenario is the
device's GIL fault of NVIDIA's catalog, from its pacing log (docs/runbooks.md)."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

from gpuwatchd.join.cycle_looks import CycleLooks
from gpuwatchd.join.stall_pacing import DumpPacing
from gpuwatchd.join.stall_track import LastDump, RankTrack
from gpuwatchd.model.stall import RankProbe
from gpuwatchd.model.threads import Dump, Frame, SyscallWait, ThreadInfo, ThreadStack

AFTER, CONCLUSIVE, INTERVAL = 300.0, 40.0, 40.0 / 3
MAIN, HOLDER = 100, 101
STACKS = (
    ThreadStack(MAIN, MAIN, "MainThread", False, False, (Frame("main", "fault_rank.py", 158),)),
    ThreadStack(HOLDER, HOLDER, "Thread-1", True, True, (Frame("_hold_gil", "fault_rank.py", 83),)),
)
THREADS = (
    ThreadInfo(MAIN, MAIN, "python", "S", "futex_wait_queue", 10, 5, 0),  # waits for the GIL
    ThreadInfo(HOLDER, HOLDER, "python", "R", "", 900, 0, 40),  # burns a core in the regex
)


class Host:
    """A Looker whose py-spy dumps always show the GIL held at the same line; counts them."""

    clk_tck = 100
    can_dump = True

    def __init__(self) -> None:
        self.dumps: list[float] = []
        self.now = 0.0

    def dump(self, pid: int) -> Dump:
        self.dumps.append(self.now)
        return Dump(STACKS)

    def run_slices(self, pid: int, max_tasks: int) -> dict[int, tuple[int, int]] | None:
        return None

    def heartbeat_mtime(self, path: str, owner_uid: int | None = None) -> float | None:
        return None

    def task_ids(self, pid: int) -> list[int]:
        return [MAIN, HOLDER]

    def threads_since(
        self, pid: int, tids: Sequence[int], prev: Mapping[int, tuple[tuple[int, int], ThreadInfo]]
    ) -> tuple[tuple[ThreadInfo, ...], dict[int, tuple[int, int]]]:
        return THREADS, {}

    def schedstat(self, pid: int, tid: int) -> tuple[int, int] | None:
        return None

    def waits(self, pid: int, tids: Iterable[int]) -> Mapping[int, SyscallWait]:
        return {}

    def context_switches(self, pid: int) -> int | None:
        return None

    def thread_count(self, pid: int) -> int | None:
        return 2


def _pacing(host: Host) -> tuple[DumpPacing, CycleLooks]:
    cycle = CycleLooks(host, budget=1.0, max_threads=64, dump_interval=INTERVAL)
    return DumpPacing(AFTER, CONCLUSIVE, INTERVAL, 60.0, host, cycle, collections.Counter()), cycle


def _cycles(host: Host, pacing: DumpPacing, cycle: CycleLooks, tr: RankTrack, start: float, end: float) -> None:
    """One progress a second from ``start`` to ``end`` (no new look: the last one's view)."""
    probe = RankProbe("j", 1, MAIN, True, "S")
    t = start
    while t <= end:
        host.now = t
        cycle.begin()
        pacing.progress(t, probe, tr, THREADS, frozenset({HOLDER}), looked=False)
        t += 1.0


def test_a_thread_that_starts_burning_is_dumped_though_a_look_found_work_since_the_last_dump() -> None:
    """The last look found the rank working a second ago (a look is no dump): the thread that
    burns a core now is dumped at once, not a dump interval after that look."""
    host = Host()
    pacing, cycle = _pacing(host)
    working = STACKS[:1]  # the last dump, at start-up: the main thread only
    tr = RankTrack(MAIN, None, 0.0, LastDump(last_change=49.0, fingerprint=("start-up",), last_at=49.0))
    tr.dump.stacks, tr.dump.stacks_at = working, 5.0
    tr.look.count = 9
    _cycles(host, pacing, cycle, tr, 50.0, 50.0)
    assert host.dumps == [50.0]
    assert tr.gil.key is not None and tr.gil.since == 50.0


def test_a_gil_holders_proving_dump_is_due_a_conclusive_bound_after_the_first_that_showed_it() -> None:
    """The first dump that showed the holder was at 100 s, the last change of view at 95 s (the
    look before it): no dump at 135 s (the bound of that change, 5 s short of the hold), whose
    comparison put the next a dump interval on (the device: paged 64.7 s after the fault); the
    dump at 140 s proves the hold."""
    host = Host()
    pacing, cycle = _pacing(host)
    tr = RankTrack(MAIN, None, 0.0, LastDump(last_change=95.0, fingerprint=("before",), last_at=100.0))
    tr.dump.stacks, tr.dump.stacks_at, tr.dump.spin_dumped = STACKS, 100.0, True
    tr.look.count = 9
    tr.gil.note(STACKS, 100.0)
    _cycles(host, pacing, cycle, tr, 101.0, 160.0)
    assert host.dumps[:1] == [140.0], host.dumps
    assert tr.gil.since == 100.0 and tr.dump.stacks_at - tr.gil.since >= CONCLUSIVE
