"""Hostile clients of /metrics (issue 11, items 6, 8, 9): a slowloris client churning 200
half-open connections against a real server on loopback while a real scraper scrapes; oversized
request lines and query strings; client_python's ``name[]`` filter. The server serves the
daemon's own registry (StateRegistry over a NodeState and a CounterStore), so the drop counter is
read from the real exposition."""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, write_config
from pkiutil import make_pki
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.collector import StateRegistry, make_registry
from gpuwatchd.model import NodeState
from gpuwatchd.web import server as web

# Keeps `n` connections open that each send half a request head (or half a TLS ClientHello) and
# wait; every one the server drops is opened again at once. Loopback only, bounded by `seconds`;
# prints how many it opened.
SLOWLORIS = r"""
import selectors, socket, sys, time
port, n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
half = bytes.fromhex(sys.argv[4])
sel = selectors.DefaultSelector()
opened = 0

def open_one():
    global opened
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    sel.register(s, selectors.EVENT_WRITE)
    opened += 1

for _ in range(n):
    open_one()
end = time.monotonic() + seconds
while time.monotonic() < end:
    for key, events in sel.select(0.1):
        s = key.fileobj
        if events & selectors.EVENT_WRITE:
            try:
                s.send(half)
                sel.modify(s, selectors.EVENT_READ)
                continue
            except OSError:
                pass
        else:
            try:
                if s.recv(4096):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
        sel.unregister(s)
        s.close()
        open_one()
print(opened, flush=True)
"""


@pytest.fixture
def daemon_registry() -> tuple[StateRegistry, CounterStore]:
    counters = CounterStore()
    state = NodeState(timestamp=time.time())
    return make_registry(lambda: state, counters), counters


@pytest.fixture
def served() -> Iterator[list[web.WebServer]]:
    servers: list[web.WebServer] = []
    yield servers
    for s in servers:
        s.close()


def _get(
    port: int,
    path: str = "/metrics",
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
    ctx: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=ctx)
        if ctx is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    )
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def _samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki-trust-web"))


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_scrapes_succeed_while_200_slowloris_connections_churn(
    daemon_registry: tuple[StateRegistry, CounterStore],
    served: list[web.WebServer],
    caplog: pytest.LogCaptureFixture,
    pki: Path,
    tls: bool,
) -> None:
    """Issue 11 item 6: 200 half-open connections re-opened as soon as they are dropped, against
    a server with room for 64: every scrape is answered, the drops are counted in
    gpuwatch_web_connections_dropped_total and logged at most once per log_interval. With TLS
    the hostile connections stop half way through their ClientHello."""
    registry, counters = daemon_registry
    limits = web.Limits(max_connections=64, log_interval=2.0)
    config = None
    half = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
    ctx = None
    if tls:
        config = str(pki / "web-config.yml")
        Path(config).write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
        half = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"  # a ClientHello's first bytes
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    server = web.serve(registry, "127.0.0.1:0", config, limits, counters=counters)
    served.append(server)
    port = server.address[1]
    seconds = 8.0
    caplog.set_level(logging.WARNING, logger="gpuwatchd.web")
    hostile = subprocess.Popen(
        [sys.executable, "-c", SLOWLORIS, str(port), "200", str(seconds), half.hex()], stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(1.0)  # let the 200 connections fill the server
        statuses: list[int | str] = []
        took: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds - 2:
            t = time.monotonic()
            try:
                statuses.append(_get(port, ctx=ctx)[0])
            except (OSError, http.client.HTTPException) as e:
                statuses.append(type(e).__name__)
            took.append(time.monotonic() - t)
            time.sleep(0.1)
        out, _ = hostile.communicate(timeout=30)
    finally:
        if hostile.poll() is None:
            hostile.kill()
            hostile.wait(10)
    opened = int(out)
    took.sort()
    print(
        f"{len(statuses)} scrapes under attack, p50 {took[len(took) // 2]:.3f} s, max"
        f" {took[-1]:.3f} s; the hostile client opened {out.strip()} connections"
    )
    assert len(statuses) >= 5 and statuses == [200] * len(statuses), statuses
    assert opened > 400, "the hostile client really churned"
    status, body = _get(port, ctx=ctx)
    assert status == 200
    values = _samples(body)
    dropped = values[("gpuwatch_web_connections_dropped_total", (("reason", "limit"),))]
    assert dropped >= opened - 200 - 64 - 1024  # every re-open but those still open or queued
    assert dropped > 200
    assert ("gpuwatch_web_connections_dropped_total", (("reason", "timeout"),)) in values
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert 1 <= len(lines) <= seconds / limits.log_interval + 2, [r.getMessage() for r in lines]


def test_request_line_over_8_kib_gets_414_without_a_traceback(
    daemon_registry: tuple[StateRegistry, CounterStore], served: list[web.WebServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 11 item 8: a complete request whose line is 9 KiB (BaseHTTPRequestHandler's own
    limit is 64 KiB), and one whose line never ends."""
    registry, counters = daemon_registry
    server = web.serve(registry, "127.0.0.1:0", None, counters=counters)
    served.append(server)
    port = server.address[1]
    caplog.set_level(logging.DEBUG)
    complete = _raw(port, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert complete.startswith(b"HTTP/1.1 414"), complete[:100]
    endless = _raw(port, b"GET /" + b"b" * 20000)
    assert endless.startswith(b"HTTP/1.1 414"), endless[:100]
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"c" * 40000
    assert _raw(port, head).startswith(b"HTTP/1.1 431")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert _get(port)[0] == 200


def test_too_many_query_parameters_get_400(
    daemon_registry: tuple[StateRegistry, CounterStore], served: list[web.WebServer]
) -> None:
    """Issue 11 item 8: 65 query parameters closed the connection without a reply."""
    registry, counters = daemon_registry
    server = web.serve(registry, "127.0.0.1:0", None, counters=counters)
    served.append(server)
    port = server.address[1]
    query = "&".join(f"p{i}=1" for i in range(65))
    status, body = _get(port, f"/metrics?{query}")
    assert status == 400 and b"at most 64 query parameters" in body
    query = "&".join(f"p{i}=1" for i in range(64))
    status, body = _get(port, f"/metrics?{query}")
    assert status == 200 and b"gpuwatch_build_info" in body


def test_name_filter_works_like_client_pythons(
    daemon_registry: tuple[StateRegistry, CounterStore], served: list[web.WebServer]
) -> None:
    """Issue 11 item 9: ``name[]`` on the daemon's registry returned 200 with an empty body."""
    registry, counters = daemon_registry
    server = web.serve(registry, "127.0.0.1:0", None, counters=counters)
    served.append(server)
    port = server.address[1]
    status, body = _get(port, "/metrics?name[]=gpuwatch_build_info")
    assert status == 200
    assert {name for name, _ in _samples(body)} == {"gpuwatch_build_info"}
    # Sample names, as client_python filters: a counter by its _total name; several names.
    status, body = _get(
        port, "/metrics?name[]=gpuwatch_web_connections_dropped_total&name[]=gpuwatch_last_cycle_timestamp_seconds"
    )
    assert status == 200
    assert {name for name, _ in _samples(body)} == {
        "gpuwatch_web_connections_dropped_total",
        "gpuwatch_last_cycle_timestamp_seconds",
    }
    status, body = _get(
        port, "/metrics?name[]=gpuwatch_build_info", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert status == 200 and b"gpuwatch_build_info{" in body and body.endswith(b"# EOF\n")
    status, body = _get(port, "/metrics?name[]=no_such_metric")
    assert status == 200 and body == b""


class _Cached(CollectorRegistry):
    """A registry whose text exposition is rendered once, like the daemon's StateRegistry."""

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self.body = body

    def exposition(self, fmt: str) -> Any:
        return types.SimpleNamespace(body=self.body, gzipped=lambda: self.body, select=lambda names: self.body)


def test_clients_that_never_read_their_answer_hold_no_worker(served: list[web.WebServer]) -> None:
    """80 clients (more than the 8 workers, more than the 64 threads of the old server) ask for
    a 1 MB exposition with a 4 KiB receive window and never read it: a scraper still gets it,
    because the loop, not a worker, waits for them to read."""
    body = b"# HELP gpuwatch_pad Padding.\n# TYPE gpuwatch_pad gauge\n" + b"".join(
        b'gpuwatch_pad{i="%d"} 1.0\n' % i for i in range(40000)
    )
    server = web.serve(_Cached(body), "127.0.0.1:0", None)
    served.append(server)
    port = server.address[1]
    readers = []
    try:
        for _ in range(80):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            readers.append(s)
        time.sleep(0.5)  # their answers are stuck in 4 KiB windows
        t0 = time.monotonic()
        status, got = _get(port)
        assert status == 200 and got == body
        assert time.monotonic() - t0 < 5
    finally:
        for s in readers:
            s.close()


def test_the_daemon_with_its_defaults_answers_scrapes_under_300_slowloris_connections(tmp_path: Path) -> None:
    """The real daemon (`gpuwatchd run`, default limits: room for 256) against 300 churning
    half-open connections: scrapes are answered and the drops are in its own /metrics."""
    path, cfg = write_config(tmp_path)
    d = DaemonProc(path, cfg)
    try:
        port = int(cfg["web"]["listen_address"].rsplit(":", 1)[1])
        assert d.value("gpuwatch_web_connections_dropped_total", reason="limit") == 0
        seconds = 6.0
        half = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
        hostile = subprocess.Popen(
            [sys.executable, "-c", SLOWLORIS, str(port), "300", str(seconds), half.hex()],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(1.0)
            statuses = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds - 2:
                try:
                    statuses.append(_get(port)[0])
                except (OSError, http.client.HTTPException) as e:
                    statuses.append(type(e).__name__)
                time.sleep(0.2)
            hostile.communicate(timeout=30)
        finally:
            if hostile.poll() is None:
                hostile.kill()
                hostile.wait(10)
        assert len(statuses) >= 3 and statuses == [200] * len(statuses), statuses
        dropped = d.value("gpuwatch_web_connections_dropped_total", reason="limit")
        assert dropped is not None and dropped > 44  # at least the 300 - 256 that did not fit
        assert d.proc.poll() is None
        assert d.log().count("dropped") <= seconds / 10 + 2  # one warning per 10 s
    finally:
        d.stop()
