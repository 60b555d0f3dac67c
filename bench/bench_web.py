#!/usr/bin/env python3
"""What TLS and basic auth cost on /metrics (gpuwatchd/web/server.py), over loopback.

Serves a fixed ~57 KB exposition (900 series, about an 8 GPU x 64 process scrape), pre-rendered
like gpuwatchd's StateRegistry.encode_text() between cycles, so the numbers are the web layer
alone (``--render`` renders it on every request instead), and measures per request
latency p50/p99 for: plain HTTP; TLS with a client certificate; TLS + client certificate + bcrypt
basic auth (cost 10, cached after the first success), each on one keep-alive connection as
Prometheus scrapes, and the first request of a fresh connection (TLS handshake included). Also the
cost of one uncached bcrypt check.

    .venv/bin/python -m bench.bench_web [--requests 300]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import ssl
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import bcrypt
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuwatchd.exporter.exposition import Exposition
from gpuwatchd.exporter.render import Part
from gpuwatchd.web import server as web


class Cached(CollectorRegistry):
    """Like gpuwatchd.exporter.collector.StateRegistry: the rendered text is reused until the state changes."""

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self.body = body
        self._exp = Exposition([Part("", body.decode(), frozenset(), True)], False)

    def exposition(self, fmt: str) -> Exposition:
        return self._exp


class Fixed(Collector):
    def __init__(self, series: int) -> None:
        self.series = series

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("gpuwatch_bench_bytes", "Synthetic.", labels=["gpu", "pid", "comm"])
        for i in range(self.series):
            g.add_metric([str(i % 8), str(10000 + i), "python3"], float(i))
        yield g


def pki(d: Path) -> None:
    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "subjectAltName=DNS:c")):
        (d / f"{name}.ext").write_text(ext + "\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
        )


def measure(
    server: web.WebServer, ctx: ssl.SSLContext | None, headers: dict[str, str], n: int
) -> tuple[list[float], float]:
    port = server.address[1]

    def conn() -> http.client.HTTPConnection:
        if ctx is None:
            return http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)

    c = conn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.request("GET", "/metrics", headers=headers)
        r = c.getresponse()
        body = r.read()
        times.append(time.perf_counter() - t0)
        assert r.status == 200 and body
    c.close()
    fresh = []
    for _ in range(20):
        c = conn()
        t0 = time.perf_counter()
        c.request("GET", "/metrics", headers=headers)
        c.getresponse().read()
        fresh.append(time.perf_counter() - t0)
        c.close()
    return times, statistics.median(fresh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--series", type=int, default=900)
    ap.add_argument("--render", action="store_true", help="render on every request")
    args = ap.parse_args()
    plain = CollectorRegistry()
    plain.register(Fixed(args.series))
    reg = plain if args.render else Cached(generate_latest(plain))
    print(
        f"exposition: {len(generate_latest(plain))} bytes, {args.series} series,"
        f" {'rendered per request' if args.render else 'pre-rendered'}"
    )
    with tempfile.TemporaryDirectory(prefix="gw-h7-bench-") as tmp:
        d = Path(tmp)
        pki(d)
        hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(10)).decode()
        t0 = time.perf_counter()
        bcrypt.checkpw(b"pw", hashed.encode())
        bcrypt_ms = (time.perf_counter() - t0) * 1000
        tls = (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
        )
        (d / "tls.yml").write_text(tls)
        (d / "auth.yml").write_text(tls + f"basic_auth_users:\n  prometheus: {hashed}\n")
        ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
        ctx.load_cert_chain(str(d / "client.crt"), str(d / "client.key"))
        auth = {"Authorization": "Basic " + base64.b64encode(b"prometheus:pw").decode()}
        rows = []
        for label, cfg, c, h in (
            ("plain HTTP", None, None, {}),
            ("TLS + client cert", str(d / "tls.yml"), ctx, {}),
            ("TLS + client cert + basic auth", str(d / "auth.yml"), ctx, auth),
        ):
            server = web.serve(reg, "127.0.0.1:0", cfg)
            try:
                times, fresh = measure(server, c, h, args.requests)
            finally:
                server.close()
            q = statistics.quantiles(times, n=100)
            rows.append((label, statistics.median(times) * 1000, q[98] * 1000, fresh * 1000))
        print(f"bcrypt cost 10, one uncached check: {bcrypt_ms:.1f} ms")
        print(f"{'mode':34} {'p50 ms':>8} {'p99 ms':>8} {'new conn ms':>12}")
        for label, p50, p99, fresh_ms in rows:
            print(f"{label:34} {p50:8.2f} {p99:8.2f} {fresh_ms:12.2f}")


if __name__ == "__main__":
    main()
