"""One py-spy run as a child process: its own session, SIGKILLed as a group at the time-out.

``spawn`` is a plain function of what it needs (``PySpy._run``, sources/pyspy.py, calls it): the
run is spawned with a minimal environment (as ``run_as`` when set), waited for with
``waitid(WNOWAIT)`` so its pid cannot be reused before the timer is cancelled, reaped through the
child registry it is given (``reaper``, sources/reaper.py), what it left outside its group is
swept and reported to ``on_strays``, and its stdout/stderr are read up to ``output_cap_bytes``.
Errors are raised as ``PySpyError``; counting them is the caller's. Cost: one fork/exec and one
timer thread a run, and a look every ``POLL_SECONDS`` while it runs at the child's
``/proc/PID/statm`` and output sizes.

The child itself is bounded: a hostile rank (500 threads x 300 frames) made one
``dump`` grow to 265 MB RSS and 125 MB of JSON, over the unit's MemoryMax, before any cap applied.
Now the run is killed as soon as its RSS passes ``MAX_RSS_BYTES`` or its stdout/stderr pass
``output_cap_bytes`` (py-spy's RSS grows about 20 MB/s while it walks such a target, so a look
every 50 ms overshoots by about 1 MB). An rlimit or a cgroup of its own is not available to the
unit: its seccomp filter denies ``@resources`` (setrlimit, prlimit64) and ProtectControlGroups=
makes the cgroup tree read-only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from gpuwatchd.sources.pyspy_output import (
    ABSENT,
    OUTPUT_TOO_LARGE,
    PERMISSION_DENIED,
    PySpyError,
    RunResult,
)
from gpuwatchd.sources.reaper import ChildReaper

# At most two runs at once (gil.max_concurrent's default) of this size, beside the daemon's own
# ~60-100 MB, stay inside the unit's MemoryMax=256M; a dump of a 200-thread rank needs ~15 MB.
MAX_RSS_BYTES = 64 << 20
POLL_SECONDS = 0.05
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes(pid: int) -> int:
    """The child's resident set (our own child: read in our /proc, whatever the watched one)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read(128).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _over(pid: int, files: tuple[IO[bytes], ...], output_cap: int, rss_cap: int) -> str:
    """Why a running child must be killed now ("" while it is within its bounds)."""
    rss = _rss_bytes(pid)
    if rss > rss_cap:
        return (
            f"py-spy grew to {rss >> 20} MiB RSS, over its {rss_cap >> 20} MiB cap (the "
            "target's stacks are too large to dump); killed"
        )
    for f in files:
        size = os.fstat(f.fileno()).st_size
        if size > output_cap:
            return f"py-spy wrote more than {output_cap} bytes; killed"
    return ""


def spawn(
    argv: list[str],
    timeout: float,
    *,
    reaper: ChildReaper,
    output_cap_bytes: int,
    run_as: tuple[int, int] | None = None,
    on_strays: Callable[[int], None] | None = None,
    max_rss_bytes: int = MAX_RSS_BYTES,
) -> RunResult:
    """Run ``argv`` in its own session; SIGKILL the whole group at ``timeout``.

    The child is waited for with ``waitid(WNOWAIT)`` so that it stays a zombie (its pid and
    process group cannot be reused) until the time-out timer is cancelled; then ``wait4``
    reaps it and gives its CPU usage. ``run_as``: (uid, gid) to run as (needs root);
    ``on_strays(n)``: told how many processes the run left outside its group (killed and reaped),
    when there were any, before its output is read.
    """
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"}
    kw: dict[str, Any] = {}
    if run_as is not None:
        kw.update(user=run_as[0], group=run_as[1], extra_groups=[])
    import tempfile  # here, not at the top: it imports shutil, bz2, lzma

    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        t0 = time.monotonic()
        try:
            with reaper.spawning() as live:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    **kw,
                )
                live.add(proc.pid)
            reaper.note_helper(proc.pid, "py-spy")
        except FileNotFoundError as e:
            raise PySpyError(ABSENT, f"{argv[0]}: {e.strerror}") from e
        except PermissionError as e:
            raise PySpyError(PERMISSION_DENIED, f"{argv[0]}: {e.strerror}") from e
        timed_out = threading.Event()

        def kill_group() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill_group)
        timer.daemon = True
        timer.start()
        capped = ""
        try:
            while True:
                try:
                    flags = os.WEXITED | os.WNOWAIT | (os.WNOHANG if not capped else 0)
                    if os.waitid(os.P_PID, proc.pid, flags) is not None:
                        break
                except InterruptedError:
                    continue
                capped = _over(proc.pid, (out_f, err_f), output_cap_bytes, max_rss_bytes)
                if capped:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                else:
                    time.sleep(POLL_SECONDS)
        finally:
            timer.cancel()
        if timed_out.is_set() or capped:
            # the leader is dead; make sure nothing it started survives in its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        status, rusage = reaper.reap(proc.pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        # whatever the run left outside its group (a helper that called setsid) was
        # reparented to the daemon (a child subreaper): kill and reap it now
        strays = reaper.sweep()
        if strays and on_strays is not None:
            on_strays(strays)
        wall = time.monotonic() - t0
        if capped and not timed_out.is_set():
            raise PySpyError(OUTPUT_TOO_LARGE, capped)
        return RunResult(
            returncode=proc.returncode,
            stdout=_read_capped(out_f, output_cap_bytes),
            stderr=_read_capped(err_f, output_cap_bytes),
            wall_seconds=wall,
            cpu_seconds=rusage.ru_utime + rusage.ru_stime,
            timed_out=timed_out.is_set(),
        )


def _read_capped(f: IO[bytes], cap: int) -> bytes:
    f.seek(0)
    data = f.read(cap + 1)
    if len(data) > cap:
        raise PySpyError(OUTPUT_TOO_LARGE, f"> {cap} bytes")
    return data
