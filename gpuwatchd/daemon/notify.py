"""systemd notify protocol (sd_notify(3)): READY=1, STATUS=..., WATCHDOG=1, STOPPING=1.

Uses systemd-python's ``systemd.daemon.notify`` when it is installed, else writes the datagram
itself (the protocol is one AF_UNIX datagram to $NOTIFY_SOCKET; a leading '@' is the abstract
namespace). Without NOTIFY_SOCKET (not started by systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


def _raw_notify(message: str, sock_path: str) -> bool:
    addr = "\0" + sock_path[1:] if sock_path.startswith("@") else sock_path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(message.encode("utf-8"), addr)
        except OSError:
            return False
    return True


def notify(message: str) -> bool:
    sock_path = os.environ.get("NOTIFY_SOCKET")
    if not sock_path:
        return False
    try:
        from systemd import daemon as sd_daemon  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return _raw_notify(message, sock_path)
    return bool(sd_daemon.notify(message))


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds (as sd_watchdog_enabled recommends), or None."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
