"""Where each thread of a process waits in the kernel: ``/proc/PID/task/TID/syscall``.

A thread blocked in ``futex(2)`` shows ``202 ADDR OP VAL TIMEOUT ...`` (x86-64 numbering; aarch64
uses 98). ``threading.Lock.acquire()`` without a time-out parks in ``FUTEX_WAIT_BITSET|PRIVATE``
(op 0x189) with a NULL time-out on the lock's own futex word, so two threads waiting on *different*
addresses wait on different locks; the GIL condvar is a timed wait (research gil-hang-oom.md
§2.3). Only the number, the first address and whether a time-out was given are kept.

Reads: one small file per thread (only for processes already judged stuck). Privilege:
PTRACE_MODE_ATTACH on the target (same uid or CAP_SYS_PTRACE), like py-spy; unreadable -> no entry.
``context_switches`` reads ``/proc/PID/status`` (no privilege) of a rank's worker process: a
worker that is not woken once between two looks is blocked.
Shell equivalent: ``for t in /proc/PID/task/*; do echo $t $(cat $t/syscall); done``;
``grep ctxt_switches /proc/PID/status``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.paths import HostPaths

# os.uname() is what platform.machine() reads (platform itself is not worth importing)
FUTEX_NR = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine, 202)


@dataclass(frozen=True)
class SyscallWait:
    nr: int  # -1: blocked outside a system call
    address: int | None  # first argument (the futex word for futex)
    timed: bool  # a time-out argument was given (futex: arg 4 non-NULL)

    @property
    def futex(self) -> bool:
        return self.nr == FUTEX_NR

    @property
    def untimed_futex(self) -> bool:
        """Parked on a futex with no time-out: a lock or condition wait with no deadline."""
        return self.futex and not self.timed


def parse_syscall(text: str) -> SyscallWait | None:
    """``202 0x7f.. 0x189 0x0 0x0 ...`` -> SyscallWait; ``running`` or junk -> None."""
    parts = text.split()
    if not parts or parts[0] == "running":
        return None
    try:
        nr = int(parts[0])
        args = [int(p, 16) for p in parts[1:7]]
    except ValueError:
        return None
    if nr < 0 or len(args) < 4:
        return SyscallWait(nr, None, False)
    return SyscallWait(nr, args[0], args[3] != 0)


def read_waits(paths: HostPaths, pid: int, tids: Iterable[int]) -> Mapping[int, SyscallWait]:
    """tid -> where it waits, for the tids given; vanished or unreadable threads are left out."""
    out: dict[int, SyscallWait] = {}
    for tid in tids:
        try:
            with open(paths.proc(pid, "task", tid, "syscall"), "rb") as f:
                text = f.read(512).decode("ascii", "replace")
        except OSError:
            continue
        w = parse_syscall(text)
        if w is not None:
            out[tid] = w
    return out


def context_switches(paths: HostPaths, pid: int) -> int | None:
    """Voluntary + involuntary context switches of ``pid``'s main thread; None when unreadable."""
    try:
        with open(paths.proc(pid, "status"), "rb") as f:
            text = f.read(8192).decode("ascii", "replace")
    except OSError:
        return None
    total = None
    for line in text.splitlines():
        if line.endswith("ctxt_switches:") or "ctxt_switches:" in line:
            try:
                total = (total or 0) + int(line.split(":", 1)[1])
            except ValueError:
                return None
    return total
