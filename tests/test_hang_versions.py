"""The daemon's Python is not the rank's: a rank deadlocked (seed 003) on each CPython the
project supports, analysed by this interpreter's gpuwatchd with the real py-spy and /proc. A node's
daemon runs the distribution's Python while a training venv may run 3.13; what the analysis can
tell depends on the rank's version, never the daemon's. Each rank runs the pyenv build of its
version (or python3.X on PATH) with this checkout on PYTHONPATH (the rank side of gpuwatchd needs
only the standard library); where a version is absent the rank runs on this interpreter and the
expectations follow the version it really ran."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_hang import AFTER, CYCLE, PROGRAMS, explanation, heartbeat_path, until_stalled

from gpuwatchd.join.stall import StallTracker
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.stall_looks import StallLooks

ROOT = Path(__file__).resolve().parent.parent


def interpreter(version: str) -> str:
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    builds = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    return (builds[-1] if builds else None) or shutil.which(f"python{version}") or sys.executable


@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13"])
def test_a_deadlocked_rank_on_each_python(version: str, tmp_path: Path) -> None:
    py = interpreter(version)
    ran = tuple(
        int(x)
        for x in subprocess.run(
            [py, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [py, str(PROGRAMS / "hang_rank.py"), "deadlock", str(tmp_path), "hang-job", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        tracker = StallTracker(AFTER, StallLooks(PySpy(pyspy.resolve_pyspy())), dump_interval_seconds=CYCLE)
        v = until_stalled(tracker, p.pid, heartbeat_path(tmp_path), want="deadlock")
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert v.analysis is not None
    dead = next(x for x in v.analysis.patterns if x.kind == "deadlock")
    text = explanation(v)
    print(ran, text)
    assert set(dead.threads) == {"loader", "writer"}, (ran, dead.text)
    assert '"MainThread" waits for them in Thread.join' in dead.text
    main = next(t for t in v.analysis.threads if t.name == "MainThread")
    assert main.kind == "join", main
    if ran >= (3, 13):  # Thread.join waits in _ThreadHandle.join (C), a parking-lot PyEvent
        assert main.frames[0].name == "Thread.join" and main.parked, main
        assert "(waiting on 2 different locks)" in dead.text  # threading.Lock: the lock's own sem_t
    elif ran >= (3, 11):
        assert main.frames[0].name == "Thread._wait_for_tstate_lock" and not main.parked, main
        assert "(waiting on 2 different locks)" in dead.text
    else:  # no thread ids (py-spy #567), no qualified names (co_qualname)
        assert main.frames[0].name == "_wait_for_tstate_lock", main
        assert " (thread ids not joinable on Python 3.10 (py-spy #567): all 4 tasks read asleep" in dead.text
    assert "parking lot" not in text  # the joiner's parked wait is no lock's evidence
