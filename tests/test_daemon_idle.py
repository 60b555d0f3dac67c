"""The daemon's main loop sleeps until its next cycle, a reload or a stop (issue 14: no idle
wake-ups; daemon/wake.py).

A real ``gpuwatchd run`` with a 30 s interval: between two cycles its main thread (tid == pid)
must not wake, counted in /proc/PID/task/PID/status (voluntary context switches; it used to wake
every second to look at its stop and reload flags: 3 in 3 s). SIGHUP and SIGTERM must still act
between cycles, at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from daemonutil import DaemonProc, wakeups, write_config


def test_main_loop_sleeps_between_cycles_and_still_reloads_and_stops(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path, interval_seconds=30)
    d = DaemonProc(path, cfg)
    try:
        pid = d.proc.pid
        time.sleep(1.0)  # the first cycle is over: the loop sleeps until the next one
        s0 = wakeups(pid, pid)
        time.sleep(3.0)
        woke = wakeups(pid, pid) - s0
        assert woke <= 1, f"the idle main loop woke {woke} times in 3 s"
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: "configuration reloaded from" in d.log(), timeout=5, what="the reload")
        t0 = time.monotonic()
    finally:
        code = d.stop()
    assert code == 0
    assert time.monotonic() - t0 < 3.0, "SIGTERM waited for the next cycle"
