"""Issue 11 item 13: a gil.pyspy_path helper that calls setsid() escapes the process-group kill.

A real stand-in script (sh) records its pid, starts a child that calls setsid(1) and sleeps, and
then hangs itself past every time-out. The real daemon times its runs out; every child of a run
that has ended must be killed and reaped too (the old code left one orphan per run, 27 in 30 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daemonutil import DaemonProc, write_config

from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.threads import process_state

STAND_IN = """#!/bin/sh
# a py-spy stand-in that leaves its process group and then hangs past every time-out
echo "leader $$" >> {log}
setsid sh -c 'echo "child $$ '$$'" >> {log}; exec sleep 300' &
exec sleep 300
"""


def alive(pid: int) -> bool:
    return process_state(HostPaths(), pid) not in (None, "Z", "X")


def read_log(path: Path) -> tuple[list[int], dict[int, int]]:
    leaders, children = [], {}
    for line in path.read_text().splitlines() if path.exists() else ():
        parts = line.split()
        if parts[0] == "leader" and len(parts) == 2:
            leaders.append(int(parts[1]))
        elif parts[0] == "child" and len(parts) == 3:
            children[int(parts[1])] = int(parts[2])
    return leaders, children


def test_helper_that_calls_setsid_leaves_no_orphans(tmp_path: Path, procs: list[subprocess.Popen[Any]]) -> None:
    log = tmp_path / "runs.log"
    helper = tmp_path / "py-spy"
    helper.write_text(STAND_IN.format(log=log))
    helper.chmod(0o755)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    procs.append(rank)
    path, cfg = write_config(
        tmp_path,
        interval_seconds=0.5,
        stall={"after_seconds": 1},
        gil={
            "enabled": True,
            "pyspy_path": str(helper),
            "interval_seconds": 1,
            "duration_seconds": 1,
            "timeout_seconds": 2,
        },
    )
    (tmp_path / "ranks" / "j.json").write_text(
        json.dumps({"version": 1, "job_id": "strays", "ranks": [{"rank": 0, "pid": rank.pid}]})
    )
    d = DaemonProc(path, cfg)
    try:
        checked: set[int] = set()
        deadline = time.monotonic() + 30
        while len(checked) < 4 and time.monotonic() < deadline:
            leaders, children = read_log(log)
            ended = {pid for pid in leaders if not alive(pid)}
            for child, leader in children.items():
                if leader in ended and child not in checked:
                    # the run is over (its leader was killed): its setsid child must go with it
                    gone_by = time.monotonic() + 3
                    while alive(child) and time.monotonic() < gone_by:
                        time.sleep(0.05)
                    assert not alive(child), f"child {child} of timed-out run {leader} survived"
                    checked.add(child)
            time.sleep(0.2)
        assert len(checked) >= 4, (read_log(log), d.log())
        assert d.proc.poll() is None
    finally:
        d.stop()
        leaders, children = read_log(log)
        for pid in [*leaders, *children]:  # the runs in flight when the daemon stopped
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if alive(pid) and b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
