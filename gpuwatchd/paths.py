"""Host filesystem roots: the only place that says "/proc", "/sys" or "/dev"; and the one bounded
read of a host file (``read_bounded``).

Every source takes a ``HostPaths`` so that the daemon can run in a container with the host's
``/proc`` mounted elsewhere, and so that tests can point it at a recorded tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class HostPaths:
    procfs: str = "/proc"
    sysfs: str = "/sys"
    devfs: str = "/dev"
    rootfs: str = "/"

    def proc(self, *parts: object) -> str:
        """``proc(1234, "status")`` -> ``/proc/1234/status``."""
        # hot path (several calls per watched process per cycle): plain joining, no os.path.join
        return "/".join([self.procfs.rstrip("/"), *map(str, parts)])

    def sys(self, *parts: str) -> str:
        return os.path.join(self.sysfs, *parts)

    def dev(self, *parts: str) -> str:
        return os.path.join(self.devfs, *parts)


def read_bounded(path: str, limit: int = 1 << 16) -> bytes:
    """At most ``limit`` bytes of ``path``; OSError as ``open`` raises it. procfs hands out at most
    a page per read(2) for files such as ``environ`` and ``children``, so it reads until EOF.
    os.open/os.read, not ``open()``: no file object per read (measured on the 2-core VM: 5.7 µs
    against 17 µs for a ``schedstat``; a look at a 48-thread rank makes 48 of them, and the
    cycle a thousand /proc reads)."""
    chunks: list[bytes] = []
    total = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while total < limit:
            chunk = os.read(fd, limit - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
