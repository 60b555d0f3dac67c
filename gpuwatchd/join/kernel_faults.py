"""The kernel's last words about user processes' fatal faults (segfault, general protection, traps),
kept by PID for the exit join: the kernel prints them before the signal kills the process, so they
wait here until the exit watcher reads the exit (join/exits.py).

Fed by the kernel-log thread (join/kernel_events.py ``handle``), read by the exits part; shared
through ``Services.faults``. Bounded: the last ``limit`` lines (the kernel rate-limits them too,
show_signal_msg: printk_ratelimit). Thread-safe. No I/O.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelFault:
    pid: int
    comm: str
    time: float  # Unix seconds of the kernel record
    words: str  # "segfault at 1 ip 00007f4f84f74219 error 4 in libc.so.6"


class KernelFaults:
    # A fault line is printed while the faulting task handles the signal, milliseconds before it
    # exits; a line older than this is another process's that had the PID before.
    WINDOW_SECONDS = 60.0

    def __init__(self, limit: int = 1024) -> None:
        self._lock = threading.Lock()
        self._faults: deque[KernelFault] = deque(maxlen=limit)

    def record(self, fault: KernelFault) -> None:
        with self._lock:
            self._faults.append(fault)

    def lookup(self, pid: int, exit_time: float) -> KernelFault | None:
        """The last fault line of ``pid`` within WINDOW_SECONDS before its exit (a second after,
        for a record whose timestamp was rounded later than the watcher's wake)."""
        with self._lock:
            for f in reversed(self._faults):
                if f.pid == pid and exit_time - self.WINDOW_SECONDS <= f.time <= exit_time + 1.0:
                    return f
        return None
