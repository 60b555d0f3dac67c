"""The daemon's own children: py-spy runs, and whatever a run leaves behind, killed and reaped.

Every py-spy run is its own session and is SIGKILLed as a group at its time-out, but a helper at
``gil.pyspy_path`` that calls ``setsid()`` (or double-forks) leaves that group, and would outlive
the kill as an orphan adopted by init (measured: 27 orphans in 30 s). So the daemon makes itself a
*child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux >= 3.4): an orphan anywhere below a
run is reparented to the daemon instead of init. It is then the daemon's own child, its pid
cannot be reused before the daemon reaps it, and killing it by pid is safe. ``sweep`` SIGKILLs and
reaps every child of the daemon that is not a registered, still running spawn.

That rule needs a process whose every child is spawned through ``spawning``: the daemon (only
py-spy spawns; ``gpuwatchd run`` passes ``Daemon(reap_strays=True)``). A library user or a test
process that starts children of its own never enables it, and then only the process-group kill
applies.

Reads: ``/proc/self/task/*/children`` (one small read per daemon thread) after each run.
Privilege: none (a process may always signal and reap its own children).
Shell equivalent: ``cat /proc/$PID/task/*/children``; ``kill -9 CHILD``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from gpuwatchd.sources.procfs import thread_children

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
MAX_ROUNDS = 16  # an orphan's own children are reparented to us when it dies: sweep again
REAP_WAIT_SECONDS = 1.0  # SIGKILLed processes exit at once unless in uninterruptible sleep
RECENT_HELPERS = 256
HELPER_SLACK_SECONDS = 5.0  # the kill's log time vs. our clock at spawn and reap


class ChildReaper:
    """Registry of the spawns that are running, and the sweeper of everything else."""

    def __init__(self, procfs_self: str = "/proc/self") -> None:
        self.procfs_self = procfs_self
        self.enabled = False
        self.killed = 0  # strays killed since start
        self._lock = threading.Lock()
        self._sweep_lock = threading.Lock()
        self._live: set[int] = set()
        self._warned = False
        # pid -> (helper name, started, ended or None) of the last RECENT_HELPERS spawns: a kernel
        # OOM kill of one of them is the daemon's own helper, never a node OOM kill
        self._helpers: dict[int, tuple[str, float, float | None]] = {}

    def enable(self) -> bool:
        """Become a child subreaper; False (and the group kill alone) where the kernel refuses."""
        try:
            # The process's own symbols, libc's among them: ctypes.util.find_library would import
            # shutil, tempfile and subprocess and may run ldconfig (bench/rss.py).
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
        if not ok:
            log.warning(
                "cannot become a child subreaper (prctl: %s): a py-spy helper that leaves "
                "its process group may survive its time-out",
                os.strerror(ctypes.get_errno()),
            )
        self.enabled = ok
        return ok

    @contextlib.contextmanager
    def spawning(self) -> Iterator[set[int]]:
        """Hold the registry while a child is forked: add its pid to the yielded set before
        leaving, so that a sweep never sees it unregistered."""
        with self._lock:
            yield self._live

    def reap(self, pid: int) -> tuple[int, Any]:
        """Reap a registered child (``wait4``) and unregister it in one step, so a sweep can
        neither reap it first nor see a reused pid as ours."""
        with self._lock:
            try:
                _, status, rusage = os.wait4(pid, 0)
            finally:
                self._live.discard(pid)
                helper = self._helpers.get(pid)
                if helper is not None:
                    self._helpers[pid] = (helper[0], helper[1], time.time())
        return status, rusage

    def note_helper(self, pid: int, name: str) -> None:
        """Remember that ``pid`` is (from now) the daemon's helper ``name``."""
        with self._lock:
            self._helpers.pop(pid, None)
            self._helpers[pid] = (name, time.time(), None)
            while len(self._helpers) > RECENT_HELPERS:
                del self._helpers[next(iter(self._helpers))]

    def helper_at(self, pid: int, when: float) -> str | None:
        """The name of the daemon's helper that was ``pid`` at Unix time ``when``, or None."""
        with self._lock:
            helper = self._helpers.get(pid)
        if helper is None:
            return None
        name, started, ended = helper
        if when < started - HELPER_SLACK_SECONDS:
            return None
        return name if ended is None or when <= ended + HELPER_SLACK_SECONDS else None

    def children(self) -> list[int]:
        return thread_children(os.path.join(self.procfs_self, "task"), 1 << 20)

    def sweep(self) -> int:
        """Kill and reap every child that is not a running spawn; returns how many."""
        if not self.enabled:
            return 0
        # One sweep at a time: two concurrent sweeps list the same stray, one reaps it, and the
        # other's SIGKILL could then reach a process that reused its pid.
        with self._sweep_lock:
            return self._sweep()

    def _sweep(self) -> int:
        total = 0
        for _ in range(MAX_ROUNDS):
            with self._lock:
                strays = [pid for pid in set(self.children()) if pid not in self._live]
            if not strays:
                break
            for pid in strays:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + REAP_WAIT_SECONDS
            pending = set(strays)
            while pending and time.monotonic() < deadline:
                for pid in list(pending):
                    try:
                        done, _ = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        done = pid  # reaped meanwhile (or not ours after all)
                    if done:
                        pending.discard(pid)
                if pending:
                    time.sleep(0.005)
            total += len(strays) - len(pending)
        if total:
            self.killed += total
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(
                level,
                "killed and reaped %d process(es) that a py-spy run left behind outside its process group (%d so far)",
                total,
                self.killed,
            )
        return total


# The subreaper attribute belongs to the process, so there is one registry per process.
CHILDREN = ChildReaper()
