"""A real second user for trust tests: created with useradd (retried while another test holds
/etc/passwd's lock), removed by the last test run that uses it (runs in parallel share it) when a
test created it, and commands run as that user."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def run_locked(cmd: list[str]) -> None:
    """useradd/userdel, retried while another process holds /etc/passwd's lock (and, for userdel,
    while a process of the user is still exiting: a killed rank is gone a moment later)."""
    for _ in range(50):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return
        if "lock" not in out.stderr and "currently used by process" not in out.stderr:
            raise AssertionError(f"{cmd}: {out.stderr}")
        time.sleep(0.2)
    raise AssertionError(f"{cmd}: /etc/passwd stayed locked or the user's processes stayed: {out.stderr}")


def _kill_processes_of(uid: int) -> None:
    """SIGKILL what still runs as ``uid``: a user these tests created, so every process of it
    was started by them (left over from a test that failed half way)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            status = (entry / "status").read_text()
            real = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
            if real == uid:
                os.kill(int(entry.name), signal.SIGKILL)


# Marks the users system_user made (the GECOS field): only those are ever removed.
TEST_USER_COMMENT = "gpuwatchd test user"
SETUP_LOCK = "/run/lock/gw-test-users.setup"


def use_lock_path(name: str) -> str:
    """The lock file every run in ``system_user(name)`` holds shared (kept: its name is fixed)."""
    return f"/run/lock/gw-test-user-{name}.use"


@contextlib.contextmanager
def _flock(path: str, how: int) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, how)
        yield  # closing the file releases the lock


@contextlib.contextmanager
def system_user(name: str) -> Iterator[int]:
    """The uid of user ``name``, created for the block when absent.

    Several test runs (the suite on two Pythons at once, other engineers' suites on a shared
    machine) use the same names at the same time: each holds a shared lock on
    ``/run/lock/gw-test-user-NAME.use`` while in the block, and only the last one out (which gets
    it exclusively) kills what still runs as the user and removes it, and only when a test made
    it. A second lock (``/run/lock/gw-test-users.setup``, one for all names) makes creating and
    removing one step each, so nobody joins between the last one's check and its userdel.
    (Before, the run that had created the user removed it when it left, killing another run's
    processes of it mid-test.)"""
    with contextlib.ExitStack() as stack:
        with _flock(SETUP_LOCK, fcntl.LOCK_EX):
            if subprocess.run(["id", "-u", name], capture_output=True, timeout=10).returncode != 0:
                run_locked(
                    [
                        "useradd",
                        "--system",
                        "--no-create-home",
                        "--shell",
                        "/usr/sbin/nologin",
                        "--comment",
                        TEST_USER_COMMENT,
                        name,
                    ]
                )
            uid = int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True, timeout=10).stdout)
            use = stack.enter_context(open(use_lock_path(name), "a"))
            fcntl.flock(use, fcntl.LOCK_SH)
        try:
            yield uid
        finally:
            with _flock(SETUP_LOCK, fcntl.LOCK_EX):
                if _last_one_out(use.fileno()) and _made_by_tests(name):
                    _kill_processes_of(uid)
                    run_locked(["userdel", name])


def _made_by_tests(name: str) -> bool:
    try:
        return pwd.getpwnam(name).pw_gecos == TEST_USER_COMMENT
    except KeyError:  # already removed
        return False


def _last_one_out(fd: int) -> bool:
    """Whether no other run holds the user (a failed try may drop our shared lock: we are leaving)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def setpriv(user: str) -> list[str]:
    """The command prefix that runs what follows as ``user`` (its uid and gid, no other groups)."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]


def as_user(user: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*setpriv(user), *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )


def user_writes(user: str, path: Path, content: str | bytes) -> None:
    """Write ``content`` to ``path`` as ``user`` (bytes are passed hex-encoded, exactly)."""
    data = content.hex() if isinstance(content, bytes) else content.encode().hex()
    out = as_user(
        user,
        "/usr/bin/python3",
        "-c",
        "import sys; open(sys.argv[1], 'wb').write(bytes.fromhex(sys.stdin.read()))",
        str(path),
        stdin=data,
    )
    assert out.returncode == 0, out.stderr


def users_fixture(*names: str) -> Any:
    """A module-scoped fixture of the uids of real users ``names`` (system_user each), for a test
    module to bind: ``users = users_fixture(U1, U2)``; with one name, the uid alone."""

    @pytest.fixture(scope="module")
    def users() -> Iterator[Any]:
        with contextlib.ExitStack() as stack:
            uids = tuple(stack.enter_context(system_user(n)) for n in names)
            yield uids[0] if len(uids) == 1 else uids

    return users


def rank_world_fixture(prefix: str) -> Any:
    """A fixture of a shared_rank_world(``prefix``) per test: ``world = rank_world_fixture("gw-x-")``."""

    @pytest.fixture
    def world() -> Iterator[Path]:
        with shared_rank_world(prefix) as d:
            yield d

    return world


@contextlib.contextmanager
def shared_rank_world(prefix: str) -> Iterator[Path]:
    """A directory a second user can reach (pytest's tmp_path is root-only), with ranks/ 1777 as
    the shipped rank_dir is; removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    (d / "ranks").mkdir()
    (d / "ranks").chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
