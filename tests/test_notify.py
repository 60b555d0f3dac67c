"""sd_notify against a real AF_UNIX datagram socket passed as NOTIFY_SOCKET, as systemd does."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
from daemonutil import DaemonProc, write_config

from gpuwatchd.daemon import notify


def receive_until(sock: socket.socket, wanted: str, timeout: float = 15.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            break
        got.extend(msg.splitlines())
        if any(line.startswith(wanted) for line in got):
            return got
    raise AssertionError(f"no {wanted!r} in {got}")


def test_daemon_speaks_the_notify_protocol(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        path, cfg = write_config(tmp_path)
        d = DaemonProc(path, cfg, env={"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "1000000"})
        try:
            got = receive_until(sock, "READY=1")
            got += receive_until(sock, "WATCHDOG=1")
            assert any(line.startswith("STATUS=0/0 ranks alive") for line in got), got
            # pings keep coming at about half of WATCHDOG_USEC
            t0 = time.monotonic()
            receive_until(sock, "WATCHDOG=1", timeout=3)
            receive_until(sock, "WATCHDOG=1", timeout=3)
            assert time.monotonic() - t0 < 2.5
        finally:
            rc = d.stop()
        assert rc == 0
        receive_until(sock, "STOPPING=1", timeout=5)


@pytest.mark.parametrize("systemd_python", [False, True])
def test_abstract_namespace_with_and_without_systemd_python(
    monkeypatch: pytest.MonkeyPatch, systemd_python: bool
) -> None:
    if not systemd_python:  # not installed: the datagram is written by hand
        monkeypatch.setitem(sys.modules, "systemd", None)
    name = f"gpuwatchd-test-{os.getpid()}-{systemd_python}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify("READY=1")
        assert sock.recv(100) == b"READY=1"
    if not systemd_python:  # the fallback says False (systemd-python's notify() raises OSError)
        monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/socket")
        assert not notify.notify("READY=1")


def test_no_socket_is_a_no_op(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert notify.watchdog_interval() is None
