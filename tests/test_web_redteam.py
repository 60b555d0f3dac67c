"""The attacker's pass on the /metrics face (issue 24: N6, N7, N12, N16, the backlog), each a
regression test that fails on 63318c5: loopback only, a few seconds each.

- N6: ``name[]`` requests are answered from the cycle's rendering: however many arrive, the
  registry renders once per cycle and format; a registry without a cache renders one request at
  a time (others 503), never in every worker.
- N7: bcrypt runs on one auth thread with its verdicts, failures too, cached; a scraper whose
  password passed once is answered while wrong-password checks are stuck; the rate limit is per
  client, so a flood without credentials does not use up the scraper's tokens.
- N12: a flood of silent connections pushes out its own connections, not a scraper's idle
  keep-alive one, from another address or from the same one.
- N16: ``gpuwatchd web-config hash`` with a password over 72 bytes says so, no traceback.
- The backlog: the listening socket's accept queue is ``min(BACKLOG, somaxconn)`` (docs/security.md
  has what happens beyond it).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from test_exporter import full_state

from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.exporter.families import GaugeMetricFamily, Registry
from gpuwatchd.web import server as web

REPO = Path(__file__).resolve().parent.parent
PASSWORD = b"scraper-password"


def _get(
    port: int,
    path: str = "/metrics",
    headers: dict[str, str] | None = None,
    source: str = "127.0.0.1",
    timeout: float = 5.0,
) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _basic(user: str, password: bytes) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(user.encode() + b":" + password).decode()}


@pytest.fixture
def served() -> Iterator[list[web.WebServer]]:
    servers: list[web.WebServer] = []
    yield servers
    for s in servers:
        s.close()


def test_n6_name_filters_never_render_anew(served: list[web.WebServer]) -> None:
    state, counters = full_state()
    reg = make_registry(lambda: state, counters)
    calls = [0]
    collect = reg.collector.collect

    def counted() -> Iterator:
        calls[0] += 1
        return collect()

    reg.collector.collect = counted  # type: ignore[method-assign]
    server = web.serve(reg, "127.0.0.1:0")
    served.append(server)
    port = server.address[1]
    names = ["gpuwatch_rank_up", "gpuwatch_build_info", "gpuwatch_oom_kills_total", "nothing"]
    for i in range(60):
        accept = {"Accept": "application/openmetrics-text;version=1.0.0"} if i % 2 else {}
        assert _get(port, f"/metrics?name[]={names[i % 4]}&name[]={names[(i + 1) % 4]}", accept) == 200
    assert _get(port, "/metrics", {"Accept-Encoding": "gzip"}) == 200
    assert calls[0] <= 2  # one rendering per format for this cycle, 61 requests


def test_n6_a_registry_without_a_cache_renders_one_request_at_a_time(served: list[web.WebServer]) -> None:
    entered, release = threading.Event(), threading.Event()

    class Slow:
        def collect(self) -> list:
            entered.set()
            release.wait(10)
            return [GaugeMetricFamily("gpuwatch_up", "Up.", value=1.0)]

    reg = Registry()
    reg.register(Slow())
    server = web.serve(reg, "127.0.0.1:0")
    served.append(server)
    port = server.address[1]
    first: list[int] = []
    t = threading.Thread(target=lambda: first.append(_get(port, "/metrics?name[]=gpuwatch_up")))
    t.start()
    try:
        assert entered.wait(5)
        statuses = [_get(port, "/metrics?name[]=gpuwatch_up", timeout=3) for _ in range(10)]
        assert statuses == [503] * 10  # at once: the other workers are not held by it
        assert _get(port, "/-/healthy", timeout=3) == 200
    finally:
        release.set()
        t.join(10)
    assert first == [200]


def _auth_server(tmp_path: Path, served: list[web.WebServer], rate: str = "") -> int:
    hashed = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4)).decode()
    cfg = tmp_path / "web.yml"
    cfg.write_text(f"basic_auth_users:\n  prometheus: {hashed}\n{rate}")
    reg = Registry()
    reg.register(type("One", (), {"collect": lambda self: [GaugeMetricFamily("gpuwatch_up", "Up.", value=1.0)]})())
    server = web.serve(reg, "127.0.0.1:0", str(cfg))
    served.append(server)
    return server.address[1]


@pytest.fixture
def checkpw(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[bytes], threading.Event]]:
    """bcrypt.checkpw counted; for a wrong password it blocks until released (a slow check)."""
    calls: list[bytes] = []
    release = threading.Event()
    real = bcrypt.checkpw

    def checked(password: bytes, hashed: bytes) -> bool:
        calls.append(password)
        if password != PASSWORD:
            release.wait(20)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", checked)
    yield calls, release
    release.set()


def test_n7_a_repeated_wrong_password_costs_one_bcrypt_check(
    tmp_path: Path, served: list[web.WebServer], checkpw: tuple[list[bytes], threading.Event]
) -> None:
    calls, release = checkpw
    release.set()  # wrong passwords fail at once here
    port = _auth_server(tmp_path, served)
    for _ in range(20):
        assert _get(port, headers=_basic("prometheus", b"wrong")) == 401
    assert _get(port, headers=_basic("prometheus", PASSWORD)) == 200
    assert _get(port, headers=_basic("prometheus", PASSWORD)) == 200
    assert calls.count(b"wrong") == 1 and calls.count(PASSWORD) == 1


def test_n7_a_cached_scrape_never_waits_behind_bcrypt(
    tmp_path: Path, served: list[web.WebServer], checkpw: tuple[list[bytes], threading.Event]
) -> None:
    """16 clients with wrong passwords whose checks hang (more than the 8 workers): the scraper,
    whose password passed once, is answered at once, each time."""
    calls, release = checkpw
    port = _auth_server(tmp_path, served)
    assert _get(port, headers=_basic("prometheus", PASSWORD)) == 200  # cached from now on
    flood = []
    for i in range(16):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        token = base64.b64encode(b"prometheus:wrong-%d" % i).decode()
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
        flood.append(s)
    try:
        time.sleep(0.5)  # the checks are under way (and stuck)
        assert any(p.startswith(b"wrong") for p in calls)
        for _ in range(5):
            t0 = time.monotonic()
            assert _get(port, headers=_basic("prometheus", PASSWORD), timeout=3) == 200
            assert time.monotonic() - t0 < 2.0
    finally:
        release.set()
        for s in flood:
            s.close()


@pytest.mark.parametrize("flooder", ["127.0.0.2", "127.0.0.1"])
def test_n7_a_flood_without_credentials_does_not_use_up_the_scrapers_rate_limit(
    tmp_path: Path, served: list[web.WebServer], flooder: str
) -> None:
    """From another address, or from the scraper's own (one NAT, one proxy): the scraper, whose
    credentials passed once, keeps its tokens."""
    port = _auth_server(tmp_path, served, "rate_limit:\n  interval: 10s\n  burst: 3\n")
    assert _get(port, headers=_basic("prometheus", PASSWORD)) == 200  # known good from now on
    for _ in range(20):  # no credentials
        assert _get(port, source=flooder) in (401, 429)
    assert _get(port, source=flooder) == 429
    for _ in range(3):  # the scraper's bucket still holds its burst
        assert _get(port, headers=_basic("prometheus", PASSWORD)) == 200


@pytest.mark.parametrize("flooder", ["127.0.0.2", "127.0.0.1"])
def test_n12_a_flood_does_not_push_out_the_scrapers_kept_connection(served: list[web.WebServer], flooder: str) -> None:
    reg = Registry()
    reg.register(type("One", (), {"collect": lambda self: [GaugeMetricFamily("gpuwatch_up", "Up.", value=1.0)]})())
    server = web.serve(reg, "127.0.0.1:0", None, web.Limits(max_connections=8, eviction_grace=0.05))
    served.append(server)
    port = server.address[1]
    scraper = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    silent: list[socket.socket] = []
    try:
        for _ in range(3):
            scraper.request("GET", "/metrics")
            resp = scraper.getresponse()
            assert resp.status == 200
            resp.read()
            # 40 silent connections (five times the limit) while it idles: the oldest waiting
            # connection is the scraper's, answered last a moment ago.
            for _ in range(40):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(flooder, 0)))
                time.sleep(0.01)
            time.sleep(0.2)
    finally:
        scraper.close()
        for s in silent:
            s.close()


def test_n16_hash_refuses_a_password_over_72_bytes_without_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "web-config", "hash", "--cost", "4"],
        input="p" * 73 + "\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "73 bytes" in out.stderr and "72" in out.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "web-config", "hash", "--cost", "4"],
        input="p" * 72 + "\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert ok.returncode == 0 and bcrypt.checkpw(b"p" * 72, ok.stdout.strip().encode())


def test_the_accept_queue_is_as_deep_as_the_kernel_allows(served: list[web.WebServer]) -> None:
    """BACKLOG asks for 4096 (net.core.somaxconn's default since Linux 5.4 caps it): 256 open plus
    4096 waiting connections before the kernel drops a SYN (docs/security.md)."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    server = web.serve(Registry(), "127.0.0.1:0")
    served.append(server)
    port = server.address[1]
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout.split()
    with contextlib.suppress(ValueError):
        assert int(out[2]) == min(4096, somaxconn), out
        return
    raise AssertionError(f"ss printed {out}")
