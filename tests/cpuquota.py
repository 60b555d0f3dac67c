"""The unit's ``CPUQuota=25%`` recreated for one test: a CPU cgroup of its own (v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``, or v2 ``cpu.max``), a process moved in with all its
threads, removed again afterwards. systemd writes the same numbers for ``CPUQuota=25%``
(25 ms per 100 ms period)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator

ROOT = "/sys/fs/cgroup"


class CpuQuota:
    def __init__(self, percent: int = 25, period_us: int = 100_000) -> None:
        quota = period_us * percent // 100
        v1 = os.path.join(ROOT, "cpu")
        name = f"gw_cpuquota_{uuid.uuid4().hex[:8]}"
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            self.path = os.path.join(v1, name)
            os.mkdir(self.path)
            self._write("cpu.cfs_period_us", str(period_us))
            self._write("cpu.cfs_quota_us", str(quota))
        else:
            v2 = os.path.exists(os.path.join(ROOT, "cgroup.controllers"))
            unified = ROOT if v2 else os.path.join(ROOT, "unified")
            self.path = os.path.join(unified, name)
            os.mkdir(self.path)
            self._write("cpu.max", f"{quota} {period_us}")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def adopt(self, pid: int) -> None:
        """Move ``pid`` (every thread of it) into the cgroup."""
        self._write("cgroup.procs", str(pid))

    def throttled_usec(self) -> int:
        """How long the cgroup was held back by its quota (cpu.stat: throttled_time in ns on
        v1, throttled_usec on v2)."""
        with open(os.path.join(self.path, "cpu.stat")) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "throttled_usec":
                    return int(v)
                if k == "throttled_time":
                    return int(v) // 1000
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the moved process must have exited (or left) first
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
                return
            time.sleep(0.1)


@contextlib.contextmanager
def cpu_quota(percent: int = 25) -> Iterator[CpuQuota]:
    q = CpuQuota(percent)
    try:
        yield q
    finally:
        q.remove()
