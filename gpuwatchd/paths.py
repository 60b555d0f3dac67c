"""Host filesystem roots: the only place that says "/proc", "/sys" or "/dev".

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
