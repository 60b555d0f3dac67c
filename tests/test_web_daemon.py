"""End to end: the real daemon (`gpuwatchd run`) serving /metrics over TLS with client
certificates and basic auth from `web.config_file`, scraped by a real Prometheus whose
scrape_config uses the standard `scheme: https`, `tls_config` and `basic_auth` - the same settings
as for node_exporter with an exporter-toolkit web-config."""

from __future__ import annotations

import base64
import http.client
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from daemonutil import free_port, write_config
from pkiutil import make_pki
from promstack import PROMETHEUS, Prometheus, http_get_json, wait_until

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "scrape-helper7-pw"


@pytest.fixture
def tls_daemon(tmp_path: Path) -> Iterator[dict[str, Any]]:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    (pki / "web-config.yml").write_text(
        "tls_server_config:\n"
        "  cert_file: server.crt\n"
        "  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        "  client_ca_file: ca.crt\n"
        f"basic_auth_users:\n  prometheus: {hashed}\n"
    )
    port = free_port()
    path, _ = write_config(
        tmp_path, web={"listen_address": f"127.0.0.1:{port}", "config_file": str(pki / "web-config.yml")}
    )
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    info = {"pki": pki, "port": port, "proc": proc, "log": tmp_path / "daemon.log", "tmp": tmp_path}
    try:
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _scrape(info: dict[str, Any], password: str = PASSWORD, cert: bool = True) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(info["pki"] / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(info["pki"] / "client.crt"), str(info["pki"] / "client.key"))
    conn = http.client.HTTPSConnection("127.0.0.1", info["port"], context=ctx, timeout=5)
    token = base64.b64encode(f"prometheus:{password}".encode()).decode()
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _ready(info: dict[str, Any]) -> bool:
    assert info["proc"].poll() is None, Path(info["log"]).read_text()
    try:
        status, body = _scrape(info)
    except OSError:
        return False
    return status == 200 and b"gpuwatch_last_cycle_timestamp_seconds" in body


def test_daemon_serves_tls_and_auth_from_its_config(tls_daemon: dict[str, Any]) -> None:
    wait_until(lambda: _ready(tls_daemon), 30, "the daemon over TLS")
    assert _scrape(tls_daemon, password="wrong")[0] == 401
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _scrape(tls_daemon, cert=False)
    plain = http.client.HTTPConnection("127.0.0.1", tls_daemon["port"], timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/metrics")
        plain.getresponse().read()
    plain.close()
    assert tls_daemon["proc"].poll() is None  # none of that disturbed the daemon
    assert _scrape(tls_daemon)[0] == 200


def test_real_prometheus_scrapes_over_mtls_with_basic_auth(tls_daemon: dict[str, Any]) -> None:
    wait_until(lambda: _ready(tls_daemon), 30, "the daemon over TLS")
    pki: Path = tls_daemon["pki"]
    target = [f"127.0.0.1:{tls_daemon['port']}"]
    tls = {"ca_file": str(pki / "ca.crt"), "cert_file": str(pki / "client.crt"), "key_file": str(pki / "client.key")}
    jobs = [
        {
            "job_name": "good",
            "scheme": "https",
            "tls_config": tls,
            "basic_auth": {"username": "prometheus", "password": PASSWORD},
        },
        {
            "job_name": "wrong-password",
            "scheme": "https",
            "tls_config": tls,
            "basic_auth": {"username": "prometheus", "password": "nope"},
        },
        {
            "job_name": "no-client-cert",
            "scheme": "https",
            "tls_config": {"ca_file": str(pki / "ca.crt")},
            "basic_auth": {"username": "prometheus", "password": PASSWORD},
        },
    ]
    for job in jobs:
        job["static_configs"] = [{"targets": target}]
    port = free_port()
    d = tls_daemon["tmp"] / "prometheus"
    d.mkdir()
    (d / "prometheus.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs})
    )
    with (d / "prometheus.log").open("wb") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={d / 'prometheus.yml'}",
                f"--storage.tsdb.path={d / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=d,
        )
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", d / "prometheus.log")
    try:
        prom.wait_ready("/-/ready")

        def health() -> dict[str, tuple[str, str]]:
            targets = http_get_json(prom.url + "/api/v1/targets")["data"]["activeTargets"]
            return {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets}

        wait_until(
            lambda: all(h != "unknown" for h, _ in health().values()) and len(health()) == 3,
            30,
            "three scraped targets",
        )
        time.sleep(1.5)
        h = health()
        assert h["good"] == ("up", ""), h
        assert h["wrong-password"][0] == "down" and "401" in h["wrong-password"][1], h
        assert h["no-client-cert"][0] == "down", h
        result = prom.query('gpuwatch_build_info{job="good"}')
        assert len(result) == 1 and result[0]["value"][1] == "1"
    finally:
        prom.stop()


def _wait_plain(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    def ok() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/metrics")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False

    wait_until(ok, 30, "plain /metrics")


def test_web_config_flag_bad_file_at_start_and_on_reload(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    good = pki / "web-config.yml"
    good.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
        f"basic_auth_users:\n  prometheus: {hashed}\n"
    )
    bad = pki / "bad-web-config.yml"
    bad.write_text("basic_auth_users:\n  prometheus: hunter2\ntls_server_config:\n  cert_file: server.crt\n")
    port = free_port()
    path, cfg = write_config(tmp_path, web={"listen_address": f"127.0.0.1:{port}"})
    run = [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(path)]

    # A bad web-config at start: exit 2, every bad key named, the password never echoed.
    out = subprocess.run([*run, "--web.config.file", str(bad)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "web.config_file: basic_auth_users.prometheus: not a bcrypt hash" in out.stderr
    assert "tls_server_config.key_file" in out.stderr and "hunter2" not in out.stderr

    # --web.config.file overrides the file's (absent) web.config_file.
    info = {"pki": pki, "port": port}
    log_path = tmp_path / "flag.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*run, "--web.config.file", str(good)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_until(lambda: _ready({**info, "proc": proc, "log": log_path}), 30, "TLS via flag")
            assert _scrape(info, password="wrong")[0] == 401
        finally:
            proc.terminate()
            proc.wait(15)

    # SIGHUP: a broken web-config is refused and the running server keeps serving; a good one
    # is applied (TLS from then on).
    log_path = tmp_path / "reload.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(run, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            _wait_plain(port, proc, log_path)
            cfg["web"]["config_file"] = str(bad)
            path.write_text(yaml.safe_dump(cfg))
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "reload refused" in log_path.read_text(), 15, "reload refused")
            assert "web.config_file: basic_auth_users.prometheus" in log_path.read_text()
            _wait_plain(port, proc, log_path)
            cfg["web"]["config_file"] = str(good)
            path.write_text(yaml.safe_dump(cfg))
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda: _ready({**info, "proc": proc, "log": log_path}), 30, "TLS after reload")
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(15)
