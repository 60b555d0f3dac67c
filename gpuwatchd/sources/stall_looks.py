"""The host reads of the stall tracker's looks (join/stall.py decides which are due; this module
performs them): a heartbeat file's mtime with the owner rule, a process's task ids, each task's
cheap view and run slices (``/proc/PID/task/TID/{stat,status,wchan,schedstat}``,
sources/threads.py), where its threads wait (``/proc/PID/task/TID/syscall``, sources/taskwait.py),
a worker's context switches (``/proc/PID/status``) and a non-blocking ``py-spy dump`` that never
waits for a py-spy slot (sources/pyspy.py).

Cost: as each of those modules says; the tracker bounds how many looks run per cycle.
Privilege: as sources/pyspy.py (dumps, syscall) and none for the /proc views of a rank of ours.
Shell equivalent: ``stat -c %Y HB``; ``cat /proc/PID/task/*/{stat,wchan,schedstat,syscall}``;
``py-spy dump --nonblocking -p PID``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from gpuwatchd.model.threads import Dump, SyscallWait, ThreadInfo
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import taskwait, threads
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import ABSENT, NOT_PYTHON, PERMISSION_DENIED, TIMEOUT, PySpyError


class StallLooks:
    """What ``StallTracker`` reads of the host, for one daemon (``spy``: its py-spy runner, None
    without py-spy; ``paths``: the host's /proc, by default the runner's)."""

    def __init__(
        self, spy: PySpy | None, paths: HostPaths | None = None, stat: Callable[[str], os.stat_result] = os.stat
    ) -> None:
        self.spy = spy
        self.paths = paths or (spy.paths if spy else HostPaths())
        self.stat = stat
        self.clk_tck = os.sysconf("SC_CLK_TCK")

    @property
    def can_dump(self) -> bool:
        return self.spy is not None and self.spy.available

    def heartbeat_mtime(self, path: str, owner_uid: int | None = None) -> float | None:
        """mtime, with the owner rule of sources/rankfiles.py checked at the moment of reading."""
        try:
            st = self.stat(path)
        except (OSError, ValueError):
            return None
        if owner_uid is not None and owner_uid != 0 and st.st_uid != owner_uid:
            return None
        return st.st_mtime

    def dump(self, pid: int) -> Dump:
        """A non-blocking dump; a busy py-spy slot (the GIL sampler may hold them) is an error
        this time, never a wait."""
        if self.spy is None or not self.spy.available:
            return Dump(None, "py-spy absent", hopeless=True)
        try:
            return Dump(self.spy.dump(pid, slot_wait=0.0))
        except PySpyError as e:
            return Dump(
                None,
                str(e),
                timed_out=e.reason == TIMEOUT,
                hopeless=e.reason in (ABSENT, PERMISSION_DENIED, NOT_PYTHON),
            )

    def task_ids(self, pid: int) -> list[int]:
        return threads.task_ids(self.paths, pid)

    def threads_since(
        self,
        pid: int,
        tids: Sequence[int],
        prev: Mapping[int, tuple[tuple[int, int], ThreadInfo]],
    ) -> tuple[tuple[ThreadInfo, ...], dict[int, tuple[int, int]]]:
        return threads.read_threads_since(self.paths, pid, tids, prev)

    def run_slices(self, pid: int, max_tasks: int) -> dict[int, tuple[int, int]] | None:
        return threads.read_run_slices(self.paths, pid, max_tasks=max_tasks)

    def schedstat(self, pid: int, tid: int) -> tuple[int, int] | None:
        return threads.read_schedstat(self.paths, pid, tid)

    def waits(self, pid: int, tids: Iterable[int]) -> Mapping[int, SyscallWait]:
        return taskwait.read_waits(self.paths, pid, tids)

    def context_switches(self, pid: int) -> int | None:
        return taskwait.context_switches(self.paths, pid)

    def thread_count(self, pid: int) -> int | None:
        got = threads.process_cpu(self.paths, pid)
        return got[1] if got is not None else None
