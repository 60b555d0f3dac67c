"""Reload as Type=notify-reload (systemd >= 253) expects it, against a real NOTIFY_SOCKET: on SIGHUP
the daemon sends RELOADING=1 with MONOTONIC_USEC= in the same datagram, then READY=1, for a good
and for a refused config alike; and `gpuwatchd config check` (the unit's ExecReload=) refuses what
the reload refuses, including a bad web.config_file."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from daemonutil import REPO, DaemonProc, write_config


def _datagrams(sock: socket.socket, until: str, timeout: float = 15.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if any(until in g.splitlines() for g in got):
            return got
    raise AssertionError(f"no {until!r} in {got}")


def _reload_messages(sock: socket.socket, d: DaemonProc) -> list[str]:
    t0 = time.monotonic_ns() // 1000
    d.signal(signal.SIGHUP)
    got = _datagrams(sock, "READY=1")
    reloading = [g for g in got if "RELOADING=1" in g.splitlines()]
    assert len(reloading) == 1, got
    fields = dict(line.split("=", 1) for line in reloading[0].splitlines())
    assert t0 <= int(fields["MONOTONIC_USEC"]) <= time.monotonic_ns() // 1000, fields
    assert got.index(reloading[0]) < max(i for i, g in enumerate(got) if "READY=1" in g), got
    return got


def test_sighup_sends_reloading_with_monotonic_usec_then_ready(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        path, cfg = write_config(tmp_path)
        d = DaemonProc(path, cfg, env={"NOTIFY_SOCKET": sock_path})
        try:
            _datagrams(sock, "READY=1")  # the start
            _reload_messages(sock, d)  # a good config
            path.write_text(path.read_text() + "no_such_key: 1\n")
            got = _reload_messages(sock, d)  # refused: still RELOADING=1 ... READY=1
            assert any("STATUS=reload refused" in g for g in got), got
            d.wait_for(lambda: "reload refused" in d.log(), what="the refusal in the log")
        finally:
            assert d.stop() == 0


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )


def test_config_check_refuses_what_a_reload_refuses(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    assert _check(path).returncode == 0
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: /nonexistent/cert.pem\n  key_file: x\n")
    cfg["web"] = {**cfg["web"], "config_file": str(web)}
    path.write_text(yaml.safe_dump(cfg))
    res = _check(path)
    assert res.returncode == 2 and "web.config_file" in res.stderr, res
