"""End to end: the real daemon (`gpuwatchd run`) serving /metrics over TLS with client
certificates and basic auth from `web.config_file`, scraped by a real Prometheus whose
scrape_config uses the standard `scheme: https`, `tls_config` and `basic_auth` - the same settings
as for node_exporter with an exporter-toolkit web-config."""

from __future__ import annotations

import base64
import http.client
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
    path, _ = write_config(tmp_path, web={"listen_address": f"127.0.0.1:{port}",
                                          "config_file": str(pki / "web-config.yml")})
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    info = {"pki": pki, "port": port, "proc": proc, "log": tmp_path / "daemon.log",
            "tmp": tmp_path}
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


def _scrape(info: dict[str, Any], password: str = PASSWORD,
            cert: bool = True) -> tuple[int, bytes]:
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
    tls = {"ca_file": str(pki / "ca.crt"), "cert_file": str(pki / "client.crt"),
           "key_file": str(pki / "client.key")}
    jobs = [
        {"job_name": "good", "scheme": "https", "tls_config": tls,
         "basic_auth": {"username": "prometheus", "password": PASSWORD}},
        {"job_name": "wrong-password", "scheme": "https", "tls_config": tls,
         "basic_auth": {"username": "prometheus", "password": "nope"}},
        {"job_name": "no-client-cert", "scheme": "https",
         "tls_config": {"ca_file": str(pki / "ca.crt")},
         "basic_auth": {"username": "prometheus", "password": PASSWORD}},
    ]
    for job in jobs:
        job["static_configs"] = [{"targets": target}]
    port = free_port()
    d = tls_daemon["tmp"] / "prometheus"
    d.mkdir()
    (d / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}))
    with (d / "prometheus.log").open("wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={d / 'prometheus.yml'}",
             f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT, cwd=d)
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", d / "prometheus.log")
    try:
        prom.wait_ready("/-/ready")

        def health() -> dict[str, tuple[str, str]]:
            targets = http_get_json(prom.url + "/api/v1/targets")["data"]["activeTargets"]
            return {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets}

        wait_until(lambda: all(h != "unknown" for h, _ in health().values())
                   and len(health()) == 3, 30, "three scraped targets")
        time.sleep(1.5)
        h = health()
        assert h["good"] == ("up", ""), h
        assert h["wrong-password"][0] == "down" and "401" in h["wrong-password"][1], h
        assert h["no-client-cert"][0] == "down", h
        result = prom.query('gpuwatch_build_info{job="good"}')
        assert len(result) == 1 and result[0]["value"][1] == "1"
    finally:
        prom.stop()
