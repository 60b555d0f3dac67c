"""Real memory-cgroup OOM kills for the kernel-log tests and bench/oom_latency.py.

``MemCgroup`` creates a uniquely named memory cgroup (v1: ``memory.limit_in_bytes``, v2:
``memory.max``), ``spawn`` starts a Python child inside it (moved in before exec), and the child
waits for one byte on stdin before it allocates past the limit, so that the test can register it
as a rank first. Everything is removed again by ``remove()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

CGROUP_ROOT = "/sys/fs/cgroup"

# Waits for "go" on stdin, then writes 256 MiB (bytes * n writes every page).
RANK_CODE = "import sys; sys.stdin.read(1); x = b'x' * (256 << 20); print(len(x))"
# A rank whose child (a "DataLoader worker") does the allocating; the rank itself stays small.
RANK_WITH_WORKER_CODE = (
    "import subprocess, sys\n"
    "w = subprocess.Popen([sys.executable, '-c', "
    "\"import sys; sys.stdin.read(1); x = b'x' * (256 << 20)\"], stdin=subprocess.PIPE)\n"
    "print(w.pid, flush=True)\n"
    "sys.stdin.read(1); w.stdin.write(b'g'); w.stdin.flush(); w.wait()\n"
    "print(w.returncode, flush=True); sys.stdin.read(1)\n"
)


class MemCgroup:
    def __init__(self, tag: str, limit_bytes: int = 64 << 20, root: str = CGROUP_ROOT) -> None:
        self.name = f"gw_h4_{tag}_{uuid.uuid4().hex[:8]}"
        v1 = os.path.exists(os.path.join(root, "memory", "cgroup.procs"))
        self.version = 1 if v1 else 2
        self.path = os.path.join(root, "memory", self.name) if v1 else os.path.join(root, self.name)
        os.mkdir(self.path)
        limit_file = "memory.limit_in_bytes" if v1 else "memory.max"
        with open(os.path.join(self.path, limit_file), "w") as f:
            f.write(str(limit_bytes))
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def kernel_path(self) -> str:
        """How the kernel names this cgroup in OOM lines (relative to the hierarchy root)."""
        return "/" + self.name

    def _enter(self) -> None:
        self.adopt(os.getpid())

    def adopt(self, pid: int) -> None:
        """Move a running process (all its threads) into this cgroup."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def spawn(self, code: str = RANK_CODE) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=self._enter,
        )
        self.procs.append(p)
        return p

    def oom_kills(self) -> int:
        """The cgroup's own count (v1 memory.oom_control / v2 memory.events)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with open(os.path.join(self.path, name)) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        return 0

    def remove(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            for s in (p.stdin, p.stdout):
                if s is not None:
                    s.close()
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)


def go(p: subprocess.Popen[bytes]) -> None:
    assert p.stdin is not None
    p.stdin.write(b"g")
    p.stdin.flush()
