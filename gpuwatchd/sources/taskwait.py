"""Where each thread of a process waits in the kernel: ``/proc/PID/task/TID/syscall``.

A thread blocked in ``futex(2)`` shows ``202 ADDR OP VAL TIMEOUT ...`` (x86-64 numbering; aarch64
uses 98). ``threading.Lock.acquire()`` without a time-out parks in ``FUTEX_WAIT_BITSET|PRIVATE``
(op 0x189) with a NULL time-out on the lock's own futex word, so two threads waiting on *different*
addresses wait on different locks; the GIL condvar is a timed wait (research gil-hang-oom.md
§2.3). CPython 3.13's parking lot (Python/parking_lot.c: ``Thread.join`` through
``_ThreadHandle``/PyEvent, the import lock and other PyMutex waits) parks each waiter on a
semaphore in a ``wait_entry`` on the waiter's own stack: that futex word lies a few hundred bytes
above the thread's stack pointer (the file's 8th field) and names the waiter, not the lock
(``on_own_stack``). Only the number, the first address, the stack pointer and whether a time-out
was given are kept.

Reads: one small file per thread (only for processes already judged stuck). Privilege:
PTRACE_MODE_ATTACH on the target (same uid or CAP_SYS_PTRACE), like py-spy; unreadable -> no entry.
``context_switches`` reads ``/proc/PID/status`` (no privilege) of a rank's worker process: a
worker that is not woken once between two looks is blocked.
Shell equivalent: ``for t in /proc/PID/task/*; do echo $t $(cat $t/syscall); done``;
``grep ctxt_switches /proc/PID/status``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuwatchd.model.threads import SyscallWait
from gpuwatchd.paths import HostPaths, read_bounded


def parse_syscall(text: str) -> SyscallWait | None:
    """``202 0x7f.. 0x189 0x0 0x0 0x0 0x.. SP PC`` -> SyscallWait; ``running`` or junk -> None."""
    parts = text.split()
    if not parts or parts[0] == "running":
        return None
    try:
        nr = int(parts[0])
        args = [int(p, 16) for p in parts[1:9]]
    except ValueError:
        return None
    if nr < 0 or len(args) < 4:
        return SyscallWait(nr, None, False)
    return SyscallWait(nr, args[0], args[3] != 0, args[6] if len(args) > 6 else None)


def read_waits(paths: HostPaths, pid: int, tids: Iterable[int]) -> Mapping[int, SyscallWait]:
    """tid -> where it waits, for the tids given; vanished or unreadable threads are left out."""
    out: dict[int, SyscallWait] = {}
    for tid in tids:
        try:
            text = read_bounded(paths.proc(pid, "task", tid, "syscall"), 512).decode("ascii", "replace")
        except OSError:
            continue
        w = parse_syscall(text)
        if w is not None:
            out[tid] = w
    return out


def context_switches(paths: HostPaths, pid: int) -> int | None:
    """Voluntary + involuntary context switches of ``pid``'s main thread; None when unreadable."""
    try:
        text = read_bounded(paths.proc(pid, "status"), 8192).decode("ascii", "replace")
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
