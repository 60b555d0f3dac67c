"""The /metrics server across SIGHUP and at start (issue 11, items 2 and 12): the real daemon
(`gpuwatchd run`) reloading to an address that cannot be bound, then to one that can; a reload on
the same address that turns TLS on; the start-up log with TLS. Real sockets on loopback, real
TLS with the PKI of tests/pkiutil.py, real signals."""

from __future__ import annotations

import http.client
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from daemonutil import REPO, DaemonProc, free_port, write_config
from pkiutil import make_pki
from prometheus_client import CollectorRegistry, Gauge
from promstack import wait_until

from gpuwatchd.web import server as web
from gpuwatchd.web.web_config import WebConfigError

TLS_CONFIG = "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"


def _plain_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return b"gpuwatch_build_info" in r.read()
    except OSError:
        return False


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sighup_to_an_address_in_use_keeps_the_running_server(tmp_path: Path) -> None:
    """Item 2: the old server was closed first, then OSError: Address already in use escaped
    reload() and the daemon died."""
    port = free_port()
    path, cfg = write_config(tmp_path, web={"listen_address": f"127.0.0.1:{port}"})
    d = DaemonProc(path, cfg)
    try:
        with socket.socket() as blocker:  # someone else holds the new address
            blocker.bind(("127.0.0.1", 0))
            blocker.listen()
            taken = int(blocker.getsockname()[1])
            cfg["web"]["listen_address"] = f"127.0.0.1:{taken}"
            path.write_text(yaml.safe_dump(cfg))
            d.signal(signal.SIGHUP)
            d.wait_for(lambda: "reload refused" in d.log(), 15, "reload refused")
            log = d.log()
            assert f"web.listen_address: cannot listen on 127.0.0.1:{taken}: Address already in use" in log, log
            assert f"still serving http://127.0.0.1:{port}/metrics" in log
            # The daemon lives on, serving on the old address, cycle after cycle.
            before = d.value("gpuwatch_last_cycle_timestamp_seconds")
            d.wait_for(lambda: d.value("gpuwatch_last_cycle_timestamp_seconds") != before, 15, "another cycle")
            assert d.proc.poll() is None and _plain_ok(port)
        # The address is free now: the next SIGHUP moves the server there, the old one closes.
        d.signal(signal.SIGHUP)
        wait_until(lambda: _plain_ok(taken), 15, "the server on the new address")
        # The new server answers before reload() has closed the old one (it starts first, then
        # the old listener's thread is stopped and closes its socket): poll for the close.
        wait_until(lambda: _refused(port), 15, "the old address closed")
        assert d.proc.poll() is None
        assert f"serving http://127.0.0.1:{taken}/metrics" in d.log()
    finally:
        d.stop()


def test_reload_on_the_same_address_turns_tls_on_and_ends_plain_connections(tmp_path: Path) -> None:
    """A reload that keeps the address keeps the socket (no second bind, so it cannot fail) and
    swaps the web-config; a keep-alive connection accepted as plain HTTP is not answered under
    the new TLS settings."""
    pki = make_pki(tmp_path)
    (tmp_path / "web-config.yml").write_text(TLS_CONFIG)
    reg = CollectorRegistry()
    Gauge("gpuwatch_test_value", "A value for the reload test.", registry=reg).set(7)
    server = web.serve(reg, "127.0.0.1:0", None)
    try:
        port = server.address[1]
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        plain.request("GET", "/metrics")
        assert plain.getresponse().read().count(b"gpuwatch_test_value 7.0") == 1
        same = server.reload(f"127.0.0.1:{port}", str(tmp_path / "web-config.yml"))
        assert same is server and server.address[1] == port
        assert server.url == f"https://127.0.0.1:{port}/metrics"
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/metrics")
            plain.getresponse().read()
        plain.close()
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        tls = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
        tls.request("GET", "/metrics")
        resp = tls.getresponse()
        assert resp.status == 200 and b"gpuwatch_test_value 7.0" in resp.read()
        tls.close()
        # A bad web-config is refused before anything changes.
        (tmp_path / "bad.yml").write_text("tls_server_config:\n  cert_file: server.crt\n")
        with pytest.raises(WebConfigError):
            server.reload(f"127.0.0.1:{port}", str(tmp_path / "bad.yml"))
        assert server.url.startswith("https://")
    finally:
        server.close()


def test_start_up_log_says_https_when_tls_is_on(tmp_path: Path) -> None:
    """Item 12: with TLS on, the daemon logged `serving metrics on http://...`."""
    pki = make_pki(tmp_path)
    (pki / "web-config.yml").write_text(TLS_CONFIG)
    port = free_port()
    path, _ = write_config(
        tmp_path, web={"listen_address": f"127.0.0.1:{port}", "config_file": str(pki / "web-config.yml")}
    )
    log_path = tmp_path / "daemon.log"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
        try:
            conn.request("GET", "/metrics")
            return b"gpuwatch_last_cycle_timestamp_seconds" in conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        try:
            wait_until(ready, 30, "the daemon over TLS")
        finally:
            proc.terminate()
            proc.wait(15)
    log = log_path.read_text()
    assert f"serving https://127.0.0.1:{port}/metrics" in log, log
    assert "http://" not in log, log


def test_reload_to_an_address_overlapping_the_running_one_is_refused() -> None:
    """127.0.0.1:P -> 0.0.0.0:P cannot be bound while the running server holds P: refused,
    and the running server is untouched."""
    reg = CollectorRegistry()
    Gauge("gpuwatch_test_value", "A value for the reload test.", registry=reg).set(7)
    server = web.serve(reg, "127.0.0.1:0", None)
    try:
        port = server.address[1]
        with pytest.raises(OSError):
            server.reload(f"0.0.0.0:{port}", None)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and b"gpuwatch_test_value 7.0" in resp.read()
        conn.close()
    finally:
        server.close()
