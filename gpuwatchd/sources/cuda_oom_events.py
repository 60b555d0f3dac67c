"""CUDA out-of-memory event files: read and remove the files the rank hook wrote
(rank/cuda_oom.py: ``cuda_oom-<job>-<rank>-<pid>-<ns>.event`` in the rank directory); what they
mean is join/cuda_oom.py.

Reads: the rank directory (one ``stat`` per cycle, and a ``scandir`` when its mtime says a file came
or went; each file at most ``MAX_EVENT_BYTES``, opened with O_NOFOLLOW, at most
``MAX_EVENTS_PER_SCAN`` per cycle). A bad file is reported and removed, never raised. Privilege:
write access to the rank directory (the daemon's tmpfiles entry). Shell equivalent:
``cat $RANK_DIR/cuda_oom-*.event && rm $RANK_DIR/cuda_oom-*.event``.
"""

from __future__ import annotations

import json
import logging
import os
import stat as statmod
import time
from typing import Any

from gpuwatchd.model import OomEvent
from gpuwatchd.rank.cuda_oom import MAX_EVENT_BYTES, PREFIX, SUFFIX

log = logging.getLogger(__name__)

MAX_EVENTS_PER_SCAN = 256
RACY_SECONDS = 2.0  # a directory changed this recently is listed again (OomEventFiles._changed)


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


class OomEventFiles:
    """The rank directory's event files, listed only when a file can have come or gone."""

    def __init__(self, rank_dir: str) -> None:
        self.rank_dir = rank_dir
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

    def read(self) -> list[OomEvent]:
        """The events that came since the last call (their files removed); problems logged."""
        if not self._changed():
            return []
        self.scans += 1
        events, problems = read_events(self.rank_dir)
        for p in problems:
            log.info("CUDA OOM event skipped: %s", p)
        return events
