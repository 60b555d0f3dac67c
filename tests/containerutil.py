"""Real containers for the tests, as far as the kernel makes one: a new PID namespace with its own
/proc and a private mount namespace (``unshare --pid --fork --mount-proc``), a private tmpfs on
/tmp and /run, host directories bind-mounted where a pod spec's ``volumeMounts`` put them, and
optionally a memory cgroup. The rank inside runs ``RANK_CODE`` with the venv's Python, as PID 1.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)

# Registers through the public API (launcher variables from the environment), prints its own
# view, then beats 4 times a second. GW_WAIT_GO: wait for a byte on stdin, then allocate 256 MiB.
RANK_CODE = """
import os, sys, time
import gpuwatchd
if os.environ.get("GW_REGISTER", "1") == "1":
    hb = os.environ.get("GW_HEARTBEAT") or True
    path = gpuwatchd.register_rank(heartbeat=hb, cuda_oom_hook=False, strict=True)
    gpuwatchd.heartbeat(0)
else:
    path = "-"
print("ready", os.getpid(), path, flush=True)
if os.environ.get("GW_WAIT_GO"):
    sys.stdin.read(1)
    x = b"x" * (256 << 20)
step = 0
while True:
    step += 1
    gpuwatchd.heartbeat(step)
    time.sleep(0.25)
"""


class Container:
    def __init__(
        self,
        env: Mapping[str, str],
        binds: Mapping[str, str] | None = None,
        *,
        cgroup: str | None = None,
        code: str = RANK_CODE,
    ) -> None:
        """``binds``: host path -> path inside (under /run or /mnt, which get a private tmpfs)."""
        script = ["set -e", "mount -t tmpfs gwtrustrank-run /run", "mount -t tmpfs gwtrustrank-mnt /mnt"]
        for host, inside in (binds or {}).items():
            script += [f"mkdir -p {shlex.quote(inside)}", f"mount --bind {shlex.quote(host)} {shlex.quote(inside)}"]
        # The container's own /tmp hides the host's; the interpreter and this checkout stay
        # reachable where they were (CI may clone the repository under /tmp).
        keep = sorted(
            {
                os.path.realpath(p)
                for p in (sys.prefix, sys.base_prefix, REPO)
                if os.path.realpath(p).startswith("/tmp/")
            }
        )
        for i, path in enumerate(keep):
            script += [f"mkdir -p /run/gwkeep{i}", f"mount --rbind {shlex.quote(path)} /run/gwkeep{i}"]
        script += ["mount -t tmpfs gwtrustrank-tmp /tmp"]
        for i, path in enumerate(keep):
            script += [f"mkdir -p {shlex.quote(path)}", f"mount --rbind /run/gwkeep{i} {shlex.quote(path)}"]
        # the environment is the container's own: unshare (standing in for the runtime) has none
        # of it, as containerd-shim has none of a pod's variables
        script += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        script += [f'exec {shlex.quote(sys.executable)} -c "$GW_CODE"']

        def enter() -> None:
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", "\n".join(script)],
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "GW_CODE": code},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=enter,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["ready"], f"container did not start: {line}"
        self.inner_pid = int(line[1])
        self.rank_file = line[2]
        self.pid = self._host_pid()

    def _host_pid(self) -> int:
        """The rank's host PID: the child unshare forked (which exec'd sh, then Python)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                kids = [int(x) for x in f.read().split()]
            if kids:
                return kids[0]
            time.sleep(0.05)
        raise AssertionError("no child of unshare")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("g")
        self.proc.stdin.flush()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for s in (self.proc.stdin, self.proc.stdout):
            if s is not None:
                s.close()
