"""tests/userutil.py's system_user when two test runs use one user name at once (the suite on
two Pythons in parallel): real useradd/userdel, real processes of the user, real flock."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from userutil import system_user, use_lock_path

TESTS = str(Path(__file__).resolve().parent)
# One run of the suite: enters system_user(NAME), says "in"; optionally starts a process as the
# user and prints its PID; leaves when a line arrives on stdin.
RUN = """
import subprocess, sys
sys.path.insert(0, sys.argv[1])
from userutil import system_user, use_lock_path
with system_user(sys.argv[2]):
    print("in", flush=True)
    child = None
    if sys.argv[3] == "spawn":
        child = subprocess.Popen(["setpriv", f"--reuid={sys.argv[2]}", f"--regid={sys.argv[2]}",
                                  "--clear-groups", "/usr/bin/python3", "-c",
                                  "import time; time.sleep(120)"])
        print(child.pid, flush=True)
    sys.stdin.readline()
    if child is not None:
        child.kill()
        child.wait()
"""


def _run(name: str, spawn: bool) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", RUN, TESTS, name, "spawn" if spawn else "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline() == "in\n"
    return p


def _leave(p: subprocess.Popen[Any]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(60) == 0


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _exists(name: str) -> bool:
    return subprocess.run(["id", "-u", name], capture_output=True, timeout=10).returncode == 0


def test_the_run_that_made_the_user_leaves_first_without_harming_the_other() -> None:
    """Run A creates the user, run B uses it and starts a process as it, A leaves: B's process
    still runs and the user still exists; B, the last one out, removes the user."""
    name = f"gw-tu-{uuid.uuid4().hex[:8]}"
    a = _run(name, spawn=False)
    b = None
    try:
        b = _run(name, spawn=True)
        assert b.stdout is not None
        child = int(b.stdout.readline())
        _leave(a)
        assert _exists(name), "A removed the user B is in"
        assert _state(child) not in ("Z", "X", None), "A killed B's process of the user"
        _leave(b)
        assert not _exists(name)
        with system_user(name) as again:  # made afresh by the next run, and removed after it
            assert again >= 0 and _exists(name)
        assert not _exists(name)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        Path(use_lock_path(name)).unlink(missing_ok=True)  # the name was this test's alone
