#!/usr/bin/env python3
"""The exit watcher (gpuwatchd/sources/exits.py) against a launcher that reaps at once.

A "launcher" process forks N children one at a time, each exiting with its own code or signal,
and reaps each in a blocking ``waitpid`` the moment it ends (tighter than torchrun's 0.1 s
monitor). The watcher in this process has each child's pidfd; the script counts how each exit
was read: from the zombie's /proc/PID/stat (won the race), from PIDFD_INFO_EXIT after the reap
(Linux >= 6.15), or not at all ("reaped before read"), and checks every status read against
the one the launcher saw.

    .venv/bin/python -m bench.exit_race [--n 100]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time

from bench.benchlib import stat_fields
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.exits import ExitWatcher, Watch


def start_ticks(pid: int) -> int:
    return int(stat_fields(pid)[19])


def race(n: int) -> dict[str, object]:
    """One launcher, ``n`` children in turn; the counts of how each exit was read."""
    go_r, go_w = os.pipe()  # a byte per child: "end now"
    rep_r, rep_w = os.pipe()  # the launcher's report: "pid status\n" per child
    ready_r, ready_w = os.pipe()  # the launcher says which child is waiting
    launcher = os.fork()
    if launcher == 0:
        for i in range(n):
            child = os.fork()
            if child == 0:
                faulthandler.disable()  # a test runner's handler would print each SIGSEGV
                os.read(go_r, 1)
                if i % 3 == 1:
                    os.kill(os.getpid(), signal.SIGSEGV if i % 2 else signal.SIGTERM)
                os._exit(i % 7)
            os.write(ready_w, f"{child}\n".encode())
            _, status = os.waitpid(child, 0)  # reaps at once
            os.write(rep_w, f"{child} {status}\n".encode())
        os._exit(0)
    watcher = ExitWatcher(HostPaths(), 8)
    watcher.start()
    out: dict[str, int] = {"stat": 0, "pidfd": 0, "unknown": 0, "wrong": 0}
    ready = os.fdopen(ready_r)
    report = os.fdopen(rep_r)
    for _ in range(n):
        pid = int(ready.readline())
        key = (pid, start_ticks(pid))
        watcher.sync({key}, {key: Watch(pid, key[1], os.geteuid(), "child")})
        os.write(go_w, b"x")
        seen_pid, status = (int(x) for x in report.readline().split())
        deadline = time.monotonic() + 5
        got = []
        while not got and time.monotonic() < deadline:
            got = watcher.drain()
            time.sleep(0.001)
        (x,) = got
        assert x.pid == seen_pid == pid
        if x.status is None:
            out["unknown"] += 1
        else:
            out[x.read_by] += 1
            out["wrong"] += x.status != status
        watcher.sync(set(), {})
    os.waitpid(launcher, 0)
    watcher.stop()
    return {"exits": n, "kernel": os.uname().release, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    print(json.dumps(race(ap.parse_args().n)))


if __name__ == "__main__":
    main()
