"""Hang analysis (gpuwatchd/join/hang.py) on real hung ranks, real py-spy dumps and the real /proc:
seed 003's lock deadlock, and a training loop starved by stopped or dead queue workers; then the
explanation of the rank_stalled finding, and the same through the real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import stall as stall_finding
from gpuwatchd.join.stall import StallTracker
from gpuwatchd.model import GpuDevice, GpuProcessRow, RankState
from gpuwatchd.model.parts import GpuOutput, StallOutput, Tracked
from gpuwatchd.model.stall import RankProbe, StallVerdict
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.stall_looks import StallLooks

PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
AFTER = 1.0
CYCLE = 0.25
PROCFS = ProcfsReader(HostPaths())


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[Callable[[str], tuple[subprocess.Popen[str], list[str]]]]:
    started: list[subprocess.Popen[str]] = []

    def launch(mode: str) -> tuple[subprocess.Popen[str], list[str]]:
        p = subprocess.Popen(
            [sys.executable, str(PROGRAMS / "hang_rank.py"), mode, str(tmp_path), "hang-job", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(p)
        assert p.stdout is not None
        words = p.stdout.readline().split()
        assert words and words[0] == "ready", words
        return p, words[1:]

    yield launch
    for p in started:
        for kid in PROCFS.descendants(p.pid):
            with_suppressed_kill(kid)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def with_suppressed_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def probe(pid: int, heartbeat: str) -> RankProbe:
    """What the daemon hands the tracker each cycle: /proc state and the rank's descendants."""
    info = PROCFS.read_process(pid)
    kids = PROCFS.read_many(PROCFS.descendants(pid))
    return RankProbe(
        "hang-job",
        0,
        pid,
        info is not None,
        info.state if info else "",
        heartbeat,
        workers=tuple((k, p.state, p.cpu_seconds) for k, p in kids.items()),
    )


def until_stalled(tracker: StallTracker, pid: int, hb: str, seconds: float = 20.0, want: str = "") -> StallVerdict:
    deadline = time.monotonic() + seconds
    while True:
        v = tracker.observe(time.time(), [probe(pid, hb)])[("hang-job", 0)]
        if v.stalled and v.analysis is not None and (not want or want in v.analysis.kinds):
            return v
        assert time.monotonic() < deadline, f"not stalled with {want or 'an analysis'}: {v}"
        time.sleep(CYCLE)


def explanation(v: StallVerdict, gpus: tuple[GpuDevice, ...] = (), rows: tuple[GpuProcessRow, ...] = ()) -> str:
    r = RankState("hang-job", 0, v.pid, 0, 1, True, None, stalled=True, gpus=("0",) if gpus else ())
    ctx = FindingContext(
        now=time.time(),
        config=Config(),
        ranks=(r,),
        gpu_processes=rows,
        parts=Tracked(gpu=GpuOutput(gpus=gpus), stall=StallOutput(verdicts={v.key: v})),
    )
    (f,) = stall_finding.find(ctx)
    assert f.kind == "rank_stalled"
    return f.explanation


def heartbeat_path(tmp_path: Path) -> str:
    return str(tmp_path / "hang-job.0.hb")


def test_seed_003_lock_deadlock_names_both_threads_their_lines_and_the_word(rank: Callable, tmp_path: Path) -> None:
    p, _ = rank("deadlock")
    tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    v = until_stalled(tracker, p.pid, heartbeat_path(tmp_path), want="deadlock")
    a = v.analysis
    assert a is not None
    dead = next(x for x in a.patterns if x.kind == "deadlock")
    assert set(dead.threads) == {"loader", "writer"}
    source = (PROGRAMS / "hang_rank.py").read_text().splitlines()
    # each thread is named with the very line where it waits for the other's lock
    for name, fn in (("loader", "loader"), ("writer", "writer")):
        view = next(t for t in a.threads if t.name == name)
        assert view.kind == "lock" and view.frames[0].name.endswith(fn), view
        assert "never" in source[(view.frames[0].line or 0) - 1], view.frames[0]
        assert f'"{name}" in {view.frames[0]}' in dead.text
    if sys.version_info >= (3, 11):
        assert "waiting on 2 different locks" in dead.text  # two futex words, /proc/TID/syscall
    else:  # no native thread id before 3.11 (py-spy #567): the process-wide evidence, in words
        assert dead.text.endswith(
            " (thread ids not joinable on Python 3.10 (py-spy #567): all 4 tasks read asleep at "
            "0 % CPU, 3 in untimed futex waits on 3 different futex words)"
        ), dead.text
    assert '"MainThread" waits for them in Thread.join' in dead.text
    text = explanation(v)
    print(text)
    assert "likely deadlock: 2 threads blocked acquiring locks at 0 % CPU, none progressing" in text
    if sys.version_info >= (3, 13):  # Thread.join waits in _ThreadHandle.join (C): no frame of its own
        assert '"MainThread" (S, 0% CPU) waiting in Thread.join at Thread.join (threading.py:' in text
    elif sys.version_info >= (3, 11):
        assert '"MainThread" (S, 0% CPU) waiting in Thread.join at Thread._wait_for_tstate_lock' in text
    else:  # per-thread CPU needs the tid; no qualified names before 3.11 (co_qualname)
        assert '"MainThread" (S, CPU ?) waiting in Thread.join at _wait_for_tstate_lock' in text
    assert "threads: " in text and "Thread.join" in text


def test_starved_by_stopped_workers_then_by_dead_workers(rank: Callable, tmp_path: Path) -> None:
    p, pids = rank("starve")
    workers = [int(x) for x in pids]
    hb = heartbeat_path(tmp_path)
    tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    # healthy first: the queue is fed, the heartbeat moves, nothing is stalled
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        v = tracker.observe(time.time(), [probe(p.pid, hb)])[("hang-job", 0)]
        assert not v.stalled, v
        time.sleep(CYCLE)
    for w in workers:
        os.kill(w, signal.SIGSTOP)
    v = until_stalled(tracker, p.pid, hb, want="starved")
    assert v.analysis is not None
    starved = next(x for x in v.analysis.patterns if x.kind == "starved")
    print(starved.text)
    assert starved.threads == ("MainThread",)
    assert "multiprocessing queue get" in starved.text and "get (multiprocessing/queues.py:" in starved.text
    assert f"2 stopped (T) (pid {workers[0]}, {workers[1]})" in starved.text
    assert "starved: " in explanation(v)
    # the workers die: the rank is starved by dead workers (it remembers it had two)
    for w in workers:
        os.kill(w, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        v = tracker.observe(time.time(), [probe(p.pid, hb)])[("hang-job", 0)]
        text = next((x.text for x in (v.analysis.patterns if v.analysis else ()) if x.kind == "starved"), "")
        if "2 dead" in text:
            break
        assert time.monotonic() < deadline, v
        time.sleep(CYCLE)
    print(text)
    assert f"2 dead (pid {workers[0]}, {workers[1]})" in text


def test_workers_killed_while_the_rank_still_beats(rank: Callable, tmp_path: Path) -> None:
    """The workers die while the rank's heartbeat is fresh (it is not looked at then): when the
    queue runs dry and the rank stalls, it is starved by dead workers it had."""
    p, pids = rank("starve")
    workers = [int(x) for x in pids]
    hb = heartbeat_path(tmp_path)
    tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    for _ in range(3):
        assert not tracker.observe(time.time(), [probe(p.pid, hb)])[("hang-job", 0)].stalled
        time.sleep(CYCLE)
    for w in workers:
        os.kill(w, signal.SIGKILL)
    v = until_stalled(tracker, p.pid, hb, want="starved")
    text = next(x.text for x in v.analysis.patterns if x.kind == "starved")  # type: ignore[union-attr]
    assert f"2 dead (pid {workers[0]}, {workers[1]})" in text, text


def test_running_workers_do_not_make_a_queue_wait_starved(rank: Callable, tmp_path: Path) -> None:
    """The same rank with its heartbeat judged stalled on purpose (after_seconds tiny): its
    workers run, so the analysis must not call it starved."""
    p, _ = rank("starve")
    tracker = StallTracker(0.01, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    for _ in range(8):
        v = tracker.observe(time.time(), [probe(p.pid, "/nonexistent/hb")])[("hang-job", 0)]
        if v.analysis is not None:
            assert "starved" not in v.analysis.kinds, v.analysis.patterns
        time.sleep(CYCLE)


def test_gpu_named_in_the_verdict(rank: Callable, tmp_path: Path) -> None:
    """A stalled rank's explanation names its GPU with utilisation and the memory its tree
    holds (the GPU part of the state comes from NVML; here a reading as the join sees it)."""
    p, _ = rank("deadlock")
    tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    v = until_stalled(tracker, p.pid, heartbeat_path(tmp_path), want="deadlock")
    gpu = GpuDevice(0, "GPU-0", "NVIDIA H200", "00000000:19:00.0", 150 << 30, 3 << 30, 0.0)
    row = GpuProcessRow(0, "GPU-0", p.pid, 2 << 30, "python3", "root", "hang-job", "0")
    assert "; GPU 0 idle, 2.0 GiB held" in explanation(v, (gpu,), (row,))
    busy = GpuDevice(0, "GPU-0", "NVIDIA H200", "00000000:19:00.0", 150 << 30, 3 << 30, 1.0)
    assert "; GPU 0 100 % busy, 2.0 GiB held" in explanation(v, (busy,), (row,))


def test_daemon_explains_the_deadlock(tmp_path: Path) -> None:
    """Through the real daemon (py-spy, /proc, rank files): the rank_stalled finding of the
    deadlocked rank says "likely deadlock" and names both threads."""
    from daemonutil import DaemonProc, write_config

    cfg_path, cfg = write_config(tmp_path, stall={"after_seconds": 1.5})
    p = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "hang_rank.py"), "deadlock", cfg["rank_dir"], "hang-job", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        d = DaemonProc(cfg_path, cfg)
        try:

            def finding() -> str:
                state = json.loads((Path(cfg["state_dir"]) / "state.json").read_text())
                return next(
                    (
                        f["explanation"]
                        for f in state["findings"]
                        if f["kind"] == "rank_stalled" and "likely deadlock" in f["explanation"]
                    ),
                    "",
                )

            d.wait_for(lambda: bool(finding()), timeout=30, what="rank_stalled with a deadlock")
            text = finding()
            print(text)
            if sys.version_info >= (3, 11):
                assert '"loader" in deadlock.<locals>.loader (hang_rank.py:' in text
                assert '"writer" in deadlock.<locals>.writer (hang_rank.py:' in text
                assert "likely deadlock" in text and "waiting on 2 different locks" in text
            else:  # no co_qualname before 3.11; no tid to join futexes to threads (py-spy #567)
                assert '"loader" in loader (hang_rank.py:' in text
                assert '"writer" in writer (hang_rank.py:' in text
                assert (
                    "likely deadlock" in text
                    and "(thread ids not joinable on Python 3.10 (py-spy #567): all 4 tasks" in text
                )
        finally:
            assert d.stop() == 0
    finally:
        p.kill()
        p.wait()


def test_doctor_folds_identical_threads_and_names_the_deadlock(rank: Callable, tmp_path: Path, procs: list) -> None:
    """``gpuwatchd doctor PID`` on the deadlocked rank says "likely deadlock"; on a process with
    fourteen pool threads idle in queue.get they fold into one line."""
    p, _ = rank("deadlock")
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "doctor", str(p.pid)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "PYTHON THREADS (folded" in out.stdout
    assert "=> likely deadlock: 2 threads blocked acquiring locks" in out.stdout, out.stdout
    pool = tmp_path / "pool.py"
    pool.write_text(
        "import queue, threading\nq = queue.Queue()\n"
        "for i in range(14):\n    threading.Thread(target=q.get, name=f'pool-{i}', daemon=True).start()\n"
        "print('ready', flush=True)\nthreading.Event().wait()\n"
    )
    w = subprocess.Popen([sys.executable, str(pool)], stdout=subprocess.PIPE, text=True)
    procs.append(w)
    assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "doctor", "--json", str(w.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    lines = report["hang"]["threads"]
    print(lines)
    if sys.version_info >= (3, 11):
        assert any(
            t.startswith("14 threads (S, 0% CPU each) idle in queue.get at Condition.wait (threading.py:")
            and "<- Queue.get (queue.py:" in t
            for t in lines
        ), lines
    else:  # no tid to join /proc state and CPU to (py-spy #567), no qualified names (co_qualname)
        assert any(
            t.startswith("14 threads (?, CPU ? each) idle in queue.get at wait (threading.py:")
            and "<- get (queue.py:" in t
            for t in lines
        ), lines
    assert report["hang"]["patterns"] == []  # idle pool threads are no hang


def test_interpreter_exit_joining_deadlocked_threads_is_no_lock(rank: Callable, tmp_path: Path) -> None:
    """Seed 003's deadlock in a script whose main thread returned: the interpreter's exit
    (threading._shutdown) joins the two non-daemon threads. The main thread waits for threads,
    not for a lock: it is named as the joiner, not counted in the cycle (every version)."""
    p, _ = rank("exit_deadlock")
    tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    v = until_stalled(tracker, p.pid, heartbeat_path(tmp_path), want="deadlock")
    assert v.analysis is not None
    dead = next(x for x in v.analysis.patterns if x.kind == "deadlock")
    print(dead.text)
    assert set(dead.threads) == {"loader", "writer"}, dead.text
    main = next(t for t in v.analysis.threads if t.name == "MainThread")
    assert main.kind == "join" and main.frames[0].name == "_shutdown", main
    assert "likely deadlock: 2 threads blocked acquiring locks" in dead.text
    assert '"MainThread" waits for them in Thread.join' in dead.text
    if sys.version_info >= (3, 11):
        assert "(waiting on 2 different locks)" in dead.text
    else:  # no native thread id before 3.11 (py-spy #567): the process-wide evidence, in words
        assert " (thread ids not joinable on Python 3.10 (py-spy #567): all 4 tasks read asleep" in dead.text
    cpu = "0% CPU" if sys.version_info >= (3, 11) else "CPU ?"  # per-thread CPU needs the tid
    assert f'"MainThread" (S, {cpu}) waiting in Thread.join at _shutdown (threading.py:' in explanation(v)


def test_lock_cycle_through_the_import_lock(rank: Callable, tmp_path: Path) -> None:
    """A cycle of a threading.Lock and the import lock. Up to 3.12 the import lock is a
    PyThread lock with its own futex word: two words, two locks. On 3.13 it is a PyMutex: its
    waiter parks in CPython's parking lot on a semaphore on its own stack, so the futex word
    names the waiter, not the lock; the explanation says what it cannot tell instead of
    counting that word as a lock."""
    p, _ = rank("import_lock")
    tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
    v = until_stalled(tracker, p.pid, heartbeat_path(tmp_path), want="deadlock")
    assert v.analysis is not None
    dead = next(x for x in v.analysis.patterns if x.kind == "deadlock")
    print(dead.text)
    assert set(dead.threads) == {"holder", "other"}, dead.text
    assert '"MainThread" waits for them in Thread.join' in dead.text
    if sys.version_info >= (3, 13):
        other = next(t for t in v.analysis.threads if t.name == "other")
        assert other.parked and other.futex is None, other
        assert (
            ' ("other" parked in CPython\'s parking lot (a PyMutex wait, Python 3.13+, e.g. the '
            "import lock): its futex word is on its own stack, so which lock it waits on is "
            'unknown); "MainThread" waits'
        ) in dead.text
        assert "different locks" not in dead.text  # one lock's word is known: no count of locks
    elif sys.version_info >= (3, 11):
        assert "(waiting on 2 different locks)" in dead.text
    else:
        assert " (thread ids not joinable on Python 3.10 (py-spy #567): all 4 tasks read asleep" in dead.text
    if sys.version_info < (3, 13):
        assert "parking lot" not in dead.text
