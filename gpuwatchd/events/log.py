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

This module is the one home of ``events.jsonl``: ``JsonlSink`` appends to it, ``EventFile`` reads
it back and rewrites it (what the event store, events/store.py, is handed: it counts and
compacts, this does the I/O) and ``read_events`` streams it (``gpuwatchd events``, the CLI
equivalent of ``cat state_dir/events.jsonl``). Cost: one append and fsync per event; a read-back
streams the file a line at a time (at most ``MAX_LINE_BYTES`` held); a rewrite is one atomic
write. Needs write access to ``state_dir`` (the daemon's user); reading it, read access.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from gpuwatchd.model import frozen_map
from gpuwatchd.model.events import Event
from gpuwatchd.model.kinds import ALERT, KINDS
from gpuwatchd.statefile import FILE_MODE, StateFiles

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
MAX_LINE_BYTES = 64 << 10  # an event line is < 2 KiB; a longer one is not ours
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
# The events the push path sends as alerts, each under the alert of the finding kind it records,
# with that alert's static summary and runbook anchor (one row each in gpuwatchd/model/kinds.py,
# which tests/test_finding_kinds.py checks against deploy/prometheus/gpuwatchd.rules.yml).
ALERT_NAMES: Mapping[str, str] = frozen_map({k.event: k.alert for k in KINDS if k.event})
ALERT_SUMMARIES: Mapping[str, str] = frozen_map({k.event: ALERT[k.alert].summary for k in KINDS if k.event})
# An event that pages is a `critical` alert: the monitoring mixins' word for "an on-call person
# acts now", which routing trees written for kube-prometheus send to the pager. Findings and
# events keep their own word, "page" (gpuwatch_finding{severity}, `gpuwatchd ps`).
ALERT_SEVERITY = "critical"
RUNBOOK_ANCHORS: Mapping[str, str] = frozen_map({k.event: k.runbook for k in KINDS if k.event})


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


class EventFile:
    """``state_dir/events.jsonl`` read back and rewritten, for the event store (events/store.py),
    which decides what is counted and what a compaction keeps; the appends are ``JsonlSink``'s.
    A failed rewrite and a line that cannot be used are the ``StateFiles``' to count."""

    def __init__(self, state_dir: str, files: StateFiles | None = None, filename: str = EVENTS_FILE) -> None:
        self.path = os.path.join(state_dir, filename)
        self.files = files or StateFiles()

    def events(self, count_rejected: bool = True) -> Iterator[Event]:
        """Every well-formed event stored, in order (``read_events``); ``count_rejected``: count
        each line that cannot be used in ``gpuwatch_state_records_rejected_total``."""
        path = self.path
        return read_events(path, on_reject=(lambda why: self.files.rejected(path, why)) if count_rejected else None)

    def size(self) -> int | None:
        """The file's size in bytes; None when it cannot be read (absent: nothing stored yet)."""
        try:
            return os.path.getsize(self.path)
        except OSError:
            return None

    def rewrite(self, lines: Iterable[str]) -> bool:
        """Replace the file by ``lines`` (JSON objects, one a line), atomically and fsync'd;
        False when the write failed (counted)."""
        return self.files.write(self.path, "".join(line + "\n" for line in lines), fsync=True)

    def track(self) -> None:
        """Export the file's write-error counter from now on (``StateFiles.track``)."""
        self.files.track(self.path)


class EventSink(Protocol):
    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Append-only JSONL, fsync'd per event (events are rare; losing one is what we promise not
    to do)."""

    def __init__(self, state_dir: str, filename: str = EVENTS_FILE, files: StateFiles | None = None) -> None:
        """``files``: a ``statefile.StateFiles`` that counts and logs failed appends (a full or
        read-only state_dir); without one a failure raises to the EventBus, which logs it."""
        with contextlib.suppress(OSError):  # unwritable: each append fails, and is counted
            os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, filename)
        with contextlib.suppress(OSError):  # a log an older daemon wrote 0600: readable by the group now
            os.chmod(self.path, FILE_MODE)
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
                st = os.fstat(fd)
                if st.st_mode & 0o777 != FILE_MODE:  # the group reads it, whatever the umask
                    with contextlib.suppress(PermissionError):  # another owner's: leave its mode
                        os.fchmod(fd, FILE_MODE)
                # A torn previous line (crash mid-write) must not swallow this one.
                if st.st_size > 0:
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
