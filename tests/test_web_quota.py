"""The /metrics listener under the unit's ``CPUQuota=25%`` (a real CPU cgroup, tests/cpuquota.py),
with floods from a second process: loopback only, each test under 30 s.

- R12: connections streaming a request body as one-byte chunks (unauthenticated: nothing of a
  body needs credentials) kept the listener's one loop thread busy framing them with h11: with
  32 of them, scrapes took seconds (p50 1.1-7.1 s, max 10 s). A request that did not arrive in one
  read is now read again at most every ``read_pace`` and a body is 413 after 256 pieces.
- R16 (N12 again): a flood that reconnects keeps its own connections younger than the eviction
  grace, so the only connection old enough to push out was the scraper's idle keep-alive one:
  28 of 56 scrapes failed. A connection that was served is now pushed out only after every one
  that never completed a request.
"""

from __future__ import annotations

import contextlib
import http.client
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpuquota import CpuQuota, cpu_quota

REPO = Path(__file__).resolve().parent.parent

# The server alone in the quota: the daemon's own web.serve with a body like a node's (300 series).
SERVER = r"""
import sys
from gpuwatchd.exporter.families import GaugeMetricFamily, Registry
from gpuwatchd.web import server as web

class Many:
    def collect(self):
        g = GaugeMetricFamily("gpuwatch_test_value", "A value.", labels=["job_id", "rank"])
        for i in range(300):
            g.add_metric([f"job{i // 8}", str(i % 8)], float(i))
        return [g]

reg = Registry()
reg.register(Many())
s = web.serve(reg, "127.0.0.1:0", sys.argv[2] or None, web.Limits(max_connections=int(sys.argv[1])))
print(s.address[1], flush=True)
sys.stdin.read()
s.close()
"""

# argv: port, connections, mode, seconds, chunks-bytes per send. "stream": each connection sends a
# chunked request head, then its body as one-byte chunks ("1 CRLF x CRLF"), PER_SEND bytes per send
# (600: 100 chunks), reconnecting when the server ends it. "reconnect": each connection is held
# 30-150 ms, silent, then closed and made again (younger than the 0.2 s eviction grace).
FLOOD = r"""
import random, socket, sys, time
port, n, mode, seconds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
HEAD = b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
BODY = b"1\r\nx\r\n" * 100000
PER_SEND = int(sys.argv[5]) if len(sys.argv) > 5 else 1
end = time.monotonic() + seconds

def connect():
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    return s

socks = [[connect(), 0, time.monotonic() + random.uniform(0.03, 0.15)] for _ in range(n)]
made = n
while time.monotonic() < end:
    now = time.monotonic()
    for slot in socks:
        s, sent, until = slot
        try:
            if mode == "stream":
                off = sent - len(HEAD)
                data = HEAD[sent:] if off < 0 else BODY[off:off + PER_SEND]
                slot[1] += s.send(data)
                continue
            if now < until:
                continue
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            pass
        s.close()
        slot[:] = [connect(), 0, now + random.uniform(0.03, 0.15)]
        made += 1
    if mode == "reconnect":
        time.sleep(0.005)
print(made, flush=True)
"""


@contextlib.contextmanager
def quota_server(quota: CpuQuota, max_connections: int, web_config: str = "") -> Iterator[int]:
    p = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(max_connections), web_config],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        port = int(p.stdout.readline())
        quota.adopt(p.pid)
        yield port
    finally:
        p.kill()
        p.wait(10)


def flood(port: int, n: int, mode: str, seconds: float, per_send: int = 1) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(port), str(n), mode, str(seconds), str(per_send)],
        stdout=subprocess.PIPE,
        text=True,
    )


def scrapes(port: int, n: int, every: float) -> tuple[list[float], int]:
    """``n`` scrapes on one keep-alive connection (http.client connects again after a failure),
    ``every`` seconds apart: (each successful scrape's seconds, failed scrapes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    took: list[float] = []
    failed = 0
    try:
        for _ in range(n):
            t0 = time.monotonic()
            try:
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                body = resp.read()
                assert resp.status == 200 and b"gpuwatch_test_value" in body
                took.append(time.monotonic() - t0)
            except (OSError, http.client.HTTPException):
                failed += 1
                conn.close()
            time.sleep(every)
    finally:
        conn.close()
    return took, failed


def test_r12_one_byte_body_chunks_do_not_stall_scrapes_under_the_quota() -> None:
    with cpu_quota(25) as quota, quota_server(quota, 256) as port:
        quiet, failed = scrapes(port, 10, 0.1)
        assert failed == 0
        f = flood(port, 32, "stream", 20.0, per_send=600)
        try:
            time.sleep(1.0)  # the flood is under way
            took, failed = scrapes(port, 30, 0.2)
        finally:
            f.kill()
            f.wait(10)
        p50, worst = statistics.median(took), max(took)
        print(
            f"quiet p50 {statistics.median(quiet):.3f} s; 32 one-byte streams: p50 {p50:.3f} s, "
            f"max {worst:.3f} s, {failed} failed; throttled {quota.throttled_usec() / 1e6:.1f} s"
        )
        assert failed == 0
        assert p50 < 0.5 and worst < 2.0, (p50, worst, took)


@pytest.mark.parametrize("max_connections", [16])
def test_r16_a_reconnecting_flood_does_not_push_out_the_scrapers_connection(max_connections: int) -> None:
    with cpu_quota(25) as quota, quota_server(quota, max_connections) as port:
        f = flood(port, 4 * max_connections, "reconnect", 14.0)
        try:
            time.sleep(1.0)
            took, failed = scrapes(port, 40, 0.25)
            out, _ = f.communicate(timeout=30)  # it ends by itself, saying how many it made
        finally:
            f.kill()
            f.wait(10)
        print(
            f"{failed} of 40 keep-alive scrapes failed under a reconnecting flood of "
            f"{4 * max_connections} connections ({out.strip() or '?'} made); "
            f"p50 {statistics.median(took) if took else float('nan'):.3f} s"
        )
        assert failed == 0
