"""What `gpuwatchd run` loads (issue 14: the daemon's RSS next to nvitop-exporter's).

Without TLS, basic auth or an Alertmanager, the running daemon maps neither OpenSSL (libssl,
libcrypto: 4 MiB resident, loaded by ssl, hashlib, hmac, http.client, urllib.request or
prometheus_client) nor bcrypt, even after Prometheus-style OpenMetrics scrapes; and a fresh
interpreter importing the run path imports none of the modules that pull them in. With TLS
configured ssl is loaded (and serves): the cuts are lazy, not removals. bench/rss.py has the
numbers."""

from __future__ import annotations

import base64
import gzip
import json
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from daemonutil import REPO, DaemonProc, write_config
from pkiutil import make_pki

FIXTURE = REPO / "tests/fixtures/nvml/h200_bench_9procs.json"
# Modules the run path must not import (each loads OpenSSL, bcrypt or a big unused package).
LAZY = (
    "ssl",
    "_ssl",
    "hashlib",
    "_hashlib",
    "hmac",
    "secrets",
    "bcrypt",
    "prometheus_client",
    "http.client",
    "http.server",
    "email",
    "urllib.request",
    "statistics",
    "decimal",
    "platform",
    "html",
    "encodings.idna",
    "tempfile",
    "shutil",
    "bz2",
    "lzma",
    "ctypes.util",
)
LIBS = ("libssl", "libcrypto", "/_ssl.", "/_hashlib.", "_bcrypt", "/_decimal.")
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;"
    "escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def mapped(pid: int) -> set[str]:
    return {
        line.split()[-1]
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if len(line.split()) >= 6 and any(k in line for k in LIBS)
    }


def test_run_path_imports_nothing_that_loads_openssl() -> None:
    code = (
        "import sys, json\nimport gpuwatchd.cli, gpuwatchd.daemon.core, gpuwatchd.web.server\n"
        f"print(json.dumps(sorted(m for m in {LAZY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert json.loads(out) == []


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# Every Accept a scraper sends (tests/test_exposition_formats.py has what each one chooses), and
# the requests that used to fall back to prometheus_client: text 1.0.0 and a name[] filter.
ACCEPTS = (
    PROMETHEUS_ACCEPT,
    "",
    "*/*",
    "text/plain; version=0.0.4",
    "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=2.0.0",
    "application/openmetrics-text;version=0.0.1",
)


def test_running_daemon_maps_no_openssl_until_tls_is_configured(tmp_path: Path) -> None:
    """Whatever a client asks for (every Accept, name[], gzip), no request loads prometheus_client
    (which loads ssl) or grows the daemon: RSS stays within 1 MiB of the first scrape's (the
    fallback to client_python added 8.2 MiB and libssl for the life of the process)."""
    cfg_path, cfg = write_config(tmp_path, nvml={"enabled": True, "fixture": str(FIXTURE)})
    d = DaemonProc(cfg_path, cfg)
    try:
        requests = [(d.url, {"Accept": a} if a else {}) for a in ACCEPTS] + [
            (d.url + "?name[]=gpuwatch_gpu_info&name[]=process_open_fds", {}),
            (d.url + "?name[]=gpuwatch_gpu_info", {"Accept": "text/plain;version=1.0.0"}),
            (d.url, {"Accept-Encoding": "gzip"}),
        ]
        first = None
        for url, headers in requests:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
                body = r.read()
                if r.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert b"gpuwatch_gpu_info" in body
            rss = rss_kib(d.proc.pid)
            first = first or rss
            print(f"RSS {rss / 1024:6.1f} MiB after {url.split('/metrics')[1] or '/metrics'} {headers}")
            assert mapped(d.proc.pid) == set(), (url, headers)
            assert rss - first < 1024, (url, headers, rss, first)
    finally:
        assert d.stop() == 0


SERVE_AND_ASK = """
import json, socket, sys
from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.model import NodeState
from gpuwatchd.web.server import serve

state = NodeState(timestamp=1.0)
server = serve(make_registry(lambda: state, CounterStore()), "127.0.0.1:0")
for query, headers in json.loads(sys.argv[1]):
    s = socket.socket()  # raw, and no getaddrinfo (its str host loads encodings.idna)
    s.settimeout(10)
    s.connect(server.address)  # urllib would import ssl into this process
    head = "".join(f"{k}: {v}\\r\\n" for k, v in headers.items())
    s.sendall(f"GET /metrics{query} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n{head}\\r\\n".encode())
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    assert got.startswith(b"HTTP/1.1 200"), got[:100]
server.close()
print(json.dumps(sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)))
"""


def test_no_request_imports_what_loads_openssl() -> None:
    """In the serving process itself: after every Accept, name[] and gzip request, none of the
    LAZY modules (prometheus_client, ssl, hashlib, http.client, ...) has been imported."""
    requests = [("", {"Accept": a} if a else {}) for a in ACCEPTS] + [
        ("?name[]=gpuwatch_build_info&name[]=process_open_fds", {}),
        ("?name[]=gpuwatch_build_info", {"Accept": "text/plain;version=1.0.0"}),
        ("", {"Accept-Encoding": "gzip"}),
        ("", {"Accept-Encoding": "gzip", "Accept": PROMETHEUS_ACCEPT}),
    ]
    out = subprocess.run(
        [sys.executable, "-c", SERVE_AND_ASK, json.dumps(requests), json.dumps(LAZY)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki-rss"))


def test_tls_and_basic_auth_still_load_ssl_and_bcrypt(tmp_path: Path, pki: Path) -> None:
    web_cfg = tmp_path / "web.yml"
    password = "hunter2 hunter2"
    web_cfg.write_text(
        f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n"
        f"  key_file: {pki / 'server.key'}\nbasic_auth_users:\n"
        f"  prometheus: {bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()}\n"
    )
    cfg_path, cfg = write_config(tmp_path, web={"config_file": str(web_cfg)})
    url = f"https://{cfg['web']['listen_address']}/metrics"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    token = base64.b64encode(f"prometheus:{password}".encode()).decode()
    req = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg_path)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        body = b""
        deadline = time.monotonic() + 30
        while not body:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            try:
                with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
                    body = r.read()
            except OSError:
                time.sleep(0.2)
        assert b"gpuwatch_build_info" in body
        libs = " ".join(mapped(proc.pid))
        assert "libssl" in libs and "_bcrypt" in libs, libs
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_allocator_limits_arenas_and_trims_under_glibc() -> None:
    """daemon/allocator.py: glibc takes M_ARENA_MAX (mallopt returns 1) and malloc_trim runs;
    in a child, so the test process keeps its own allocator settings."""
    code = "from gpuwatchd.daemon import allocator\nok = allocator.limit_arenas()\nallocator.trim()\nprint(ok)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "True"
