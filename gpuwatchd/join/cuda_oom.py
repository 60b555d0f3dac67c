"""CUDA out-of-memory events, daemon side: read and remove the event files the rank hook wrote
(rank/cuda_oom.py: ``cuda_oom-<job>-<rank>-<pid>-<ns>.event`` in the rank directory), count
``cuda_oom_errors{job_id,rank,gpu}`` and attribute each (host PID, GPU index, who the co-tenants
of the GPU were at that moment), kept ``FINDING_SECONDS`` for the ``cuda_oom`` rule
(findings/cuda_oom.py), which builds the finding.

Reads: the rank directory (one ``stat`` per cycle, and a ``scandir`` when its mtime says a file came
or went; each file at most ``MAX_EVENT_BYTES``, opened with O_NOFOLLOW, at most
``MAX_EVENTS_PER_SCAN`` per cycle). A bad file is reported and removed, never raised.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat as statmod
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model import NodeState
from gpuwatchd.rank.cuda_oom import MAX_EVENT_BYTES, PREFIX, SUFFIX

log = logging.getLogger(__name__)

MAX_EVENTS_PER_SCAN = 256
FINDING_SECONDS = 600.0  # a cuda_oom finding stays active this long after the error
RACY_SECONDS = 2.0  # a directory changed this recently is listed again (OomTracker._changed)


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


@dataclass(frozen=True)
class CoTenant:
    """Another process that held memory on the GPU at the moment of the error, as the daemon knew
    it then: its job and rank if a rank's tree holds it, else why it is an orphan ("" if none)."""

    pid: int
    used_memory_bytes: int | None
    comm: str = ""
    job_id: str = ""
    rank: str = ""
    orphan_reason: str = ""


@dataclass(frozen=True)
class AttributedOom:
    """One CUDA OOM event attributed at the cycle that read it: ``event.pid`` is the host PID
    (``ns_pid`` the PID the rank wrote from inside its container, if different), ``gpu`` the
    NVML index of ``event.device_uuid`` ("" if unknown), ``co_tenants`` every process that held
    memory there (the rank's snapshot, else the daemon's latest reading), the rank itself
    included. What the ``cuda_oom`` rule (findings/cuda_oom.py) reads."""

    event: OomEvent
    gpu: str = ""
    ns_pid: int | None = None
    co_tenants: tuple[CoTenant, ...] = ()

    @property
    def since(self) -> float:
        return self.event.timestamp

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.event.job_id, self.event.rank, self.event.pid)


def attribute(
    event: OomEvent,
    state: NodeState | None,
    orphan_reasons: Mapping[int, str] | None = None,
    comms: Mapping[int, str] | None = None,
) -> AttributedOom:
    """Who was who on the event's GPU, from ``state`` (the latest NodeState), this cycle's orphan
    reasons and command names: kept with the event, so the finding names them as they were."""
    # A rank in a container wrote the PID it sees; NVML (co-tenants, the state) has host PIDs.
    ns_pid = None
    for r in state.ranks if state else ():
        if (r.job_id, r.rank, r.ns_pid) == (event.job_id, event.rank, event.pid):
            event, ns_pid = dataclasses.replace(event, pid=r.pid), r.ns_pid
            break
    gpus = state.gpus if state else ()
    rows = state.gpu_processes if state else ()
    gpu = next((g for g in gpus if g.uuid == event.device_uuid), None)
    orphan_reasons = dict(orphan_reasons or {})
    for o in state.orphans if state else ():
        orphan_reasons.setdefault(o.pid, o.reason)
    if event.co_tenants is not None:
        tenants: Sequence[tuple[int, int | None]] = event.co_tenants
    else:  # no snapshot from the rank: the daemon's latest reading of that GPU
        tenants = [(r.pid, r.used_memory_bytes) for r in rows if r.uuid == event.device_uuid]
    row_by_pid = {r.pid: r for r in rows if r.uuid == event.device_uuid}
    co = []
    for pid, used in tenants:
        row = row_by_pid.get(pid)
        comm = (comms or {}).get(pid) or (row.comm if row else "")
        if row is not None and row.job_id:
            co.append(CoTenant(pid, used, comm, row.job_id, row.rank))
        else:
            co.append(CoTenant(pid, used, comm, orphan_reason=orphan_reasons.get(pid, "")))
    return AttributedOom(event, str(gpu.index) if gpu else "", ns_pid, tuple(co))


class OomTracker:
    """Daemon-side: turns event files into counter increments and attributed events, each kept
    ``FINDING_SECONDS`` after the error (the newest per job, rank and PID)."""

    def __init__(self, rank_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.rank_dir = rank_dir
        self.clock = clock
        self.active: list[AttributedOom] = []
        self.scans = 0  # listings of rank_dir (tests, benchmarks)
        self._listed: tuple[int, int] | None = None  # (inode, mtime ns) of rank_dir when listed

    def _changed(self) -> bool:
        """Can rank_dir hold an event file that the last listing did not see? An event file is
        created (and removed by us), which changes the directory's mtime; heartbeats are written
        in place, which does not. A directory changed within ``RACY_SECONDS`` is listed again
        anyway: a file created in the same timestamp tick as the last listing leaves the mtime as
        it was."""
        try:
            st = os.stat(self.rank_dir)
        except OSError:
            self._listed = None
            return True
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._listed and time.time() - st.st_mtime > RACY_SECONDS:
            return False
        self._listed = key  # taken before the listing: what changes during it is seen next time
        return True

    def poll(
        self,
        inc: Callable[[str, tuple[str, ...]], None],
        state: NodeState | None,
        orphan_reasons: Mapping[int, str] | None = None,
        comms: Mapping[int, str] | None = None,
    ) -> list[AttributedOom]:
        events: list[OomEvent] = []
        problems: list[str] = []
        if self._changed():
            self.scans += 1
            events, problems = read_events(self.rank_dir)
        for p in problems:
            log.info("CUDA OOM event skipped: %s", p)
        for ev in events:
            oom = attribute(ev, state, orphan_reasons, comms)
            inc("cuda_oom_errors", (ev.job_id, str(ev.rank), oom.gpu))
            self.active = [a for a in self.active if a.key != oom.key] + [oom]
        now = self.clock()
        self.active = [a for a in self.active if now - a.since <= FINDING_SECONDS]
        return list(self.active)

