"""What a process's threads show, as values: py-spy's stacks (``Frame``, ``ThreadStack``), the
cheap /proc view of a task (``ThreadInfo``), where a thread waits in the kernel (``SyscallWait``)
and one stall look's py-spy dump (``Dump``). Read by sources/ (pyspy_output.py, threads.py,
taskwait.py), judged by join/ (stall.py, hang.py). No I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# os.uname() is what platform.machine() reads (platform itself is not worth importing)
FUTEX_NR = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine, 202)
# A parking-lot wait_entry is in the frame of _PyParkingLot_Park, right above the stack pointer of
# the futex call (0x100 bytes on 3.13.0 x86-64); a lock's own word is on the heap.
OWN_STACK_SPAN = 64 << 10


@dataclass(frozen=True)
class SyscallWait:
    nr: int  # -1: blocked outside a system call
    address: int | None  # first argument (the futex word for futex)
    timed: bool  # a time-out argument was given (futex: arg 4 non-NULL)
    sp: int | None = None  # the thread's user stack pointer in the system call

    @property
    def on_own_stack(self) -> bool:
        """A futex word on the waiter's own stack: a CPython parking-lot wait (3.13+), whose word
        is the waiter's semaphore and so does not say which lock it waits for."""
        return (
            self.futex
            and self.address is not None
            and self.sp is not None
            and 0 <= self.address - self.sp < OWN_STACK_SPAN
        )

    @property
    def futex(self) -> bool:
        return self.nr == FUTEX_NR

    @property
    def untimed_futex(self) -> bool:
        """Parked on a futex with no time-out: a lock or condition wait with no deadline."""
        return self.futex and not self.timed


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str  # short file name as py-spy prints it (``threading.py``)
    line: int | None

    def __str__(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})" if self.line else self.where

    @property
    def where(self) -> str:
        """Function and file without the line: what "the same place" means across dumps."""
        return f"{self.name} ({self.filename})" if self.filename else self.name


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a ``py-spy dump --json``; frames innermost first."""

    tid: int | None  # host thread id (mapped through NSpid); None when py-spy did not say
    ns_tid: int | None  # the id py-spy printed (namespace-local when the target is in a pid ns)
    name: str
    active: bool
    owns_gil: bool
    frames: tuple[Frame, ...] = ()


@dataclass(frozen=True)
class ThreadInfo:
    """One task of ``/proc/PID/task``: the cheap view (no ptrace)."""

    tid: int
    ns_tid: int  # innermost NSpid (== tid when the process is not in a nested pid namespace)
    comm: str
    state: str
    wchan: str  # "" when 0 / unreadable
    cpu_ticks: int  # utime + stime, clock ticks
    voluntary_switches: int
    involuntary_switches: int


@dataclass(frozen=True)
class Dump:
    """One non-blocking ``py-spy dump`` a stall look asked for: the stacks, or why there are none.
    ``error`` is "" on success; ``timed_out``: py-spy ran past its time-out; ``hopeless``: py-spy
    cannot help with this process at all (absent, not permitted, not Python)."""

    stacks: tuple[ThreadStack, ...] | None
    error: str = ""
    timed_out: bool = False
    hopeless: bool = False
