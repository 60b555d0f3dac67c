"""The C allocator of the daemon process: fewer glibc arenas, and freed pages returned after
each cycle (measured: the daemon's RSS next to nvitop-exporter's).

- ``limit_arenas()`` at start, before any thread: ``mallopt(M_ARENA_MAX, 2)``. glibc gives each
  thread that allocates an arena of its own (up to 8 per core), whose touched pages stay resident
  after the thread's allocations are freed; the daemon's threads (web workers, collectors, NVML's
  calls and its Xid watcher, py-spy runners) allocate little, so two arenas serve them all.
- ``trim()`` after each cycle: ``malloc_trim(0)`` hands the free pages inside the arenas back to
  the kernel (a cycle's /proc text and parsed readings are freed by then). About 0.4 ms.

bench/rss.py measured both (bench/results/rss_2cpu_vm.txt). Cost otherwise: nothing. Neither
exists outside glibc (musl has no ``malloc_trim``): then both do nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

M_ARENA_MAX = -8  # glibc malloc.h
ARENAS = 2

_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None)
        except OSError:
            _libc = False
    return _libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """True when glibc took the limit."""
    libc = _c()
    fn = getattr(libc, "mallopt", None) if libc else None
    return bool(fn is not None and fn(M_ARENA_MAX, arenas) == 1)


def trim() -> None:
    libc = _c()
    fn = getattr(libc, "malloc_trim", None) if libc else None
    if fn is not None:
        fn(0)
