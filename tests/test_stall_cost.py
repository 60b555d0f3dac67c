"""The cost shape of the job's view of a stall, per cycle: linear in a job's ranks.

``judge_jobs`` (join/stall_verdicts.py) ran ``v in list`` over a job's verdicts, which compares
frozen dataclasses field by field: 64 beating ranks of one job cost 2.3 ms a cycle on the 2-core
VM (bench/results/cycle_cost_64ranks_a7db82e_vs_head_2cpu_vm.txt). ``rank_gpu_readings``
(join/stall_spin.py) scanned every holder of a GPU for every rank on it. A heartbeat-less rank
that works was looked at in full (every task's schedstat, 0.73 ms for 48 threads) at the look
cadence; while its Python threads work, a glance at them stands for the look (join/stall.py
``StallTracker._glance``), and the look that follows a glance that finds no work judges them over
the glance's window, not since the last look.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import pytest

from gpuwatchd.join.stall import StallTracker
from gpuwatchd.join.stall_spin import rank_gpu_readings
from gpuwatchd.join.stall_verdicts import judge_jobs
from gpuwatchd.model import GpuDevice, GpuProcess, GpuProcessRow, RankState
from gpuwatchd.model.stall import RankProbe, StallVerdict
from gpuwatchd.model.threads import ThreadInfo
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.stall_looks import StallLooks

EQ_CALLS = [0]


class CountedVerdict(StallVerdict):
    """A verdict that counts its field-by-field comparisons."""

    def __eq__(self, other: object) -> bool:
        EQ_CALLS[0] += 1
        return super().__eq__(other)

    __hash__ = StallVerdict.__hash__


def _job(n: int, now: float, **kw: object) -> dict:
    vs = [
        CountedVerdict(
            "j", r, 100 + r, True, now - 1.0, False, "heartbeat", 1.0, doing="beats (last heartbeat 1 s ago)"
        )
        for r in range(n)
    ]
    vs = [replace(v, **kw) for v in vs] if kw else vs  # type: ignore[arg-type]
    return {v.key: v for v in vs}


def test_judge_jobs_compares_no_verdicts_field_by_field() -> None:
    """64 beating ranks of one job, then 64 still ones (held past the bound, a dead peer): the
    job's view is the same and no verdict is compared to another. Before: 2,016 comparisons for
    the beating job alone (each rank against the ones before it in ``progressing``)."""
    now = 1000.0
    beating = _job(64, now)
    EQ_CALLS[0] = 0
    out = judge_jobs(beating, now, 40.0, 53.0)
    assert EQ_CALLS[0] == 0
    assert all(out[k] is v for k, v in beating.items())  # nothing to say about a beating job
    still = _job(64, now, progress_timestamp=now - 100.0, still_seconds=100.0)
    dead_key = next(iter(still))
    still[dead_key] = replace(still[dead_key], alive=False)
    EQ_CALLS[0] = 0
    out = judge_jobs(still, now, 40.0, 53.0)
    assert EQ_CALLS[0] == 0
    assert [v.conclusive for k, v in out.items() if k != dead_key] == ["peer_down"] * 63


def test_rank_gpu_readings_exclusive_as_every_holder_of_the_rank_job() -> None:
    """Against the rule itself, on random nodes: a rank's GPUs are its job's alone when every
    process holding memory on them is a rank of that job."""
    rnd = random.Random(7)
    for _ in range(200):
        gpus = tuple(
            GpuDevice(i, f"GPU-{i}", "H100", str(i), 1, 1, rnd.random(), memory_utilization_ratio=rnd.random())
            for i in range(rnd.randint(1, 4))
        )
        ranks = tuple(
            RankState(
                rnd.choice("ab"),
                r,
                10 + r,
                r,
                8,
                True,
                None,
                gpus=(str(rnd.randrange(len(gpus))),) if rnd.random() < 0.3 else (),
            )
            for r in range(rnd.randint(1, 8))
        )
        rows = tuple(
            GpuProcessRow(g.index, g.uuid, r.pid, 1 << 30, "python", "u", r.job_id, str(r.rank))
            for r, g in itertools.product(ranks, gpus)
            if rnd.random() < 0.5
        )
        rows += tuple(
            GpuProcessRow(g.index, g.uuid, 900 + g.index, 1 << 30, "python", "u", "", "")
            for g in gpus
            if rnd.random() < 0.2
        )
        named = {r.rank_id: r.gpus for r in ranks}
        owner = {r.pid: r.rank_id for r in ranks}
        procs = tuple(GpuProcess(p.gpu_index, p.uuid, p.pid, p.used_memory_bytes) for p in rows)
        out = rank_gpu_readings(50.0, named, owner, gpus, procs)
        for r in ranks:
            mine = [
                g
                for g in gpus
                if any(p.gpu_index == g.index and (p.job_id, p.rank) == (r.job_id, str(r.rank)) for p in rows)
                or str(g.index) in r.gpus
            ]
            if not mine:
                assert r.rank_id not in out
                continue
            alone = all(p.job_id == r.job_id for g in mine for p in rows if p.gpu_index == g.index)
            assert out[r.rank_id].exclusive == alone, (r, rows)


# A rank of 21 threads whose main thread works a fifth of the time (10 ms of CPU, 40 ms asleep),
# after burning a core for argv[2] seconds (CUDA's init at start-up); a "t" on the pipe (its fd in
# argv[1]) starts one more thread, a "b" blocks it for good.
WORKER = """
import os, sys, threading, time
fd = int(sys.argv[1])
ev = threading.Event()
for _ in range(20):
    threading.Thread(target=ev.wait, daemon=True).start()
os.set_blocking(fd, False)
print("up", flush=True)
t = time.perf_counter()
while time.perf_counter() - t < float(sys.argv[2]):
    pass
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01:
        pass
    try:
        got = os.read(fd, 1)
    except BlockingIOError:
        got = b""
    if got == b"t":
        threading.Thread(target=ev.wait, daemon=True).start()
    elif got == b"b":
        break
    time.sleep(0.04)
os.set_blocking(fd, True)
os.read(fd, 1)
"""


class CountedLooks(StallLooks):
    """The daemon's looker, counting the looks that read every task."""

    def __init__(self, spy: PySpy | None = None) -> None:
        super().__init__(spy)
        self.full = 0
        self.schedstats = 0  # single-task schedstat reads (a glance's, and a look's of working threads)

    def threads_since(
        self,
        pid: int,
        tids: Sequence[int],
        prev: Mapping[int, tuple[tuple[int, int], ThreadInfo]],
    ) -> tuple[tuple[ThreadInfo, ...], dict[int, tuple[int, int]]]:
        self.full += 1
        return super().threads_since(pid, tids, prev)

    def schedstat(self, pid: int, tid: int) -> tuple[int, int] | None:
        self.schedstats += 1
        return super().schedstat(pid, tid)


@pytest.fixture
def worker(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], int]]:
    r, w = os.pipe()
    burn = str(getattr(request, "param", 0.0))  # seconds of start-up burn
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(r), burn],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(r,),
    )
    os.close(r)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        yield p, w
    finally:
        p.kill()
        p.wait()
        os.close(w)


def test_a_working_rank_is_glanced_at_and_looked_at_again_once_it_stops(
    worker: tuple[subprocess.Popen[str], int],
) -> None:
    """A look is due every 2 s, the cycle is 1 s. The first two looks read every task (the second
    finds the main thread working); then glances stand for the looks while it works. A new
    thread makes the glance a look at once; the rank blocks, and the glance after that finds no
    work: the look that follows reads every task and judges the main thread over the glance's
    window (no work after the block), and the next look comes a cycle later, not two. Before:
    a look of every task every 2 s, nine in 16 s; had the look after the glances compared since
    the last full one (five seconds, four of them at work), the rank would have worked at it."""
    p, w = worker
    looks = CountedLooks()
    tracker = StallTracker(60.0, looks, dump_interval_seconds=2.0, cycle_seconds=1.0, conclusive_seconds=60.0)
    probe = RankProbe("glance", 0, p.pid, True, "R", None)
    t0 = time.time()
    full = {0: 1, 2: 2, 8: 3, 13: 4, 14: 5, 16: 6}  # looks of every task by then (glances between)
    for k in range(17):
        time.sleep(max(0.0, t0 + k - time.time()))
        v = tracker.observe(t0 + k, [probe])[("glance", 0)]
        want = full.get(k, full[max(j for j in full if j <= k)])
        assert looks.full == want, (k, looks.full)
        assert not v.stalled
        if k in (4, 6, 9, 11):
            assert v.progress_timestamp == t0 + k, k  # the glance found it working
        if k in (13, 14, 16):
            assert "works on its CPU" not in v.doing, (k, v.doing)
        if k == 6:
            os.write(w, b"t")  # a new thread: the next glance is a look
        if k == 11:
            os.write(w, b"b")  # it blocks


@pytest.mark.parametrize("worker", [2.5], indirect=True)
def test_a_rank_dumped_at_start_up_is_glanced_at_with_every_python_thread(
    worker: tuple[subprocess.Popen[str], int],
) -> None:
    """The same rank burning a core for its first 2.5 s (CUDA's init): the look at 2 s sees the
    burn and py-spy dumps it, with its 21 Python threads; from the look at 4 s it works, and the
    glances at 6, 8 and 10 s read the 21 threads (those that did not work at the look compared by
    their run time). Before: the idle ones had no reading to compare, and a rank dumped at
    start-up was looked at in full at every look (six by 10 s)."""
    p, _ = worker
    looks = CountedLooks(PySpy(pyspy.resolve_pyspy()))
    tracker = StallTracker(60.0, looks, dump_interval_seconds=2.0, cycle_seconds=1.0, conclusive_seconds=60.0)
    probe = RankProbe("glance-dumped", 0, p.pid, True, "R", None)
    t0 = time.time()
    for k in range(11):
        time.sleep(max(0.0, t0 + k - time.time()))
        v = tracker.observe(t0 + k, [probe])[("glance-dumped", 0)]
        assert not v.stalled
    stacks = tracker._tracks[("glance-dumped", 0)].dump.stacks
    assert len({s.tid for s in stacks}) == 21, stacks  # dumped during the burn, every Python thread
    assert looks.full == 3, looks.full  # at 0, 2 and 4 s; glances at 6, 8 and 10 s
    assert v.progress_timestamp == t0 + 10  # the last glance found it working


@pytest.mark.parametrize("worker", [2.5], indirect=True)
def test_a_glance_reads_no_more_python_threads_than_a_look_reads_tasks(
    worker: tuple[subprocess.Popen[str], int],
) -> None:
    """The same dumped rank with ``max_threads`` 8: its 21 Python threads are more than a look
    reads, so no glance stands in (it would read 21): looks of every task, each bounded, at every
    look interval. Before: the glance read every Python thread of the dump, however many."""
    p, _ = worker
    looks = CountedLooks(PySpy(pyspy.resolve_pyspy()))
    tracker = StallTracker(
        60.0, looks, dump_interval_seconds=2.0, cycle_seconds=1.0, conclusive_seconds=60.0, max_threads=8
    )
    probe = RankProbe("glance-capped", 0, p.pid, True, "R", None)
    t0 = time.time()
    for k in range(11):
        time.sleep(max(0.0, t0 + k - time.time()))
        before = looks.schedstats
        tracker.observe(t0 + k, [probe])
        assert looks.schedstats - before <= 8, (k, looks.schedstats - before)
    assert len({s.tid for s in tracker._tracks[("glance-capped", 0)].dump.stacks}) == 21
    assert looks.full == 6, looks.full  # at 0, 2, 4, 6, 8 and 10 s
