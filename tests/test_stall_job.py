"""The job's view of a stall (join/stall_verdicts.py ``judge_jobs``) and the conclusive bound
(``stall.conclusive_seconds``), on real processes, real py-spy dumps and the real /proc:

- rank 0 working alone on its CPU (an evaluation, a checkpoint) while rank 1 waits in a barrier
  is not paged over 3 x after_seconds, through the real daemon: rank 1 gets the ``rank_waiting``
  info that names rank 0 and what it does; once rank 0 stops working too, the job is paged;
- the conclusive shapes (a lock-order deadlock, a thread holding the GIL at one line while the main
  thread waits, a rank stopped while its peer works, the odd one out of a collective and its
  waiter, a rank whose peer died, a spin over a kernel that never ends) are stalled within the
  conclusive bound while after_seconds is 300;
- the ambiguous ones (one blocked thread, ranks all waiting in the collective, a thread burning a
  core at one line with nothing to confirm it) still wait after_seconds.

The collective is a module named ``distributed_c10d.py`` (torch is not installed here): the hang
analysis knows a collective by that file name, as it knows torch's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from daemonutil import DaemonProc, write_config

from gpuwatchd.daemon.nccl_ras import ras_jobs
from gpuwatchd.findings.stall import stuck_where
from gpuwatchd.join.stall import StallTracker
from gpuwatchd.join.stall_spin import GpuReading
from gpuwatchd.join.stall_verdicts import judge_jobs
from gpuwatchd.model.stall import HangAnalysis, Pattern, RankProbe, StallVerdict, ThreadView
from gpuwatchd.model.threads import Dump
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.stall_looks import StallLooks
from gpuwatchd.sources.threads import process_state

CYCLE = 0.25
C10D = """
import threading
_never = threading.Lock()
_never.acquire()


def barrier():
    _never.acquire()  # a peer that never arrives: blocked at 0 % CPU


def all_reduce():
    _never.acquire()
"""
# SIGUSR1 makes a working rank enter the collective (its evaluation is over). The "hb_" shapes
# beat the heartbeat file named by $GW_HB (its mtime, as gpuwatchd.heartbeat does) for a few
# steps first, as a job with heartbeats at each optimizer step does before its evaluation.
_BEATS = """
        import os, time
        for _ in range(3):
            with open(os.environ["GW_HB"], "a"):
                os.utime(os.environ["GW_HB"])
            time.sleep(0.1)
"""
SHAPES = {
    "barrier": """
        import distributed_c10d
        print("ready", flush=True)
        distributed_c10d.barrier()
    """,
    "evaluate": """
        import signal, threading, time
        import distributed_c10d
        done = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: done.set())

        def evaluate():  # ~30 % of a core, in batches
            t = time.perf_counter()
            while time.perf_counter() - t < 0.015:
                pass
            time.sleep(0.035)

        print("ready", flush=True)
        while not done.is_set():
            evaluate()
        distributed_c10d.all_reduce()
    """,
    "hb_barrier": _BEATS
    + """
        import distributed_c10d
        print("ready", flush=True)
        distributed_c10d.barrier()
    """,
    "hb_evaluate": _BEATS
    + """
        import time

        def evaluate():  # ~30 % of a core, in batches, no optimizer step: no heartbeat
            t = time.perf_counter()
            while time.perf_counter() - t < 0.015:
                pass
            time.sleep(0.035)

        print("ready", flush=True)
        while True:
            evaluate()
    """,
    "load_batch": """
        import threading
        lock = threading.Lock()
        lock.acquire()

        def load_batch():
            lock.acquire()  # a data step that never ends

        print("ready", flush=True)
        load_batch()
    """,
    "deadlock": """
        import threading, time
        params, grads = threading.Lock(), threading.Lock()
        both = threading.Barrier(2)

        def loader():
            both.wait()
            with params:
                time.sleep(0.1)
                with grads:
                    pass

        def writer():
            both.wait()
            with grads:
                time.sleep(0.1)
                with params:
                    pass

        workers = [threading.Thread(target=loader, name="loader"),
                   threading.Thread(target=writer, name="writer")]
        for t in workers:
            t.start()
        print("ready", flush=True)
        for t in workers:
            t.join()
    """,
    "gil": """
        import re, threading, time

        def tokenize():
            time.sleep(0.2)
            re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic: one C call that keeps the GIL

        threading.Thread(target=tokenize, name="tokenizer", daemon=True).start()
        print("ready", flush=True)
        while True:
            time.sleep(0.05)  # the training loop: waits for the GIL after each sleep
    """,
    "gil_late": """
        import re, signal, threading, time

        def tokenize():
            time.sleep(0.2)  # as the catalog's fault thread: started, then takes the GIL
            re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic: one C call that keeps the GIL

        def fault(*_):
            threading.Thread(target=tokenize, name="tokenizer", daemon=True).start()

        signal.signal(signal.SIGUSR1, fault)
        print("ready", flush=True)
        time.sleep(2.0)  # start-up at 0 % CPU: dumped, as a rank is while it loads
        while True:  # the training loop: a step's CPU work, then a wait
            end = time.monotonic() + 0.02
            while time.monotonic() < end:
                pass
            time.sleep(0.05)
    """,
    "spin_late": """
        import ctypes, mmap, signal, time
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(b"\\xeb\\xfe")  # jmp . : a C call that never returns, without the GIL
        spin = ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
        hot = []
        signal.signal(signal.SIGUSR1, lambda *_: hot.append(1))
        print("ready", flush=True)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:  # start-up at 100 % of a core (CUDA's init): dumped so
            pass
        while not hot:  # the training loop: ~30 % of a core
            end = time.monotonic() + 0.015
            while time.monotonic() < end:
                pass
            time.sleep(0.035)
        spin()  # the next synchronisation spins behind a kernel that never ends
    """,
    "c_spin": """
        import ctypes, mmap
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(b"\\xeb\\xfe")  # jmp . : a C call that never returns, without the GIL
        spin = ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
        print("ready", flush=True)
        spin()
    """,
}


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """A rank found by discovery (torchrun's variables, no rank file, no heartbeat)."""
    (tmp_path / "distributed_c10d.py").write_text(C10D)
    started: list[subprocess.Popen[str]] = []

    def start(shape: str, job: str, rank: int = 0, world: int = 2) -> subprocess.Popen[str]:
        env = {
            **os.environ,
            "TORCHELASTIC_RUN_ID": job,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "PYTHONPATH": str(tmp_path),
            "GW_HB": str(tmp_path / f"{job}.{rank}.hb"),
        }
        p = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SHAPES[shape])], stdout=subprocess.PIPE, text=True, env=env
        )
        started.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def _probe(job: str, rank: int, p: subprocess.Popen[str], hb: str | None = None) -> RankProbe:
    """/proc's alive and state, as the daemon's procfs source gives them every cycle."""
    state = process_state(HostPaths(), p.pid)
    return RankProbe(job, rank, p.pid, state not in (None, "Z"), state or "", hb)


def _tracker(after: float, conclusive: float, shipped_cadence: bool = False) -> StallTracker:
    """``shipped_cadence``: looks every third of the conclusive bound, as the shipped defaults
    have them (40 s, a look every 13.3 s), instead of every CYCLE."""
    return StallTracker(
        after,
        StallLooks(PySpy(pyspy.resolve_pyspy())),
        cycle_seconds=CYCLE,
        dump_interval_seconds=None if shipped_cadence else CYCLE,
        conclusive_seconds=conclusive,
    )


def _run(
    tracker: StallTracker,
    ranks: dict[int, subprocess.Popen[str]],
    job: str,
    seconds: float,
    stop: Callable[[dict[int, StallVerdict]], bool] = lambda v: False,
    gpu: GpuReading | None = None,
) -> tuple[float, dict[int, StallVerdict], list[dict[int, bool]]]:
    """Observe every CYCLE until ``stop`` or ``seconds``; (elapsed, last verdicts, each cycle's
    stalled flags by rank)."""
    t0 = time.time()
    seen: list[dict[int, bool]] = []
    while True:
        now = time.time()
        out = tracker.observe(now, [_probe(job, r, p) for r, p in ranks.items()])
        v = {k[1]: x for k, x in out.items()}
        seen.append({r: x.stalled for r, x in v.items()})
        if gpu is not None:
            tracker.note_gpus({(job, r): GpuReading(now, gpu.util, gpu.mem, True) for r in ranks})
        if stop(v) or now - t0 >= seconds:
            return now - t0, v, seen
        time.sleep(CYCLE)


def _findings(state: Path, job: str) -> list[dict]:
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError):
        return []
    return [f for f in doc["findings"] if f.get("job_id") == job]


def test_rank0_working_alone_is_not_paged_through_the_daemon(launch, tmp_path: Path) -> None:
    """The issue's measured false page, on this machine: rank 0 works alone (here on its CPU, as
    an evaluation or a checkpoint's serialisation does) while rank 1 waits in a barrier, for 3 x
    after_seconds. Before, rank 1 was paged after_seconds into the wait. Then rank 0 enters the
    collective too and the job is paged."""
    after = 2.0
    job = f"eval-{uuid.uuid4().hex[:8]}"
    worker = launch("evaluate", job, 0)
    launch("barrier", job, 1)
    cfg_path, cfg = write_config(
        tmp_path,
        interval_seconds=0.5,
        discovery={"enabled": True, "interval_seconds": 0.5},
        stall={"after_seconds": after, "conclusive_seconds": 1.0},
    )
    state = Path(cfg["state_dir"]) / "state.json"
    d = DaemonProc(cfg_path, cfg)
    try:
        d.wait_for(
            lambda: d.value("gpuwatch_rank_stalled", job_id=job, rank="1") is not None, what="the discovered ranks"
        )
        t0, waiting = time.monotonic(), []
        while time.monotonic() - t0 < 3 * after:
            found = _findings(state, job)
            assert not [f for f in found if f["kind"] == "rank_stalled"], found
            waiting += [f for f in found if f["kind"] == "rank_waiting"]
            time.sleep(0.25)
        assert d.value("gpuwatch_rank_stalled", job_id=job, rank="1") == 0.0
        assert waiting, "no rank_waiting info for rank 1"
        text = waiting[-1]["explanation"]
        print(text)
        assert waiting[-1]["severity"] == "info" and waiting[-1]["rank"] == "1"
        assert "rank 1 waits in barrier for rank 0, which works on its CPU (" in text, text
        assert "not paged while its job progresses" in text
        # rank 0's evaluation ends in the collective: nobody progresses, the job is paged
        os.kill(worker.pid, signal.SIGUSR1)
        d.wait_for(
            lambda: {f["rank"] for f in _findings(state, job) if f["kind"] == "rank_stalled"} == {"0", "1"},
            timeout=after + 15,
            what="both ranks paged",
        )
    finally:
        assert d.stop() == 0


def test_rank0_working_alone_then_stopping(launch) -> None:
    """The same on the tracker, with the timings: rank 1 in the barrier is not stalled while rank
    0 works (3 x after_seconds); once rank 0 waits too, rank 1 is stalled within the conclusive
    bound plus a dump interval of rank 0's last work, rank 0 after_seconds after it (both wait in
    the collective: the peer they wait for may be on another node, so not conclusive)."""
    after, conclusive = 2.0, 1.0
    job = f"eval-{uuid.uuid4().hex[:8]}"
    ranks = {0: launch("evaluate", job, 0), 1: launch("barrier", job, 1)}
    tracker = _tracker(after, conclusive)
    _, v, seen = _run(tracker, ranks, job, 3 * after)
    assert not any(s[0] or s[1] for s in seen), seen
    # what rank 0 is seen doing depends on its share of a loaded CPU: work, or a stack that moves
    assert v[1].waits_for.startswith("rank 1 waits in barrier for rank 0, which "), v[1]
    # neither is stalled, and the job's RAS port is still asked: rank 1 sits in a collective at
    # its last dump, and only NCCL knows whether its collectives complete
    assert v[1].watch == "in barrier at its last dump", v[1]
    assert ras_jobs({(job, r): x for r, x in v.items()}) == {job}
    os.kill(ranks[0].pid, signal.SIGUSR1)
    t_stop = time.time()
    _, v, _ = _run(tracker, ranks, job, after + 6, lambda v: v[0].stalled and v[1].stalled)
    assert v[0].stalled and v[1].stalled, v
    assert v[0].conclusive == "" and v[1].conclusive == "", v  # after_seconds, not conclusive
    assert time.time() - t_stop >= after - CYCLE


def test_a_waiting_rank_is_not_paged_before_its_busy_peer_is_judged(launch) -> None:
    """Rank 1 waits in the barrier; a second later rank 0 starts burning a core at one line (as
    rank 0 evaluating with .item() per batch on a GPU it shares looked on the H100) and is not
    judged before its own after_seconds, then is ambiguous (nothing confirms a hang). Rank 1 is
    never stalled: the job has not been still for after_seconds while its peer's verdict is not
    in. Before, rank 1 was stalled from its own after_seconds until rank 0's verdict came."""
    after, conclusive = 2.0, 1.0
    job = f"pend-{uuid.uuid4().hex[:8]}"
    ranks = {1: launch("barrier", job, 1)}
    time.sleep(1.0)
    ranks[0] = launch("c_spin", job, 0)
    tracker = _tracker(after, conclusive)
    _, v, seen = _run(tracker, ranks, job, 3 * after + 1)
    assert not any(s.get(1) for s in seen), seen
    assert v[1].waits_for.startswith("rank 1 waits in barrier for rank 0, which "), v[1]


def test_heartbeat_job_rank0_working_alone_is_not_paged(launch, tmp_path: Path) -> None:
    """With heartbeats at each optimizer step, neither rank beats while rank 0 evaluates: rank 0
    works (its CPU in the working band at each look), so it progresses without beating, and rank
    1, silent in the barrier, waits for it. Before, both were paged after_seconds into the
    evaluation by their heartbeats."""
    after, conclusive = 2.0, 1.0
    job = f"hbeval-{uuid.uuid4().hex[:8]}"
    ranks = {0: launch("hb_evaluate", job, 0), 1: launch("hb_barrier", job, 1)}
    hbs = {r: str(tmp_path / f"{job}.{r}.hb") for r in ranks}
    tracker = _tracker(after, conclusive)
    t0, seen, v = time.time(), [], {}
    while time.time() - t0 < 3 * after:
        out = tracker.observe(time.time(), [_probe(job, r, p, hbs[r]) for r, p in ranks.items()])
        v = {k[1]: x for k, x in out.items()}
        seen.append({r: x.stalled for r, x in v.items()})
        time.sleep(CYCLE)
    assert not any(s[0] or s[1] for s in seen), seen
    assert time.time() - os.stat(hbs[0]).st_mtime >= 3 * after - 0.5  # no beat all along
    assert v[0].method == "heartbeat" and v[0].doing.startswith("works on its CPU"), v[0]
    assert v[1].waits_for.startswith("rank 1 waits in barrier for rank 0, which works on its CPU"), v[1]
    # progressing without a beat: the job's RAS port is asked (the device run: a world-size-1 job
    # that stopped beating and trained was never asked, its rank not stalled, not suspect)
    assert v[0].watch.startswith("heartbeat late ("), v[0]
    assert ras_jobs({(job, r): x for r, x in v.items()}) == {job}
    os.utime(hbs[0])  # a beat on time: no reason to ask
    beating = tracker.observe(time.time(), [_probe(job, 0, ranks[0], hbs[0])])
    assert beating[(job, 0)].watch == "" and not ras_jobs(beating)


@pytest.mark.parametrize("shape", ["deadlock", "gil", "stopped", "odd_one_out", "peer_down", "gpu_spin"])
def test_conclusive_shapes_are_paged_within_the_conclusive_bound(launch, shape: str) -> None:
    """after_seconds 300, conclusive_seconds 2, looks every third of it (as 40 s and 13.3 s at the
    shipped defaults): each shape is stalled within the conclusive bound, a look and a few cycles
    of its start, and says why (``conclusive``)."""
    after, conclusive = 300.0, 2.0
    job = f"c-{shape}-{uuid.uuid4().hex[:8]}"
    gpu = None
    if shape in ("deadlock", "gil"):
        ranks = {0: launch(shape, job, 0, 1)}
        expect = {0: shape}
    elif shape == "gpu_spin":  # the NVML readings of a kernel that never ends: busy, no traffic
        ranks, expect = {0: launch("c_spin", job, 0, 1)}, {0: "gpu_spin"}
        gpu = GpuReading(0.0, 1.0, 0.0, True)
    elif shape == "stopped":
        ranks = {0: launch("evaluate", job, 0), 1: launch("evaluate", job, 1)}
        os.kill(ranks[1].pid, signal.SIGSTOP)
        expect = {1: "stopped"}
    elif shape == "odd_one_out":
        ranks = {0: launch("barrier", job, 0), 1: launch("load_batch", job, 1)}
        expect = {0: "waits_for_stuck", 1: "odd_one_out"}
    else:  # peer_down: rank 1 died; rank 0 waits in the barrier for it
        ranks = {0: launch("barrier", job, 0), 1: launch("barrier", job, 1)}
        ranks[1].kill()
        ranks[1].wait()
        expect = {0: "peer_down"}
    tracker = _tracker(after, conclusive, shipped_cadence=True)
    assert tracker.dump_interval == pytest.approx(conclusive / 3)
    elapsed, v, _ = _run(tracker, ranks, job, conclusive + 8, lambda v: all(v[r].stalled for r in expect), gpu)
    print(shape, f"{elapsed:.2f} s", {r: (x.stalled, x.conclusive) for r, x in v.items()})
    for r, why in expect.items():
        assert v[r].stalled and v[r].conclusive == why, v[r]
    if shape == "stopped":  # its words say how long: still for as long as it is stopped
        assert v[1].still_seconds >= conclusive, v[1]
    # the conclusive bound, a look to see the new place, a cycle, and slack for a loaded 2-core VM
    # (after_seconds is 300)
    assert elapsed <= conclusive + tracker.dump_interval + CYCLE + 2.0, elapsed
    for r in set(ranks) - set(expect):
        assert not v[r].stalled, v[r]


def test_a_rank_stopped_after_its_last_dump_is_not_said_stuck_where_that_dump_was(launch, monkeypatch) -> None:
    """A rank dumped while it waits, then stopped (SIGSTOP) while its peer runs, with no dump read
    since (py-spy failed on it: the H100 at the shipped 300 s dumped none): it is stalled as
    stopped, and its words do not give the frames of the dump from before the stop as where it is
    stuck (the H100 at 30 s said "stuck in" the importlib frames of a dump at its start-up)."""
    after, conclusive = 300.0, 2.0
    job = f"stop-late-{uuid.uuid4().hex[:8]}"
    ranks = {0: launch("evaluate", job, 0), 1: launch("barrier", job, 1)}
    tracker = _tracker(after, conclusive, shipped_cadence=True)
    tr = None

    def dumped(v: dict[int, StallVerdict]) -> bool:
        nonlocal tr
        tr = tracker._tracks.get((job, 1))
        return tr is not None and bool(tr.dump.stacks)

    _run(tracker, ranks, job, conclusive + 8, dumped)
    assert tr is not None and tr.dump.stacks, "rank 1 was never dumped while it waited"
    assert any("barrier" in fr for fr in tr.words.frames), tr.words.frames
    monkeypatch.setattr(tracker.looks, "dump", lambda pid: Dump(None, error="injected: py-spy failed"))
    os.kill(ranks[1].pid, signal.SIGSTOP)
    _, v, _ = _run(tracker, ranks, job, conclusive + 8, lambda v: v[1].stalled)
    assert v[1].stalled and v[1].conclusive == "stopped", v[1]
    assert v[1].stuck_frames == (), v[1].stuck_frames
    assert stuck_where(v[1]) == "stack not read since it stopped"


def test_a_gil_holder_started_mid_training_is_paged_within_the_conclusive_bound(launch) -> None:
    """A rank dumped at start-up, then training (its main thread in the working band), starts a
    thread that keeps the GIL in one C call (the catalog's GIL fault): a thread burning a core
    that no dump has shown yet is dumped a dump interval after it starts burning
    (join/stall_spin.py new_spinners), and the rank is stalled ("gil") within the conclusive
    bound of that dump;
    it is never stalled while it trains."""
    after, conclusive = 300.0, 2.0
    job = f"gil-late-{uuid.uuid4().hex[:8]}"
    ranks = {0: launch("gil_late", job, 0, 1)}
    tracker = _tracker(after, conclusive, shipped_cadence=True)
    _, v, seen = _run(tracker, ranks, job, 6.0)
    assert not any(s[0] for s in seen), seen
    assert tracker._tracks[(job, 0)].dump.stacks, "the rank was dumped at start-up"
    os.kill(ranks[0].pid, signal.SIGUSR1)
    tr, burn = tracker._tracks[(job, 0)], []

    def stalled(v: dict[int, StallVerdict]) -> bool:
        if tr.look.spinning and not burn:
            burn.append(tr.look.at)  # the look that first saw the new thread burn a core
        return v[0].stalled

    elapsed, v, _ = _run(tracker, ranks, job, conclusive + 8, stalled)
    print(
        f"gil_late {elapsed:.2f} s",
        v[0].conclusive,
        v[0].doing,
        tr.gil.since - burn[0],
        tr.dump.stacks_at - tr.gil.since,
    )
    assert v[0].stalled and v[0].conclusive == "gil", v[0]
    # dumped by that look, not a dump interval after the last look that found the rank working
    # (a look is no dump); the proving dump a conclusive bound after it, not a dump interval
    # later behind one due at the bound of the last change of view (the device: the GIL fault
    # paged 65 s after it at the shipped defaults, 47 s after that first sight)
    assert tr.gil.since == burn[0], (tr.gil.since - burn[0], tracker.dump_interval)
    assert tr.dump.stacks_at - tr.gil.since <= conclusive + CYCLE + 0.2, tr.dump.stacks_at - tr.gil.since
    # a look to see the new thread burn, the conclusive bound, a cycle, slack
    assert elapsed <= conclusive + tracker.dump_interval + CYCLE + 2.0, elapsed


def test_a_spin_after_training_is_dumped_at_once_though_start_up_burned(launch) -> None:
    """A rank dumped while it burned a core at start-up (CUDA's init), then training in the
    working band, then spinning behind a kernel that never ends (the catalog's GPU_SLEEP; NVML:
    busy, no memory traffic): the new burn is dumped a look after it starts, and the rank is
    stalled ("gpu_spin") within the conclusive bound of that dump."""
    after, conclusive = 300.0, 4.0
    job = f"spin-late-{uuid.uuid4().hex[:8]}"
    ranks = {0: launch("spin_late", job, 0, 1)}
    tracker = _tracker(after, conclusive, shipped_cadence=True)
    _, v, seen = _run(tracker, ranks, job, 9.0)
    assert not any(s[0] for s in seen), seen
    os.kill(ranks[0].pid, signal.SIGUSR1)
    elapsed, v, _ = _run(
        tracker, ranks, job, 2 * conclusive + 6, lambda v: v[0].stalled, GpuReading(0.0, 1.0, 0.0, True)
    )
    print(f"spin_late {elapsed:.2f} s", v[0].conclusive)
    assert v[0].stalled and v[0].conclusive == "gpu_spin", v[0]
    # two looks to see the burn, the conclusive bound, a cycle, slack for a loaded 2-core VM
    assert elapsed <= conclusive + 2 * tracker.dump_interval + CYCLE + 1.5, elapsed


def test_ambiguous_shapes_still_wait_after_seconds(launch) -> None:
    """One thread blocked on a lock, ranks all waiting in the collective (their peer may be on
    another node, evaluating) and a thread burning a core at one line with no GPU reading: none
    is stalled at the conclusive bound; the blocked ones are at after_seconds, the spin is never
    paged (tests/test_stall_spin.py: the warning once its stacks held for after_seconds)."""
    after, conclusive = 4.0, 1.0
    job = f"amb-{uuid.uuid4().hex[:8]}"
    ranks = {0: launch("barrier", job, 0, 3), 1: launch("barrier", job, 1, 3)}
    lone = {0: launch("load_batch", f"{job}-lone", 0, 1)}
    spin = {0: launch("c_spin", f"{job}-spin", 0, 1)}
    tracker = _tracker(after, conclusive)
    t0 = time.time()
    stalled_at: dict[str, float] = {}
    last: dict[str, StallVerdict] = {}
    while time.time() - t0 < after + 3:
        now = time.time()
        probes = [_probe(job, r, p) for r, p in ranks.items()]
        probes += [_probe(f"{job}-lone", 0, lone[0]), _probe(f"{job}-spin", 0, spin[0])]
        for key, x in tracker.observe(now, probes).items():
            name = f"{key[0]}:{key[1]}"
            last[name] = x
            if x.stalled:
                stalled_at.setdefault(name, now - t0)
        time.sleep(CYCLE)
    print(stalled_at)
    blocked = [f"{job}:0", f"{job}:1", f"{job}-lone:0"]
    for name in blocked:
        assert name in stalled_at and stalled_at[name] >= after - CYCLE, (name, stalled_at)
        assert last[name].conclusive == "", last[name]
    assert f"{job}-spin:0" not in stalled_at, last[f"{job}-spin:0"]


def _view(kind: str, name: str = "MainThread", share: float = 0.0, state: str = "S", waits_on: str = "") -> ThreadView:
    return ThreadView(1, name, state, "futex_do_wait", share, False, (), kind, waits_on)


def _verdict(
    rank: int,
    *,
    stalled: bool = False,
    still: float = 0.0,
    kind: str = "",
    pattern: str = "",
    progress: float = 0.0,
    doing: str = "",
    alive: bool = True,
    stopped: float | None = None,
    state: str = "S",
    conclusive: str = "",
) -> StallVerdict:
    views = (_view(kind, state=state, waits_on="collective barrier" if kind == "collective" else ""),) if kind else ()
    a = HangAnalysis(views, (), (Pattern(pattern, ""),) if pattern else ()) if kind else None
    return StallVerdict(
        "j",
        rank,
        100 + rank,
        alive,
        progress,
        stalled,
        "stack",
        0.0,
        analysis=a,
        still_seconds=still,
        doing=doing,
        stopped_seconds=stopped,
        conclusive=conclusive,
    )


def test_judge_jobs_rules() -> None:
    """The job rules on plain verdicts (now 1000, conclusive 40, fresh 53): who is excused by a
    progressing peer, and which shapes are conclusive only with the peers."""

    def judge(*vs: StallVerdict) -> dict[int, StallVerdict]:
        return {k[1]: v for k, v in judge_jobs({v.key: v for v in vs}, 1000.0, 40.0, 53.0).items()}

    working = _verdict(0, progress=995.0, doing="works on its CPU (45% of a core)")
    waiter = _verdict(1, stalled=True, still=400.0, kind="collective", pattern="collective")
    out = judge(working, waiter)
    assert not out[1].stalled and out[1].waits_for.startswith(
        "rank 1 waits in barrier for rank 0, which works on its CPU (45% of a core)"
    )
    # a peer burning a core at one line, unconfirmed (rank 0 evaluating with .item() per batch on
    # the H100 looked so, and its waiting peer was paged 8 s into the barrier): not paged either
    unsure = replace(_verdict(0, progress=900.0), ambiguous=True)
    out = judge(unsure, waiter)
    assert not out[1].stalled and "waits in barrier for rank 0, which burns a core" in out[1].waits_for
    # ...until rank 0's own verdict confirms its hang: then the waiter is paged again
    assert judge(replace(unsure, ambiguous=False, stalled=True, confirmed_by="gpu_spin"), waiter)[1].stalled
    # a peer whose last progress is older than the window and whose own verdict is not in yet
    # (still for less than after_seconds): the waiter waits for it, and is paged with it
    out = judge(_verdict(0, progress=900.0, doing="x"), waiter)
    assert not out[1].stalled and "which has made no progress for 2 min, not proven stuck yet" in out[1].waits_for, out[
        1
    ].waits_for
    assert judge(_verdict(0, stalled=True, progress=900.0, kind="collective", pattern="collective"), waiter)[1].stalled
    # ...but not a peer that waits in the collective itself, and never a conclusive verdict (the
    # H100 at the shipped 300 s: GPU_SLEEP's "kernel that never ends" on rank 1 was excused by
    # rank 0 waiting in all_reduce, not yet stalled, and not paged 75 s after the fault)
    in_coll = _verdict(0, progress=900.0, kind="collective", pattern="collective")
    assert judge(in_coll, waiter)[1].stalled
    spin = replace(waiter, conclusive="gpu_spin", confirmed_by="gpu_spin")
    assert judge(_verdict(0, progress=900.0, doing="x"), spin)[1].stalled
    # a deadlock or a rank blocked on a lock (no wait for a peer) is not excused by a peer's work
    deadlock = _verdict(1, stalled=True, still=400.0, kind="lock", pattern="deadlock", conclusive="deadlock")
    assert judge(working, deadlock)[1].stalled
    assert judge(working, _verdict(1, stalled=True, still=400.0, kind="lock", pattern="lock_wait"))[1].stalled
    # the odd one out: blocked on a lock elsewhere while the peer waits in the collective
    coll = _verdict(0, still=45.0, kind="collective", pattern="collective")
    out = judge(coll, _verdict(1, still=45.0, kind="lock", pattern="lock_wait"))
    assert (out[0].conclusive, out[1].conclusive) == ("waits_for_stuck", "odd_one_out")
    # ...but not idle in a queue (its DataLoader workers may still deliver), nor in D, nor before
    # the bound
    for other in (
        _verdict(1, still=45.0, kind="queue"),
        _verdict(1, still=45.0, kind="lock", state="D"),
        _verdict(1, still=39.0, kind="lock"),
    ):
        assert not any(v.stalled for v in judge(coll, other).values()), other
    # stopped while a peer runs; a whole job stopped (a scheduler's suspend) waits after_seconds
    out = judge(_verdict(0, progress=999.0, doing="x"), _verdict(1, stopped=41.0))
    assert out[1].stalled and out[1].conclusive == "stopped" and out[1].method == "stopped"
    # ...and it was still for as long as it was stopped, not for the span of two equal dumps (the H100
    # at the shipped 300 s said "conclusive: stopped for 0s while its peers run")
    assert out[1].still_seconds == 41.0
    assert not any(v.stalled for v in judge(_verdict(0, stopped=41.0), _verdict(1, stopped=41.0)).values())
    # a dead peer: the still one is paged at the bound
    out = judge(_verdict(0, alive=False), _verdict(1, still=41.0))
    assert out[1].stalled and out[1].conclusive == "peer_down"
