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
import datetime as dt
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwatchd.model import PAGE, frozen_map

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


# --- journal ------------------------------------------------------------------------------------

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


# --- Alertmanager --------------------------------------------------------------------------------


def derive_instance(listen_address: str, hostname: str | None = None) -> str:
    """The ``instance`` label Prometheus gives this daemon's series when it scrapes
    ``<host>:<port>``: a wildcard listen host becomes this machine's name."""
    host, _, port = listen_address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = hostname or socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


def alert_for(
    event: Event,
    instance: str,
    runbook_base: str = RUNBOOK_BASE,
    hold_seconds: float = 900.0,
    scrape_job: str = "gpuwatchd",
) -> dict[str, Any] | None:
    """The Alertmanager v2 alert of one event, or None when the event does not page.

    The labels are exactly those the Prometheus rule's alert carries (deploy/prometheus/
    gpuwatchd.rules.yml: every label of the counter series, plus ``instance`` and ``job`` that
    Prometheus attaches at scrape time, plus ``severity``), so Alertmanager sees one alert with one
    fingerprint whichever path delivers it first."""
    name = ALERT_NAMES.get(event.kind)
    if name is None or not event.alert:
        return None
    labels = {"alertname": name, "instance": instance, "job": scrape_job, "severity": PAGE}
    if event.kind == "oom_kill":
        labels.update(job_id=event.job_id, rank=event.rank, comm=event.comm, killer=event.killer)
    else:  # Xid: the GPU is the subject, as in gpuwatch_gpu_xid_errors_total
        f = event.fields
        labels.update(
            gpu=str(f.get("gpu", "")), uuid=str(f.get("uuid", "")), xid=str(f.get("xid", ""))
        )
    # Alertmanager drops empty label values; so does Prometheus on the rule side.
    labels = {k: v for k, v in labels.items() if v != ""}
    start = dt.datetime.fromtimestamp(event.time, dt.timezone.utc)
    end = dt.datetime.fromtimestamp(max(event.time, time.time()) + hold_seconds, dt.timezone.utc)
    return {
        "labels": labels,
        "annotations": {
            "summary": event.summary.split(";")[0][:200],
            "description": event.summary,
            "runbook_url": f"{runbook_base}#{RUNBOOK_ANCHORS.get(event.kind, '')}",
        },
        "startsAt": start.isoformat().replace("+00:00", "Z"),
        "endsAt": end.isoformat().replace("+00:00", "Z"),
    }


class AlertmanagerSink:
    """Pushes paging events to ``url``/api/v2/alerts from a background thread (a slow or dead
    Alertmanager never delays the kernel-log thread). Retries with back-off for ``retry_seconds``."""

    def __init__(
        self,
        url: str,
        instance: str,
        timeout_seconds: float = 2.0,
        retry_seconds: float = 60.0,
        runbook_base: str = RUNBOOK_BASE,
        scrape_job: str = "gpuwatchd",
    ) -> None:
        self.scrape_job = scrape_job
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.instance = instance
        self.timeout = timeout_seconds
        self.retry_seconds = retry_seconds
        self.runbook_base = runbook_base
        self.sent = 0
        self.errors = 0
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._loop, name="alertmanager-push", daemon=True)
        self._thread.start()

    def emit(self, event: Event) -> None:
        alert = alert_for(event, self.instance, self.runbook_base, scrape_job=self.scrape_job)
        if alert is None:
            return
        try:
            self._q.put_nowait(alert)
        except queue.Full:
            self.errors += 1
            log.warning("alertmanager queue full; alert %s dropped", event.key)

    def post(self, alerts: Sequence[dict[str, Any]]) -> None:
        body = json.dumps(list(alerts)).encode()
        req = urllib.request.Request(
            self.endpoint, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            resp.read()

    def _loop(self) -> None:
        while True:
            alert = self._q.get()
            if alert is None:
                return
            batch = [alert]
            while True:  # everything already queued goes in one request
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._deliver(batch)
                    return
                batch.append(nxt)
            self._deliver(batch)

    def _deliver(self, batch: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.2
        while True:
            try:
                self.post(batch)
                self.sent += len(batch)
                return
            except (OSError, urllib.error.URLError, ValueError) as e:
                self.errors += 1
                if time.monotonic() + delay > deadline:
                    log.warning("alertmanager push failed, %d alerts dropped: %s", len(batch), e)
                    return
                log.info("alertmanager push failed (%s); retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=1.0)
        self._thread.join(timeout=self.timeout + 1.0)


class EventBus:
    """Fan-out to the sinks; the JSONL sink first (durability), each sink isolated."""

    def __init__(self, sinks: Iterable[EventSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except OSError as e:  # disk full, socket gone: never take the reader thread down
                log.warning("event sink %s failed: %s", type(sink).__name__, e)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_bus(
    state_dir: str,
    alertmanager_url: str | None = None,
    instance: str = "",
    timeout_seconds: float = 2.0,
    journal: bool | None = None,
    scrape_job: str = "gpuwatchd",
    files: Any = None,
) -> EventBus:
    """The daemon's sinks: JSONL always, the journal when journald runs, Alertmanager when set."""
    sinks: list[EventSink] = [JsonlSink(state_dir, files=files)]
    if journal if journal is not None else JournalSink.available():
        sinks.append(JournalSink())
    if alertmanager_url:
        sinks.append(
            AlertmanagerSink(alertmanager_url, instance, timeout_seconds, scrape_job=scrape_job)
        )
    return EventBus(sinks)
