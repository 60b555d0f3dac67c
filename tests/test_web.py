"""/metrics server: plain HTTP by default, exporter-toolkit web-config (TLS, client certificates,
bcrypt basic auth), hostile clients. Real sockets on loopback, a CA made with the openssl CLI,
real clients (http.client over ssl, curl)."""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from pkiutil import make_pki
from prometheus_client import CollectorRegistry, Gauge

from gpuwatchd.cli import web_config as web_config_cli
from gpuwatchd.web import server as web
from gpuwatchd.web.web_config import WebConfigError

PASSWORD = "correct horse battery staple"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki-helper7"))


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    g = Gauge("gpuwatch_test_value", "A value for the web server test.", registry=reg)
    g.set(42)
    return reg


def _write_config(d: Path, text: str) -> str:
    path = d / "web-config.yml"
    path.write_text(text)
    return str(path)


def _mtls_config(pki: Path, extra: str = "") -> str:
    # Relative paths: exporter-toolkit resolves them against the config file's directory.
    return (
        "tls_server_config:\n"
        "  cert_file: server.crt\n"
        "  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        "  client_ca_file: ca.crt\n"
        "  min_version: TLS12\n"
        f"{extra}"
        "basic_auth_users:\n"
        f"  prometheus: {HASH}\n"
    )


def _client_ctx(pki: Path, cert: str | None = "client") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    return ctx


def _auth(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def _get(
    server: web.WebServer,
    path: str = "/metrics",
    headers: dict[str, str] | None = None,
    ctx: ssl.SSLContext | None = None,
    host: str = "127.0.0.1",
    method: str = "GET",
) -> tuple[int, dict[str, str], bytes]:
    port = server.address[1]
    conn: http.client.HTTPConnection
    if ctx is not None:
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=10)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


@pytest.fixture
def served() -> Iterator[list[web.WebServer]]:
    servers: list[web.WebServer] = []
    yield servers
    for s in servers:
        s.close()


def test_plain_http_is_the_default(registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", None)
    served.append(server)
    host, port = server.address
    assert host == "127.0.0.1" and port > 0
    assert server.url == f"http://127.0.0.1:{port}/metrics"
    status, headers, body = _get(server)
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert b"gpuwatch_test_value 42.0" in body
    status, headers, body = _get(server, "/")
    assert status == 200 and b'href="metrics"' in body
    assert _get(server, "/nope")[0] == 404
    assert _get(server, "/metrics", method="POST")[0] == 405
    status, _, body = _get(server, "/metrics", method="HEAD")
    assert status == 200 and body == b""
    status, _, body = _get(server, "/metrics?name[]=gpuwatch_test_value")
    assert status == 200 and b"gpuwatch_test_value 42.0" in body


def test_openmetrics_negotiation(registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", None)
    served.append(server)
    status, headers, body = _get(server, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_ipv6_loopback(registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "[::1]:0", None)
    served.append(server)
    assert server.address[0] == "::1"
    assert server.url.startswith("http://[::1]:")
    status, _, body = _get(server, host="::1")
    assert status == 200 and b"gpuwatch_test_value" in body
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.address[1]), timeout=2).close()


def test_bad_listen_addresses(registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    for bad in ("9958", "::1:9958", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="listen address"):
            web.serve(registry, bad, None)
    server = web.serve(registry, "127.0.0.1:0", None)
    served.append(server)
    with pytest.raises(OSError):
        web.serve(registry, f"127.0.0.1:{server.address[1]}", None)


def test_mtls_and_basic_auth(pki: Path, registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", _write_config(pki, _mtls_config(pki)))
    served.append(server)
    assert server.url.startswith("https://")
    ctx = _client_ctx(pki)

    status, _, body = _get(server, headers=_auth("prometheus", PASSWORD), ctx=ctx)
    assert status == 200 and b"gpuwatch_test_value 42.0" in body
    # Cached after the first bcrypt check; still correct the second time.
    assert _get(server, headers=_auth("prometheus", PASSWORD), ctx=ctx)[0] == 200

    status, headers, body = _get(server, headers=_auth("prometheus", "wrong"), ctx=ctx)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Basic")
    assert b"gpuwatch_test_value" not in body
    assert _get(server, headers=_auth("nobody", PASSWORD), ctx=ctx)[0] == 401
    assert _get(server, ctx=ctx)[0] == 401
    assert _get(server, headers={"Authorization": "Basic !!!notbase64"}, ctx=ctx)[0] == 401
    assert _get(server, headers={"Authorization": "Bearer abc"}, ctx=ctx)[0] == 401
    # The landing page is behind the same authentication.
    assert _get(server, "/", ctx=ctx)[0] == 401


def test_client_certificate_required(pki: Path, registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", _write_config(pki, _mtls_config(pki)))
    served.append(server)
    for cert in (None, "rogue-client"):
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            _get(server, headers=_auth("prometheus", PASSWORD), ctx=_client_ctx(pki, cert))
    # Plain HTTP against the TLS port gets nothing useful, and breaks nothing.
    with pytest.raises((http.client.HTTPException, ConnectionResetError)):
        _get(server, headers=_auth("prometheus", PASSWORD))
    assert _get(server, headers=_auth("prometheus", PASSWORD), ctx=_client_ctx(pki))[0] == 200


def test_client_allowed_sans(pki: Path, registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    cfg = _mtls_config(pki, "  client_allowed_sans: [prometheus.example]\n")
    server = web.serve(registry, "127.0.0.1:0", _write_config(pki, cfg))
    served.append(server)
    assert _get(server, headers=_auth("prometheus", PASSWORD), ctx=_client_ctx(pki))[0] == 200
    with pytest.raises((http.client.HTTPException, ssl.SSLError, ConnectionError)):
        _get(server, headers=_auth("prometheus", PASSWORD), ctx=_client_ctx(pki, "other-client"))


def test_curl_scrapes_with_tls_client_cert_and_password(
    pki: Path, registry: CollectorRegistry, served: list[web.WebServer]
) -> None:
    curl = shutil.which("curl")
    assert curl is not None, "curl is installed on this machine"
    server = web.serve(registry, "127.0.0.1:0", _write_config(pki, _mtls_config(pki)))
    served.append(server)
    base = [
        curl,
        "-sS",
        "--max-time",
        "10",
        "--cacert",
        str(pki / "ca.crt"),
        "--cert",
        str(pki / "client.crt"),
        "--key",
        str(pki / "client.key"),
        "-o",
        "/dev/stdout",
        "-w",
        "\n%{http_code}\n",
    ]
    url = f"https://localhost:{server.address[1]}/metrics"
    ok = subprocess.run([*base, "-u", f"prometheus:{PASSWORD}", url], capture_output=True, text=True, timeout=30)
    assert ok.stdout.rstrip().endswith("200"), ok.stderr
    assert "gpuwatch_test_value 42.0" in ok.stdout
    bad = subprocess.run([*base, "-u", "prometheus:wrong", url], capture_output=True, text=True, timeout=30)
    assert bad.stdout.rstrip().endswith("401")
    nocert = subprocess.run(
        [curl, "-sS", "--max-time", "10", "--cacert", str(pki / "ca.crt"), "-u", f"prometheus:{PASSWORD}", url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert nocert.returncode != 0 and "gpuwatch_test_value" not in nocert.stdout


def test_tls_minimum_version_enforced(pki: Path, registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    cfg = _mtls_config(pki).replace("min_version: TLS12", "min_version: TLS13")
    server = web.serve(registry, "127.0.0.1:0", _write_config(pki, cfg))
    served.append(server)
    old = _client_ctx(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        _get(server, headers=_auth("prometheus", PASSWORD), ctx=old)
    assert _get(server, headers=_auth("prometheus", PASSWORD), ctx=_client_ctx(pki))[0] == 200


def test_basic_auth_over_plain_http_and_security_headers(
    tmp_path: Path, registry: CollectorRegistry, served: list[web.WebServer]
) -> None:
    cfg = _write_config(
        tmp_path, f"basic_auth_users:\n  alice: {HASH}\nhttp_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    )
    server = web.serve(registry, "127.0.0.1:0", cfg)
    served.append(server)
    status, headers, _ = _get(server, headers=_auth("alice", PASSWORD))
    assert status == 200 and headers["X-Frame-Options"] == "deny"
    assert _get(server, headers=_auth("alice", PASSWORD + "x"))[0] == 401


def test_web_config_is_reloaded_and_a_broken_one_keeps_the_last_good(
    tmp_path: Path, registry: CollectorRegistry, served: list[web.WebServer]
) -> None:
    path = _write_config(tmp_path, f"basic_auth_users:\n  alice: {HASH}\n")
    server = web.serve(registry, "127.0.0.1:0", path)
    served.append(server)
    assert _get(server, headers=_auth("alice", PASSWORD))[0] == 200
    new_hash = bcrypt.hashpw(b"rotated", bcrypt.gensalt(4)).decode()
    Path(path).write_text(f"basic_auth_users:\n  alice: {new_hash}\n  padding-to-change-size: {new_hash}\n")
    assert _get(server, headers=_auth("alice", "rotated"))[0] == 200
    assert _get(server, headers=_auth("alice", PASSWORD))[0] == 401
    Path(path).write_text("basic_auth_users: [this is not a mapping]\n")
    assert _get(server, headers=_auth("alice", "rotated"))[0] == 200


BAD_CONFIGS = [
    ("tls_config:\n  cert_file: a\n", "tls_config: unknown key"),
    ("tls_server_config:\n  cert_file: server.crt\n", "tls_server_config.key_file: required"),
    (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: RequireAndVerify\n",
        "tls_server_config.client_auth_type",
    ),
    (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  client_auth_type: RequireAnyClientCert\n  client_ca_file: ca.crt\n",
        "tls_server_config.client_auth_type: RequireAnyClientCert is not supported",
    ),
    (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n",
        "tls_server_config.client_ca_file",
    ),
    (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  min_version: TLS1.2\n",
        "tls_server_config.min_version",
    ),
    (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
        "tls_server_config.cipher_suites: not supported",
    ),
    (
        "tls_server_config:\n  cert_file: missing.crt\n  key_file: server.key\n",
        "tls_server_config.cert_file/key_file: ",
    ),
    (
        "tls_server_config:\n  cert_file: server.crt\n  key_file: client.key\n",
        "tls_server_config.cert_file/key_file: cannot load",
    ),
    ("basic_auth_users:\n  alice: plaintext-password\n", "basic_auth_users.alice: not a bcrypt"),
    ("basic_auth_users: [alice]\n", "basic_auth_users: must be a mapping"),
    ("http_server_config:\n  headers:\n    X-Evil: 1\n", "http_server_config.headers.X-Evil"),
    ("rate_limit:\n  interval: soon\n  burst: 0\n", "rate_limit.interval"),
    ("tls_server_config: [\n", "is not valid YAML"),
]


@pytest.mark.parametrize(("text", "named"), BAD_CONFIGS)
def test_bad_web_config_is_refused_naming_the_key(
    pki: Path, tmp_path: Path, registry: CollectorRegistry, text: str, named: str
) -> None:
    d = tmp_path / "cfg"
    d.mkdir()
    for name in ("server.crt", "server.key", "client.key", "ca.crt"):
        shutil.copy(pki / name, d / name)
    path = _write_config(d, text)
    with pytest.raises(WebConfigError) as err:
        web.serve(registry, "127.0.0.1:0", path)
    assert named in str(err.value)
    assert err.value.path == path


def test_unreadable_web_config(tmp_path: Path, registry: CollectorRegistry) -> None:
    with pytest.raises(WebConfigError, match="cannot read"):
        web.serve(registry, "127.0.0.1:0", str(tmp_path / "absent.yml"))


def _raw(server: web.WebServer, payload: bytes, wait: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", server.address[1]), timeout=wait) as s:
        s.sendall(payload)
        chunks = []
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def test_garbage_requests_never_kill_the_server(registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", None, web.Limits(request_timeout=1.0))
    served.append(server)
    noise = bytes(c for c in os.urandom(8192) if c not in b" \t\r\n\x0b\x0c")[:4096]
    assert _raw(server, b"\x01" + noise + b"\r\n\r\n").startswith(b"HTTP/1.1 400")
    _raw(server, os.urandom(4096) + b"\r\n\r\n")  # any answer, or none; the server lives on
    assert b" 414" in _raw(server, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")[:20]
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    assert _raw(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")[:12] in (
        b"HTTP/1.1 431",
        b"HTTP/1.1 400",
    )
    assert _raw(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 70000 + b"\r\n\r\n").startswith(
        b"HTTP/1.1 4"
    )
    assert _raw(server, b"GET /metrics HTTP/9.9\r\n\r\n").startswith(b"HTTP/1.1 505")
    assert _raw(server, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64)) != b"x"
    assert _raw(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    assert _raw(server, b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 501")
    # A client that hangs up half way.
    with socket.create_connection(("127.0.0.1", server.address[1])) as s:
        s.sendall(b"GET /metr")
    status, _, body = _get(server)
    assert status == 200 and b"gpuwatch_test_value" in body


def test_garbage_on_the_tls_port(pki: Path, registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", _write_config(pki, _mtls_config(pki)), web.Limits(request_timeout=1.0))
    served.append(server)
    for payload in (os.urandom(2048), b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\xff\xff" + os.urandom(100)):
        _raw(server, payload)
    assert _get(server, headers=_auth("prometheus", PASSWORD), ctx=_client_ctx(pki))[0] == 200


def test_slow_clients_are_cut_off_and_cannot_exhaust_the_server(
    registry: CollectorRegistry, served: list[web.WebServer]
) -> None:
    limits = web.Limits(max_connections=4, request_timeout=1.5, write_timeout=5, idle_timeout=1)
    server = web.serve(registry, "127.0.0.1:0", None, limits)
    served.append(server)
    port = server.address[1]
    # Four clients that connect and say nothing (slowloris) fill every slot...
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    time.sleep(0.2)
    # ...so a fifth, a scraper, takes the place of the oldest of them and is answered.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as fifth:
        fifth.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert fifth.recv(100).startswith(b"HTTP/1.1 200")
    with contextlib.suppress(ConnectionResetError):
        assert idle[0].recv(100) == b""
    idle[1].setblocking(False)
    with pytest.raises(BlockingIOError):  # the younger ones are still open: only the oldest went
        idle[1].recv(100)
    idle[1].settimeout(5)
    # The other silent ones are disconnected after request_timeout.
    t0 = time.monotonic()
    for s in idle:
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(100) == b""
        s.close()
    assert time.monotonic() - t0 < 4.0
    # A client trickling one header byte at a time is cut off too.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as trickle:
        t0 = time.monotonic()
        cut = False
        while time.monotonic() - t0 < 4:
            try:
                trickle.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.1)
        assert cut
    status, _, _ = _get(server)
    assert status == 200


def test_many_concurrent_scrapes(registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    server = web.serve(registry, "127.0.0.1:0", None)
    served.append(server)
    results: list[int] = []

    def scrape() -> None:
        for _ in range(5):
            results.append(_get(server)[0])

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [200] * 40


def test_keep_alive_serves_several_requests_on_one_connection(
    registry: CollectorRegistry, served: list[web.WebServer]
) -> None:
    server = web.serve(registry, "127.0.0.1:0", None)
    served.append(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.address[1], timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and b"gpuwatch_test_value" in resp.read()
    finally:
        conn.close()


def test_rate_limit(tmp_path: Path, registry: CollectorRegistry, served: list[web.WebServer]) -> None:
    cfg = _write_config(tmp_path, "rate_limit:\n  interval: 10s\n  burst: 2\n")
    server = web.serve(registry, "127.0.0.1:0", cfg)
    served.append(server)
    assert [_get(server)[0] for _ in range(3)] == [200, 200, 429]


def test_close_releases_the_port(registry: CollectorRegistry) -> None:
    server = web.serve(registry, "127.0.0.1:0", None)
    port = server.address[1]
    server.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    again = web.serve(registry, f"127.0.0.1:{port}", None)
    again.close()


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="gpuwatchd")
    web_config_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def test_web_config_check_command(pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write_config(pki, _mtls_config(pki))
    assert _cli("web-config", "check", good) == 0
    assert "RequireAndVerifyClientCert" in capsys.readouterr().out
    bad = _write_config(tmp_path, "basic_auth_users:\n  bob: hunter2\n")
    assert _cli("web-config", "check", bad) == 2  # a bad config: 2, as `config check` (docs/cli.md)
    err = capsys.readouterr().err
    assert "basic_auth_users.bob" in err and "hunter2" not in err


def test_web_config_commands_through_the_real_cli(pki: Path, tmp_path: Path) -> None:
    def gw(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "web-config", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = gw("hash", "--cost", "4", stdin="s3cret\n")
    assert out.returncode == 0, out.stderr
    hashed = out.stdout.strip()
    assert bcrypt.checkpw(b"s3cret", hashed.encode()) and "s3cret" not in out.stdout
    cfg = _write_config(tmp_path, f"basic_auth_users:\n  alice: {hashed}\n")
    out = gw("check", cfg)
    assert out.returncode == 0 and "basic auth for 1 user(s)" in out.stdout
    out = gw("check", _write_config(tmp_path, "tls_server_config:\n  cert_file: x.crt\n"))
    assert out.returncode == 2 and "tls_server_config.key_file" in out.stderr


SERVER_SCRIPT = """
import sys, time
from prometheus_client import CollectorRegistry, Gauge
from gpuwatchd.cli import web_config as web_config_cli
from gpuwatchd.web import server as web
reg = CollectorRegistry()
Gauge("gpuwatch_test_value", "A value.", registry=reg).set(42)
s = web.serve(reg, "127.0.0.1:0", None, web.Limits(request_timeout=1.0))
print(s.address[1], flush=True)
time.sleep(300)
"""


def test_thread_exhaustion_drops_clients_not_the_server(tmp_path: Path) -> None:
    """In a pids cgroup that allows only a few tasks (systemd's TasksMax=): silent clients cost
    no thread at all (the connection loop holds them); a request for which no worker thread can
    be made is dropped alone; the server never stops accepting."""
    cg = Path(f"/sys/fs/cgroup/pids/gw-h7-web-{os.getpid()}")
    cg.mkdir()
    server = None
    try:
        (cg / "pids.max").write_text("5\n")  # main, the connection loop + 3 workers
        server = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$1"', sys.executable, SERVER_SCRIPT],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        assert server.stdout is not None
        port = int(server.stdout.readline())
        for _ in range(4):  # 4 x 30 silent clients, far more than the 5 tasks allowed
            idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(30)]
            time.sleep(0.3)
            assert int((cg / "pids.current").read_text()) <= 2  # main and the loop, no more
            for s in idle:
                s.close()
            time.sleep(1.5)  # the loop ends the silent ones after request_timeout
        # Not one more task: no worker can be started, so the request is dropped, not the server.
        (cg / "pids.max").write_text((cg / "pids.current").read_text())
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            conn.request("GET", "/metrics")
            conn.getresponse().read()
        conn.close()
        # Threads available again: the dropped clients left no slot taken, so five idle clients
        # and a scrape are served at once.
        (cg / "pids.max").write_text("max\n")
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
        time.sleep(0.3)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and b"gpuwatch_test_value 42.0" in resp.read()
        conn.close()
        for s in idle:
            s.close()
        assert server.poll() is None
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        deadline = time.monotonic() + 10
        while cg.exists():
            try:
                cg.rmdir()
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
