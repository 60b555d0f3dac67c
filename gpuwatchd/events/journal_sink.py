"""Events -> the systemd journal, through its native protocol (one datagram per event on
/run/systemd/journal/socket, with MESSAGE_ID, PRIORITY and the event's fields), so that
``journalctl -u gpuwatchd`` shows OOM kills and Xids beside the daemon's log. No dependency on
systemd-python."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from gpuwatchd.events.log import MESSAGE_IDS
from gpuwatchd.model.events import Event

log = logging.getLogger(__name__)


JOURNAL_SOCKET = "/run/systemd/journal/socket"
_PRIORITY = {"page": 2, "warning": 4, "info": 6}  # crit / warning / info


def journal_fields(event: Event) -> dict[str, str]:
    """The structured journal entry of one event (field names: [A-Z0-9_], not starting with _)."""
    f: dict[str, str] = {
        "MESSAGE": event.summary,
        "MESSAGE_ID": MESSAGE_IDS.get(event.kind, MESSAGE_IDS["oom_kill"]),
        "PRIORITY": str(_PRIORITY.get(event.severity, 6)),
        "SYSLOG_IDENTIFIER": "gpuwatchd",
        "GPUWATCH_KIND": event.kind,
        "GPUWATCH_EVENT_KEY": event.key,
        "GPUWATCH_JOB_ID": event.job_id,
        "GPUWATCH_RANK": event.rank,
        "GPUWATCH_SEVERITY": event.severity,
        "GPUWATCH_TIME": f"{event.time:.6f}",
    }
    if event.pid is not None:
        f["GPUWATCH_PID"] = str(event.pid)
    if event.comm:
        f["GPUWATCH_COMM"] = event.comm
    if event.killer:
        f["GPUWATCH_KILLER"] = event.killer
    if event.worker:
        f["GPUWATCH_WORKER"] = "1"
    for k, v in sorted(event.fields.items()):
        if v is None or isinstance(v, (dict, list)):
            continue
        name = "GPUWATCH_" + "".join(c if c.isalnum() else "_" for c in str(k)).upper()
        f[name[:64]] = str(v)
    return f


def encode_native(fields: Mapping[str, str]) -> bytes:
    """journald's native protocol (systemd.io/JOURNAL_NATIVE_PROTOCOL): ``KEY=value\\n``, or for a
    value holding a newline ``KEY\\n<64-bit LE length><value>\\n``."""
    out = bytearray()
    for k, v in fields.items():
        b = v.encode("utf-8", "replace")
        if b"\n" in b:
            out += k.encode() + b"\n" + len(b).to_bytes(8, "little") + b + b"\n"
        else:
            out += k.encode() + b"=" + b + b"\n"
    return bytes(out)


class JournalSink:
    """Structured entries through ``systemd.journal.send`` when systemd-python is installed and
    journald runs; ``socket_path`` writes the native protocol to that socket instead (tests, or a
    container with the host's journal socket mounted elsewhere)."""

    def __init__(self, socket_path: str | None = None) -> None:
        self.socket_path = socket_path
        self.errors = 0
        self._send: Callable[..., Any] | None = None
        if socket_path is None:
            try:
                import systemd.journal

                self._send = systemd.journal.send
            except ImportError:
                self.socket_path = JOURNAL_SOCKET

    @staticmethod
    def available(socket_path: str = JOURNAL_SOCKET) -> bool:
        return os.path.exists(socket_path)

    def emit(self, event: Event) -> None:
        fields = journal_fields(event)
        try:
            if self._send is not None:
                message = fields.pop("MESSAGE")
                self._send(message, **fields)
            else:
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    s.sendto(encode_native(fields), self.socket_path or JOURNAL_SOCKET)
        except OSError as e:
            self.errors += 1
            log.debug("journal sink: %s", e)

    def close(self) -> None:
        pass
