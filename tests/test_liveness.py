"""Issue 12 items 4-5: the watchdog means "cycles keep finishing", and the daemon shows its own
oom_score_adj. Real notify socket (AF_UNIX datagrams, as systemd reads them), the real daemon loop
(``Daemon.run``) with a subsystem whose cycle contribution is slow once or never returns."""

from __future__ import annotations

import itertools
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, write_config
from kernel_oom_helpers import MemCgroup

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.retention import RetentionSubsystem
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import Ranks
from gpuwatchd.daemon.wiring import Parts

PING_EVERY = 0.5  # WATCHDOG_USEC=1 s: a ping every half of it


class Gate(RetentionSubsystem):
    """A part of the cycle (in the series retention's place) that can be made slow once
    (``slow_once``) or to hang (``wedge``)."""

    name = "gate"

    def __init__(self, services: Services) -> None:
        super().__init__(services)
        self.slow_once = 0.0
        self.entered = threading.Event()
        self.wedged = threading.Event()
        self.release = threading.Event()

    def observe(self, daemon: Any, ranks: Ranks) -> None:
        self.entered.set()
        if self.slow_once:
            delay, self.slow_once = self.slow_once, 0.0
            time.sleep(delay)
        if self.wedged.is_set():
            self.release.wait(60)


class Pings:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                msg = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            now = time.monotonic()
            self.lines.extend((now, line) for line in msg.splitlines())

    def watchdog(self, since: float = 0.0) -> list[float]:
        return [t for t, line in list(self.lines) if line == "WATCHDOG=1" and t >= since]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


@pytest.fixture
def running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    monkeypatch.setenv("NOTIFY_SOCKET", sock_path)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    pings = Pings(sock)
    started: list[tuple[Daemon, Gate, threading.Thread]] = []

    def start(liveness_seconds: float | None = None) -> tuple[Daemon, Gate, Pings]:
        path, _ = write_config(tmp_path)
        kw = {} if liveness_seconds is None else {"liveness_seconds": liveness_seconds}
        d = Daemon(load_config(str(path)), parts=lambda c, s: Parts(retention=Gate(s)), write_state=False, **kw)
        gate = d.parts.retention
        assert isinstance(gate, Gate)
        t = threading.Thread(target=d.run, daemon=True)
        t.start()
        started.append((d, gate, t))
        deadline = time.monotonic() + 15
        while not pings.watchdog() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pings.watchdog(), pings.lines
        return d, gate, pings

    yield start
    for d, gate, t in started:
        gate.release.set()
        d.stop_event.set()
        t.join(10)
    pings.close()
    sock.close()


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_one_slow_cycle_keeps_the_watchdog_fed(running: Any) -> None:
    _d, gate, pings = running()
    gate.entered.clear()
    gate.slow_once = 4.0  # one cycle takes 4 s: twice a WatchdogSec=2s unit would allow
    assert gate.entered.wait(5)
    t0 = time.monotonic()
    time.sleep(4.5)
    during = pings.watchdog(since=t0)
    # the old loop pinged only between cycles: nothing for the 4 s of the slow cycle
    assert len(during) >= 5, during
    assert max(gaps([t0, *during])) < 4 * PING_EVERY, gaps([t0, *during])


def test_cycles_that_stop_for_good_stop_the_watchdog(running: Any) -> None:
    d, gate, pings = running(liveness_seconds=2.0)
    gate.wedged.set()
    gate.entered.clear()
    assert gate.entered.wait(5)
    wedged_at = time.monotonic()
    time.sleep(2.0 + 2.5)
    late = pings.watchdog(since=wedged_at + 2.0 + 2 * PING_EVERY)
    assert late == [], late  # the daemon thread runs on, but cycles do not: no more pings
    assert not d.alive()
    statuses = [line for _, line in pings.lines if line.startswith("STATUS=no cycle finished")]
    assert statuses, pings.lines
    # the cycle comes back: pings resume without a restart
    gate.wedged.clear()
    gate.release.set()
    back = time.monotonic()
    deadline = back + 5
    while not pings.watchdog(since=back) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pings.watchdog(since=back)


def _healthy(d: Daemon) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{d.config.web.listen_address}/-/healthy", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_healthy_fails_while_cycles_stop_and_recovers(running: Any) -> None:
    """/-/healthy, the DaemonSet's liveness probe, says what the unit's watchdog says: 503 once
    no cycle finished within liveness_seconds (the process still answers), 200 again when
    cycles resume. Before, it answered 200 while the process answered, so a pod whose cycle
    stopped was never restarted."""
    d, gate, _pings = running(liveness_seconds=2.0)
    assert _healthy(d) == (200, "gpuwatchd is Healthy.\n")
    gate.wedged.set()
    gate.entered.clear()
    assert gate.entered.wait(5)
    time.sleep(2.0 + 1.0)
    status, body = _healthy(d)
    assert status == 503, body
    assert body.startswith("gpuwatchd is not healthy: no cycle finished for "), body
    gate.wedged.clear()
    gate.release.set()
    deadline = time.monotonic() + 5
    while _healthy(d)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _healthy(d)[0] == 200


def test_daemon_exports_its_own_oom_score_adj(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    d = DaemonProc(path, cfg)
    try:
        # what OOMScoreAdjust= does at start; lowering it needs CAP_SYS_RESOURCE, which this
        # container lacks (as the booted-systemd test found), so raise it: the gauge shows either
        Path(f"/proc/{d.proc.pid}/oom_score_adj").write_text("317")
        d.wait_for(
            lambda: d.value("gpuwatch_process_oom_score_adj") == 317.0, what="gpuwatch_process_oom_score_adj 317"
        )
        assert "oom_score_adj of the daemon:" in d.log()
    finally:
        d.stop()


def test_daemon_exports_the_memory_limit_of_its_own_cgroup(tmp_path: Path) -> None:
    """What the GpuwatchdMemoryHigh alert compares process_resident_memory_bytes with: the limit
    of the cgroup the daemon runs in (the unit's MemoryMax=, the pod's limits.memory), followed
    when the daemon is moved into a real memory cgroup with a 300 MiB limit."""
    path, cfg = write_config(tmp_path)
    d = DaemonProc(path, cfg)
    cg = MemCgroup("selflimit", limit_bytes=300 << 20)
    try:
        cg.adopt(d.proc.pid)
        d.wait_for(
            lambda: d.value("gpuwatch_process_memory_limit_bytes") == float(300 << 20),
            what="gpuwatch_process_memory_limit_bytes 300 MiB",
        )
        rss = d.value("process_resident_memory_bytes")
        assert rss is not None and 0 < rss < 300 << 20
    finally:
        d.stop()
        cg.remove()
