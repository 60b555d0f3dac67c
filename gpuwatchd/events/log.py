"""Events (OOM kills, Xids, ...) -> the JSONL log in state_dir, the journal, Alertmanager.

An ``Event`` is one thing that happened once (unlike a ``Finding``, which is a state). Every event
goes, in this order, to:

1. ``state_dir/events.jsonl`` (appended and fsync'd before anything else sees the event: this file
   is what the counters are rebuilt from after a restart, and what ``gpuwatchd events`` shows);
2. the systemd journal as a structured entry (``MESSAGE_ID``, ``GPUWATCH_JOB_ID``,
   ``GPUWATCH_RANK`` ...; ``journalctl MESSAGE_ID=<id>`` finds every OOM kill of every rank);
3. optionally Alertmanager's v2 API (``POST /api/v2/alerts``), with the same alert name and labels
   as the Prometheus rule so that Alertmanager merges the two paths into one notification.

Sinks never raise into the caller: a full disk, a missing journald or an unreachable Alertmanager
is logged and counted, and the event still reaches the other sinks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwatchd.model import frozen_map

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
MAX_LINE_BYTES = 64 << 10  # an event line is < 2 KiB; a longer one is not ours
MAX_COUNT = 1 << 53  # the largest count a float counter holds exactly
MAX_TIME = 253402300800.0  # year 10000: later times cannot be formatted (gpuwatchd events)
RUNBOOK_BASE = "https://github.com/gpuwatchd/gpuwatchd/blob/main/docs/runbooks.md"

# journalctl MESSAGE_ID=... ; generated once with `journalctl --new-id128`, never change them.
MESSAGE_IDS: Mapping[str, str] = frozen_map(
    {
        "oom_kill": "9c5f1d0e6a2b4f7e8d3c1b0a59e4f2d7",
        "xid": "4e2a7c9b1d8f4a6c9b0e3d5f7a1c2e48",
        "oom_kill_unexplained": "b7d94e1c3a5f4b2e8c6d0a9f1e3b5c7d",
        "oom_kill_history": "d5d1bc7a5afe49e592eae3ff8d587a3f",
        "memory_snapshot": "b4123e60439d4076944d6c22d1ced6b1",
    }
)
ALERT_NAMES: Mapping[str, str] = frozen_map({"oom_kill": "GPURankOOMKilled", "xid": "GPUXidCritical"})
RUNBOOK_ANCHORS: Mapping[str, str] = frozen_map(
    {"oom_kill": "gpurankoomkilled", "xid": "gpuxidcritical"}
)


@dataclass(frozen=True)
class Event:
    """One occurrence. ``key`` identifies it across sources and restarts (for a kernel record:
    boot id + kernel timestamp + PID), so that it is stored and counted at most once."""

    key: str
    kind: str  # oom_kill | xid | oom_kill_unexplained | oom_kill_history | memory_snapshot | ...
    time: float  # Unix seconds of the occurrence (the kernel's timestamp, not when we read it)
    severity: str
    summary: str  # the one line a human reads
    job_id: str = ""
    rank: str = ""
    pid: int | None = None
    comm: str = ""
    killer: str = ""  # kernel | systemd-oomd | earlyoom (oom kills)
    worker: bool = False  # the victim was a child of the rank (DataLoader worker), not the rank
    boot_id: str = ""
    counter: str = ""  # the CounterStore counter this event incremented ("" for none)
    labels: tuple[str, ...] = ()  # its label values
    count: int = 1
    fields: Mapping[str, Any] = field(default_factory=frozen_map)  # rss_bytes, memcg, xid, gpu ...
    alert: bool = False  # worth a page (pushed to Alertmanager when configured)

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fields"] = dict(self.fields)
        d["labels"] = list(self.labels)
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Event:
        if not isinstance(d.get("key"), str) or not isinstance(d.get("kind"), str):
            raise ValueError("event without key/kind")
        labels = d.get("labels") or ()
        if not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) for x in labels):
            raise ValueError("bad labels")
        fields = d.get("fields") or {}
        if not isinstance(fields, dict):
            raise ValueError("bad fields")
        pid = d.get("pid")
        when = d.get("time", 0.0)
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when) \
                or not 0 <= when < MAX_TIME:
            raise ValueError(f"bad time {when!r}"[:80])
        count = d.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
            raise ValueError(f"bad count {count!r}"[:80])
        return cls(
            key=d["key"],
            kind=d["kind"],
            time=float(when),
            severity=str(d.get("severity", "")),
            summary=str(d.get("summary", "")),
            job_id=str(d.get("job_id", "")),
            rank=str(d.get("rank", "")),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 32
            else None,
            comm=str(d.get("comm", "")),
            killer=str(d.get("killer", "")),
            worker=bool(d.get("worker", False)),
            boot_id=str(d.get("boot_id", "")),
            counter=str(d.get("counter", "")),
            labels=tuple(labels),
            count=count,
            fields=frozen_map(fields),
            alert=bool(d.get("alert", False)),
        )


def _lines(f: Any, limit: int) -> Iterator[bytes | None]:
    """The lines of ``f``; None for a line longer than ``limit`` (skipped without holding it)."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of the long line, in pieces
                raw = f.readline(limit + 1)
            yield None
            continue
        yield raw


def read_events(path: str, on_reject: Callable[[str], None] | None = None) -> Iterator[Event]:
    """Every well-formed event of a JSONL log, in order. Every line is untrusted input (a crash
    in the middle of an append leaves a torn line; a disk error or a hand edit, anything): a line
    that is not a usable event is skipped and reported to ``on_reject`` with the reason."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - generator closes it
    except FileNotFoundError:
        return
    with f:
        for raw in _lines(f, MAX_LINE_BYTES):
            reason = "too_long"
            if raw is not None:
                if not raw.strip():
                    continue
                try:
                    d = json.loads(raw)
                    if isinstance(d, dict):
                        yield Event.from_dict(d)
                        continue
                    reason = "not_an_object"
                except (ValueError, TypeError, OverflowError, RecursionError):
                    # UnicodeDecodeError and JSONDecodeError are ValueErrors; json turns 1e400
                    # into inf (refused by from_dict), deep nesting raises RecursionError
                    reason = "malformed"
            if on_reject is not None:
                on_reject(reason)


class EventSink(Protocol):
    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Append-only JSONL, fsync'd per event (events are rare; losing one is what we promise not
    to do)."""

    def __init__(self, state_dir: str, filename: str = EVENTS_FILE, files: Any = None) -> None:
        """``files``: a ``statefile.StateFiles`` that counts and logs failed appends (a full or
        read-only state_dir); without one a failure raises to the EventBus, which logs it."""
        with contextlib.suppress(OSError):  # unwritable: each append fails, and is counted
            os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, filename)
        self.files = files
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        if self.files is None:
            self._append(event)
            return
        try:
            self._append(event)
        except OSError as e:
            self.files.failed(self.path, e)
        else:
            self.files.succeeded(self.path)

    def _append(self, event: Event) -> None:
        line = (event.to_json() + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                # A torn previous line (crash mid-write) must not swallow this one.
                if os.fstat(fd).st_size > 0:
                    with open(self.path, "rb") as f:
                        f.seek(-1, os.SEEK_END)
                        if f.read(1) != b"\n":
                            line = b"\n" + line
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        pass
