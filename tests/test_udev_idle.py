"""The udev watcher sleeps until a uevent or stop(): no wake-ups while nothing happens (issue 14).

Counted for real on a real netlink monitor: the watcher thread's voluntary context switches in
/proc/self/task/TID/status. Before, it woke every second to look at its stop flag (3 in 3 s);
stop() must still end it at once (a self-pipe)."""

from __future__ import annotations

import threading
import time

import pyudev
from daemonutil import wakeups

from gpuwatchd.sources.udev import UdevWatcher


def test_idle_udev_watcher_does_not_wake_and_stops_at_once() -> None:
    mon = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
    mon.filter_by("pci")
    w = UdevWatcher(lambda ev: None, monitor=mon)
    before = set(threading.enumerate())
    w.start()
    found = [t for t in threading.enumerate() if t.name == "gpuwatchd-udev" and t not in before]
    assert len(found) == 1
    thread = found[0]
    assert thread.native_id is not None
    try:
        time.sleep(0.3)  # into its first poll
        s0 = wakeups(thread.native_id)
        time.sleep(3.0)
        woke = wakeups(thread.native_id) - s0
        assert woke <= 1, f"the idle udev watcher woke {woke} times in 3 s"
    finally:
        t0 = time.monotonic()
        w.stop()
        assert not thread.is_alive()
        assert time.monotonic() - t0 < 1.0, "stop() waited for a time-out"
