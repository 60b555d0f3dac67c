"""The web listener sleeps while nothing waits: no wake-ups between scrapes (issue 14, goal 2).

Counted for real: the loop thread's voluntary context switches in /proc/self/task/TID/status (each
return from select() that found nothing is one). Before, the loop turned every 0.25 s whatever
happened (8 wake-ups in 2 s); stop() must still end it at once (its self-pipe)."""

from __future__ import annotations

import http.client
import threading
import time

from daemonutil import wakeups
from prometheus_client import CollectorRegistry, Gauge

from gpuwatchd.web import server as web


def _loop_thread(before: set[threading.Thread]) -> threading.Thread:
    found = [t for t in threading.enumerate() if t.name == "gpuwatchd-web" and t not in before]
    assert len(found) == 1
    return found[0]


def test_idle_listener_does_not_wake_and_still_stops_at_once() -> None:
    reg = CollectorRegistry()
    Gauge("gpuwatch_test_value", "A value for the idle test.", registry=reg).set(1)
    before = set(threading.enumerate())
    server = web.serve(reg, "127.0.0.1:0", None)
    loop = _loop_thread(before)
    try:
        # one keep-alive scrape: the connection then waits idle (its idle deadline is far)
        conn = http.client.HTTPConnection(*server.address, timeout=10)
        conn.request("GET", "/metrics")
        assert conn.getresponse().read().find(b"gpuwatch_test_value 1.0") >= 0
        time.sleep(0.3)  # let the answer's write finish
        assert loop.native_id is not None
        for _ in range(2):  # with and without a keep-alive connection waiting
            s0 = wakeups(loop.native_id)
            time.sleep(2.0)
            woke = wakeups(loop.native_id) - s0
            assert woke <= 2, f"the idle web loop woke {woke} times in 2 s"
            conn.close()
            time.sleep(0.3)  # the loop sees the close and forgets the connection
    finally:
        t0 = time.monotonic()
        server.close()
        loop.join(5)
        assert not loop.is_alive()
        assert time.monotonic() - t0 < 1.0, "stop() waited for a time-out"
