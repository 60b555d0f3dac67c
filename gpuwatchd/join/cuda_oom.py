"""CUDA out-of-memory events, daemon side: read and remove the event files the rank hook wrote
(rank/cuda_oom.py: ``cuda_oom-<job>-<rank>-<pid>-<ns>.event`` in the rank directory), count
``cuda_oom_errors{job_id,rank,gpu}`` and explain each as a ``cuda_oom`` finding that names the
co-tenants of the GPU.

Reads: the rank directory (one ``scandir`` per cycle; each file at most ``MAX_EVENT_BYTES``, opened
with O_NOFOLLOW, at most ``MAX_EVENTS_PER_SCAN`` per cycle). A bad file is reported and removed,
never raised.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat as statmod
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model import WARNING, Finding, NodeState
from gpuwatchd.rank.cuda_oom import MAX_EVENT_BYTES, PREFIX, SUFFIX

log = logging.getLogger(__name__)

MAX_EVENTS_PER_SCAN = 256
FINDING_SECONDS = 600.0  # a cuda_oom finding stays active this long after the error


@dataclass(frozen=True)
class OomEvent:
    job_id: str
    rank: int
    pid: int
    timestamp: float
    device_uuid: str
    requested_bytes: int | None
    co_tenants: tuple[tuple[int, int | None], ...] | None  # (pid, bytes) at the moment, if known
    path: str = ""


def _parse(doc: Any, path: str) -> OomEvent:
    if not isinstance(doc, dict) or doc.get("kind") != "cuda_oom":
        raise ValueError("not a cuda_oom event")
    tenants = doc.get("co_tenants")
    co: tuple[tuple[int, int | None], ...] | None = None
    if isinstance(tenants, list):
        co = tuple(
            (int(t["pid"]), None if t.get("used_memory_bytes") is None
             else int(t["used_memory_bytes"]))
            for t in tenants
            if isinstance(t, dict) and "pid" in t
        )
    req = doc.get("requested_bytes")
    return OomEvent(
        job_id=str(doc["job_id"])[:128],
        rank=int(doc["rank"]),
        pid=int(doc["pid"]),
        timestamp=float(doc["timestamp"]),
        device_uuid=str(doc.get("device_uuid") or "")[:96],
        requested_bytes=None if req is None else int(req),
        co_tenants=co,
        path=path,
    )


def _read_one(path: str) -> OomEvent:
    """One event file; OSError (e.g. ELOOP for a symbolic link) or ValueError when refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not statmod.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        raw = os.read(fd, MAX_EVENT_BYTES + 1)
    finally:
        os.close(fd)
    if not raw or len(raw) > MAX_EVENT_BYTES:
        raise ValueError(f"empty or larger than {MAX_EVENT_BYTES} bytes")
    try:
        return _parse(json.loads(raw), path)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad event: {exc!r}") from exc


def read_events(rank_dir: str, remove: bool = True) -> tuple[list[OomEvent], list[str]]:
    """Read (and remove, bad ones too) the event files; returns (events, problems). Never raises
    for a bad file."""
    events: list[OomEvent] = []
    problems: list[str] = []
    try:
        with os.scandir(rank_dir) as it:
            names = sorted(e.name for e in it
                           if e.name.startswith(PREFIX) and e.name.endswith(SUFFIX))
    except OSError:
        return events, problems
    for name in names[:MAX_EVENTS_PER_SCAN]:
        path = os.path.join(rank_dir, name)
        try:
            events.append(_read_one(path))
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror}")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            problems.append(f"{path}: {exc}")
        if remove:
            try:
                os.unlink(path)
            except OSError as exc:
                problems.append(f"{path}: cannot remove: {exc.strerror}")
    return events, problems


def _fmt(n: float | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def explain(
    event: OomEvent,
    state: NodeState | None,
    orphan_reasons: Mapping[int, str] | None = None,
    comms: Mapping[int, str] | None = None,
) -> tuple[str, Finding]:
    """(gpu index label, finding) for one event, naming who else held memory on that GPU."""
    # A rank in a container wrote the PID it sees; NVML (co-tenants, the state) has host PIDs.
    ns_pid = None
    for r in state.ranks if state else ():
        if (r.job_id, r.rank, r.ns_pid) == (event.job_id, event.rank, event.pid):
            event, ns_pid = dataclasses.replace(event, pid=r.pid), r.ns_pid
            break
    gpus = state.gpus if state else ()
    rows = state.gpu_processes if state else ()
    gpu = next((g for g in gpus if g.uuid == event.device_uuid), None)
    gpu_label = str(gpu.index) if gpu else ""
    orphan_reasons = dict(orphan_reasons or {})
    for o in state.orphans if state else ():
        orphan_reasons.setdefault(o.pid, o.reason)
    if event.co_tenants is not None:
        tenants: Sequence[tuple[int, int | None]] = event.co_tenants
    else:  # no snapshot from the rank: the daemon's latest reading of that GPU
        tenants = [(r.pid, r.used_memory_bytes) for r in rows if r.uuid == event.device_uuid]
    row_by_pid = {r.pid: r for r in rows if r.uuid == event.device_uuid}
    others = []
    for pid, used in sorted(tenants, key=lambda t: -(t[1] or 0)):
        if pid == event.pid:
            continue
        row = row_by_pid.get(pid)
        comm = (comms or {}).get(pid) or (row.comm if row else "")
        if row is not None and row.job_id:
            whose = f"rank {row.rank} of job {row.job_id}"
        else:
            reason = orphan_reasons.get(pid)
            whose = "not in any job" + (f", {_REASON_TEXT.get(reason, reason)}" if reason else "")
        name = f"{comm}, " if comm else ""
        others.append((pid, used, f"PID {pid} ({name}{whose}) held {_fmt(used)} there"))
    where = f"GPU {gpu_label}" if gpu_label else f"GPU {event.device_uuid or '?'}"
    ask = f" (tried to allocate {_fmt(event.requested_bytes)})" if event.requested_bytes else ""
    in_ctr = f" ({ns_pid} in its container)" if ns_pid is not None else ""
    head = f"rank {event.rank} of job {event.job_id} (pid {event.pid}{in_ctr}) hit CUDA OOM on {where}{ask}"
    tail = "; ".join(o[2] for o in others) if others else "no other process held memory there"
    finding = Finding(
        kind="cuda_oom",
        severity=WARNING,
        explanation=f"{head}; {tail}",
        job_id=event.job_id,
        rank=str(event.rank),
        pid=str(event.pid),
        evidence={
            "gpu": gpu_label,
            "uuid": event.device_uuid,
            "requested_bytes": event.requested_bytes,
            "co_tenants": [{"pid": p, "used_memory_bytes": u} for p, u, _ in others],
        },
        since=event.timestamp,
    )
    return gpu_label, finding


_REASON_TEXT = {
    "reparented_to_init": "its parent died and it was adopted by init",
    "job_ended": "its job has ended",
    "unregistered": "claimed by no registered rank",
    "defunct": "gone or a zombie",
}


class OomTracker:
    """Daemon-side: turns event files into counter increments and time-limited findings."""

    def __init__(self, rank_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.rank_dir = rank_dir
        self.clock = clock
        self.active: list[Finding] = []

    def poll(
        self,
        inc: Callable[[str, tuple[str, ...]], None],
        state: NodeState | None,
        orphan_reasons: Mapping[int, str] | None = None,
        comms: Mapping[int, str] | None = None,
    ) -> list[Finding]:
        events, problems = read_events(self.rank_dir)
        for p in problems:
            log.info("CUDA OOM event skipped: %s", p)
        for ev in events:
            gpu, finding = explain(ev, state, orphan_reasons, comms)
            inc("cuda_oom_errors", (ev.job_id, str(ev.rank), gpu))
            self.active = [f for f in self.active if f.key != finding.key] + [finding]
        now = self.clock()
        self.active = [f for f in self.active if now - f.since <= FINDING_SECONDS]
        return list(self.active)


def tenants_of(events: Iterable[OomEvent]) -> set[int]:
    """Every co-tenant PID named by ``events`` (the daemon reads their /proc identity)."""
    return {pid for e in events for pid, _ in (e.co_tenants or ())}
