"""What users of Prometheus exporters expect of the port (issue 24): /-/healthy, /-/ready (the
first cycle has ended, no collector's call is stuck), gzip when asked (compressed once per cycle,
beside the body), a landing page linking to them, methods other than GET/HEAD refused."""

from __future__ import annotations

import gzip
import http.client
from collections.abc import Iterator

import pytest
from test_exporter import full_state

from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.isolation import STILL_RUNNING
from gpuwatchd.model import CollectorStatus, NodeState
from gpuwatchd.web import server as web


def _req(
    port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


@pytest.fixture
def state_box() -> Iterator[tuple[list[NodeState | None], int]]:
    box: list[NodeState | None] = [None]
    reg = make_registry(lambda: box[0], CounterStore(), lambda: [])
    server = web.serve(reg, "127.0.0.1:0")
    yield box, server.address[1]
    server.close()


def test_healthy_and_ready_follow_the_cycle(state_box: tuple[list[NodeState | None], int]) -> None:
    box, port = state_box
    assert _req(port, "/-/healthy")[0] == 200
    status, _, body = _req(port, "/-/ready")
    assert status == 503 and b"first cycle" in body
    box[0] = NodeState(timestamp=1.0, collectors=(CollectorStatus("procfs", True, 0.01, 1.0),))
    assert _req(port, "/-/ready") == (200, _req(port, "/-/ready")[1], b"gpuwatchd is Ready.\n")
    box[0] = NodeState(
        timestamp=2.0,
        collectors=(
            CollectorStatus("nvml", False, 5.0, None, f"timed out after 5s {STILL_RUNNING}"),
            CollectorStatus("procfs", False, 0.1, None, "OSError: gone"),
        ),
    )  # failing is not stuck
    status, _, body = _req(port, "/-/ready")
    assert status == 503 and b"nvml" in body and b"procfs" not in body
    assert _req(port, "/-/healthy")[0] == 200


def test_gzip_when_asked_is_the_body_compressed_once_per_cycle() -> None:
    state, counters = full_state()
    reg = make_registry(lambda: state, counters, lambda: [])
    server = web.serve(reg, "127.0.0.1:0")
    try:
        port = server.address[1]
        plain = _req(port, "/metrics")
        assert "content-encoding" not in plain[1]
        for enc in ("gzip", "br, gzip;q=0.5", "GZIP"):
            status, headers, body = _req(port, "/metrics", headers={"Accept-Encoding": enc})
            assert status == 200 and headers["content-encoding"] == "gzip"
            assert gzip.decompress(body) == plain[2]
            assert int(headers["content-length"]) == len(body) < len(plain[2]) / 3
        assert "content-encoding" not in _req(port, "/metrics", headers={"Accept-Encoding": "br"})[1]
        exp = reg.exposition("text")
        assert exp.gzipped() is exp.gzipped()  # kept beside the body until the next cycle
    finally:
        server.close()


def test_landing_page_links_and_methods(state_box: tuple[list[NodeState | None], int]) -> None:
    _, port = state_box
    status, headers, body = _req(port, "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    for link in (b'href="metrics"', b'href="-/healthy"', b'href="-/ready"'):
        assert link in body
    assert _req(port, "/metrics", "HEAD")[2] == b""
    assert _req(port, "/metrics", "HEAD")[1]["content-length"] == _req(port, "/metrics")[1]["content-length"]
    status, headers, _ = _req(port, "/metrics", "POST")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert _req(port, "/nope")[0] == 404
