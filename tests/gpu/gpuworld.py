"""The GPU tests' world: one real daemon with NVML on, the processes a test starts, and waits on
what the daemon wrote to state.json. test_real_faults.py, test_discovered_shapes.py and
test_hang_shapes.py subclass it with their own ranks and launchers."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import DaemonProc, write_config  # noqa: E402

from gpuwatchd.sources.procfs import ProcfsReader  # noqa: E402


def say(what: str, text: Any) -> None:
    """A ``SAW`` line: what the test saw, kept from the device run's log for bench/results/."""
    print(f"SAW {what}: {text}", flush=True)


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (the ranks import gpuwatchd)."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def kill_tree(p: subprocess.Popen[str]) -> None:
    """SIGKILL a process, its process group where it leads one, and every descendant (the daemon's
    own walk of /proc's children files), then reap it: torchrun starts each worker in a session of
    its own (``start_new_session``), so a kill of the launcher's process group leaves its ranks
    running (a GIL holder burning a core, a kernel that never ends on the GPU) under the tests after it."""
    if p.poll() is None:
        tree = ProcfsReader().descendants(p.pid)
        try:
            leads = os.getpgid(p.pid) == p.pid
        except ProcessLookupError:
            leads = False
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if leads:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
        else:
            p.kill()
    p.wait()


class World:
    """``write_config(tmp, nvml on, **config)`` and the daemon on it. ``poll``: how often
    :meth:`wait` asks again."""

    def __init__(self, tmp: Path, poll: float = 0.2, daemon_args: tuple[str, ...] = (), **config: Any) -> None:
        self.tmp = tmp
        self.poll = poll
        self.cfg_path, self.cfg = write_config(tmp, nvml={"enabled": True}, **config)
        self.rank_dir = Path(self.cfg["rank_dir"])
        self.state = Path(self.cfg["state_dir"]) / "state.json"
        self.d = DaemonProc(self.cfg_path, self.cfg, args=daemon_args)
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
        """A process the world stops at its end (``popen``: e.g. start_new_session, stderr)."""
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, **popen)
        self.procs.append(p)
        return p

    ready_timeout = 120.0

    def ready(self, p: subprocess.Popen[str], timeout: float | None = None) -> None:
        """Wait for the process's "ready" line, bounded (``ready_timeout``): on the first device
        run the idle_wait rank never printed it and a plain readline() held the rest of the run
        until its time limit."""
        timeout = self.ready_timeout if timeout is None else timeout
        assert p.stdout is not None
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(p.stdout.readline() if p.stdout else ""), daemon=True)
        reader.start()
        reader.join(timeout)
        if not got:
            p.kill()
        assert got and got[0].strip() == "ready", f"{p.args} not ready in {timeout:.0f} s: {got}"

    def findings(self, job: str) -> list[dict[str, Any]]:
        try:
            state = json.loads(self.state.read_text())
        except (OSError, ValueError):
            return []
        return [f for f in state["findings"] if f.get("job_id") == job]

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            time.sleep(self.poll)
        try:  # what the daemon did say, per rank: the reason a page did not come
            said = [
                (f.get("job_id"), f.get("rank"), f["kind"], f.get("explanation", "")[:600])
                for f in json.loads(self.state.read_text())["findings"]
            ]
        except (OSError, ValueError, KeyError):
            said = []
        raise AssertionError(f"timed out: {what}\nfindings: {said}\n{self.d.log()[-3000:]}")

    def stop(self, *procs: subprocess.Popen[str]) -> None:
        """SIGKILL each with its process group and every descendant (a launcher and its ranks)."""
        for p in procs:
            kill_tree(p)

    def close(self) -> None:
        self.stop(*self.procs)
        self.d.stop()
