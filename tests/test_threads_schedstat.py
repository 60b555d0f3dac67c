"""sources/threads.py's schedstat readers on real processes: ``read_threads_since`` gives the same
view as ``read_threads`` while reading ``stat``/``wchan`` only of the tasks that ran, and
``read_run_slices`` tells a task that ran from one that did not (the stall tracker's proof)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import threads as th

SRC = textwrap.dedent("""
    import threading, time
    threading.Thread(target=threading.Event().wait, name="idle", daemon=True).start()
    def busy():
        while True:
            sum(range(1000))
    threading.Thread(target=busy, name="busy", daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
""")


@pytest.fixture
def proc() -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", SRC], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    yield p
    p.kill()
    p.wait()


def _roles(pid: int, threads: tuple[th.ThreadInfo, ...]) -> tuple[int, int]:
    """(the busy thread's tid, the idle one's): comm is "python" for all on 3.10-3.13."""
    others = sorted((t for t in threads if t.tid != pid), key=lambda t: t.cpu_ticks)
    assert len(others) == 2 and others[1].cpu_ticks > others[0].cpu_ticks
    return others[1].tid, others[0].tid


def test_read_threads_since_reuses_only_what_did_not_run(proc: subprocess.Popen[str]) -> None:
    paths = HostPaths()
    tids = th.task_ids(paths, proc.pid)
    first, slices = th.read_threads_since(paths, proc.pid, tids, {})
    full = th.read_threads(paths, proc.pid, detail=False, tids=tids)
    assert [(t.tid, t.comm, t.wchan) for t in first] == [(t.tid, t.comm, t.wchan) for t in full]
    assert set(slices) == set(tids)
    time.sleep(0.3)
    prev = {t.tid: (slices[t.tid], t) for t in first}
    second, slices2 = th.read_threads_since(paths, proc.pid, tids, prev)
    busy, idle = _roles(proc.pid, first)
    now = {t.tid: t for t in second}
    old = {t.tid: t for t in first}
    assert now[idle] is old[idle] and slices2[idle] == slices[idle]
    assert now[busy] is not old[busy] and now[busy].cpu_ticks > old[busy].cpu_ticks


def test_read_run_slices_sees_a_task_that_ran(proc: subprocess.Popen[str]) -> None:
    paths = HostPaths()
    tids = th.task_ids(paths, proc.pid)
    a = th.read_run_slices(paths, proc.pid, tids)
    time.sleep(0.2)
    b = th.read_run_slices(paths, proc.pid, tids)
    assert a is not None and b is not None
    busy, idle = _roles(proc.pid, th.read_threads(paths, proc.pid, detail=False, tids=tids))
    assert a[busy] != b[busy] and a[idle] == b[idle]
    assert th.read_run_slices(paths, proc.pid, [*tids, 999_999_999]) is None  # a task gone
