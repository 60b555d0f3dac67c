"""One py-spy run as a child process: its own session, SIGKILLed as a group at the time-out.

``PySpy`` inherits this (sources/pyspy.py): the run is spawned with a minimal environment (as
``run_as`` when set), waited for with ``waitid(WNOWAIT)`` so its pid cannot be reused before the
timer is cancelled, reaped through the daemon's child registry (sources/reaper.py), and its
stdout/stderr are read up to ``output_cap_bytes``. Cost: one fork/exec and one timer thread a run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any

from gpuwatchd.sources.pyspy_output import (
    ABSENT,
    OUTPUT_TOO_LARGE,
    PERMISSION_DENIED,
    PySpyError,
    RunResult,
)
from gpuwatchd.sources.reaper import ChildReaper


class SpawnMixin:
    """The process side of ``PySpy``: what of it a run reads and counts into."""

    run_as: tuple[int, int] | None
    reaper: ChildReaper
    output_cap_bytes: int
    stats: Any  # PySpyStats (sources/pyspy.py)
    _stats_lock: threading.Lock

    def _count(self, err: PySpyError) -> PySpyError:
        raise NotImplementedError

    def _spawn(self, argv: list[str], timeout: float) -> RunResult:
        """Run ``argv`` in its own session; SIGKILL the whole group at ``timeout``.

        The child is waited for with ``waitid(WNOWAIT)`` so that it stays a zombie (its pid and
        process group cannot be reused) until the time-out timer is cancelled; then ``wait4``
        reaps it and gives its CPU usage.
        """
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "RUST_BACKTRACE": "0",
               "RUST_LIB_BACKTRACE": "0"}  # fmt: skip
        kw: dict[str, Any] = {}
        if self.run_as is not None:
            kw.update(user=self.run_as[0], group=self.run_as[1], extra_groups=[])
        import tempfile  # here, not at the top: it imports shutil, bz2, lzma

        with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
            t0 = time.monotonic()
            try:
                with self.reaper.spawning() as live:
                    proc = subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, env=env,
                        start_new_session=True, close_fds=True, **kw,
                    )  # fmt: skip
                    live.add(proc.pid)
            except FileNotFoundError as e:
                raise self._count(PySpyError(ABSENT, f"{argv[0]}: {e.strerror}")) from e
            except PermissionError as e:
                raise self._count(PySpyError(PERMISSION_DENIED, f"{argv[0]}: {e.strerror}")) from e
            timed_out = threading.Event()

            def kill_group() -> None:
                timed_out.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill_group)
            timer.daemon = True
            timer.start()
            try:
                while True:
                    try:
                        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                        break
                    except InterruptedError:
                        continue
            finally:
                timer.cancel()
            if timed_out.is_set():
                # the leader is dead; make sure nothing it started survives in its group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            status, rusage = self.reaper.reap(proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            # whatever the run left outside its group (a helper that called setsid) was
            # reparented to the daemon (a child subreaper): kill and reap it now
            strays = self.reaper.sweep()
            if strays:
                with self._stats_lock:
                    self.stats.strays_killed += strays
            wall = time.monotonic() - t0
            return RunResult(
                returncode=proc.returncode,
                stdout=self._read_file(out_f),
                stderr=self._read_file(err_f),
                wall_seconds=wall,
                cpu_seconds=rusage.ru_utime + rusage.ru_stime,
                timed_out=timed_out.is_set(),
            )

    def _read_file(self, f: Any) -> bytes:
        f.seek(0)
        data: bytes = f.read(self.output_cap_bytes + 1)
        if len(data) > self.output_cap_bytes:
            raise self._count(PySpyError(OUTPUT_TOO_LARGE, f"> {self.output_cap_bytes} bytes"))
        return data
