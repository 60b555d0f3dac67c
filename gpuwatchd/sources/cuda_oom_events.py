"""CUDA out-of-memory event files: read the files the rank hook wrote (rank/cuda_oom.py:
``cuda_oom-<job>-<rank>-<pid>-<ns>.event`` in the rank directory), each once; what they mean, and
whose they may be, is join/cuda_oom.py.

Reads: the rank directory (one ``stat`` per cycle, and a ``scandir`` with one ``lstat`` per event
file when its mtime says a file came or went); of the files not read before, at most
``MAX_NEW_PER_OWNER`` per owner uid and ``MAX_EVENTS_PER_SCAN`` in all per listing, each at most
``MAX_EVENT_BYTES``, opened with ``O_NOFOLLOW | O_NONBLOCK`` (a link or FIFO is refused, never
followed or waited on), as a regular file with one link. Every value is checked for its type and
range (``parse_event``): one odd file (``"rank": 1e400``) is refused alone, never raised.

Each file counts once. The daemon removes a file it has read; where it cannot (under the unit's
user, another user's file in the root-owned sticky directory is not its to remove; the DaemonSet
mounts the directory read-only), it remembers the file by ``(device, inode, mtime ns, size)``
(at most ``MAX_REMEMBERED``, forgotten when the file is gone) and keeps that memory in
``state_dir/cuda_oom_seen.json`` across restarts. That it cannot remove them is logged once.

Privilege: read access to the rank directory; write access only to remove. Shell equivalent:
``cat $RANK_DIR/cuda_oom-*.event && rm $RANK_DIR/cuda_oom-*.event``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat as statmod
import time
from typing import Any

from gpuwatchd.model.cuda_oom import OomEvent
from gpuwatchd.rank.cuda_oom import MAX_EVENT_BYTES, PREFIX, SUFFIX
from gpuwatchd.rank.rankfile import JOB_ID_RE, RankFileError, loads_strict
from gpuwatchd.statefile import atomic_write, read_capped

log = logging.getLogger(__name__)

MAX_EVENTS_PER_SCAN = 256
# Of the files not read before, one owner's this many per listing: one user's thousands of files
# never hide another user's event for more than a cycle or two.
MAX_NEW_PER_OWNER = 16
# Files read but not removable, remembered so that each counts once: at most this many (a file
# gone from the directory is forgotten at the next listing). Beyond it, new files wait.
MAX_REMEMBERED = 4096
MAX_CO_TENANTS = 64
RACY_SECONDS = 2.0  # a directory changed this recently is listed again (OomEventFiles._changed)
SEEN_FILE = "cuda_oom_seen.json"

FileKey = tuple[int, int, int, int]  # (st_dev, st_ino, st_mtime_ns, st_size)


def _key(st: os.stat_result) -> FileKey:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def _opt_int(v: Any, what: str) -> int | None:
    return None if v is None else _int(v, what, 0, 1 << 62)


def parse_event(doc: Any, path: str = "", owner_uid: int | None = None) -> OomEvent:
    """One event document, every field checked; ValueError naming the first problem."""
    if not isinstance(doc, dict) or doc.get("kind") != "cuda_oom":
        raise ValueError("not a cuda_oom event")
    job_id = doc.get("job_id")
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise ValueError("job_id must be 1-128 characters of [A-Za-z0-9._:@-]")
    ts = doc.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a finite number, got {ts!r:.40}")
    uuid = doc.get("device_uuid") or ""
    if not isinstance(uuid, str) or len(uuid) > 96 or not uuid.isprintable():
        raise ValueError("device_uuid must be a printable string of at most 96 characters")
    tenants = doc.get("co_tenants")
    co: tuple[tuple[int, int | None], ...] | None = None
    if tenants is not None:
        if not isinstance(tenants, list) or len(tenants) > MAX_CO_TENANTS:
            raise ValueError(f"co_tenants must be a list of at most {MAX_CO_TENANTS}")
        co = tuple(
            (
                _int(t.get("pid"), "co_tenants[].pid", 1, 1 << 22),
                _opt_int(t.get("used_memory_bytes"), "co_tenants[].used_memory_bytes"),
            )
            for t in tenants
            if isinstance(t, dict)
        )
    return OomEvent(
        job_id=job_id,
        rank=_int(doc.get("rank"), "rank", 0, (1 << 20) - 1),
        pid=_int(doc.get("pid"), "pid", 1, 1 << 22),
        timestamp=float(ts),
        device_uuid=uuid,
        requested_bytes=_opt_int(doc.get("requested_bytes"), "requested_bytes"),
        co_tenants=co,
        path=path,
        owner_uid=owner_uid,
    )


def _read_one(dir_fd: int, name: str, path: str, listed: os.stat_result) -> OomEvent:
    """One event file; OSError (ELOOP for a symbolic link) or ValueError when refused."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not statmod.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ValueError("not a regular file with one link")
        if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino):
            raise ValueError("changed while being opened")
        raw = os.read(fd, MAX_EVENT_BYTES + 1)
    finally:
        os.close(fd)
    if not raw or len(raw) > MAX_EVENT_BYTES:
        raise ValueError(f"empty or larger than {MAX_EVENT_BYTES} bytes")
    try:
        doc = loads_strict(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except (RankFileError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError too
        raise ValueError(str(exc)[:200]) from None
    return parse_event(doc, path, st.st_uid)


def _listing(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    out = []
    with os.scandir(dir_fd) as it:
        for e in it:
            if not (e.name.startswith(PREFIX) and e.name.endswith(SUFFIX)):
                continue
            try:
                out.append((e.name, e.stat(follow_symlinks=False)))
            except OSError:
                continue
    out.sort()
    return out


class OomEventFiles:
    """The rank directory's event files, listed only when a file can have come or gone, each
    counted once (module docstring). ``state_dir``: where the files read but not removable are
    remembered across restarts (None: in memory only)."""

    def __init__(self, rank_dir: str, state_dir: str | None = None, remove: bool = True) -> None:
        self.rank_dir = rank_dir
        self.remove = remove
        self.scans = 0  # listings of rank_dir (tests, benchmarks)
        self._listed: tuple[int, int] | None = None  # (inode, mtime ns) of rank_dir when listed
        self._seen_path = os.path.join(state_dir, SEEN_FILE) if state_dir else None
        self.seen: set[FileKey] = self._load()
        self._warned_remove = False
        self._warned_full = False
        self.pending = False  # new files were left for the next listing (caps)

    # -- memory of the files read ---------------------------------------------------------------
    def _load(self) -> set[FileKey]:
        if self._seen_path is None:
            return set()
        try:
            doc = json.loads(read_capped(self._seen_path, 64 * MAX_REMEMBERED))
            keys: set[FileKey] = set()
            for k in doc["seen"][:MAX_REMEMBERED]:
                dev, ino, mtime, size = (_int(v, "key", 0, 1 << 64) for v in k)
                keys.add((dev, ino, mtime, size))
            return keys
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "%s unreadable (%s): CUDA OOM event files still in the rank directory may be counted again",
                self._seen_path,
                exc,
            )
            return set()

    def _save(self) -> None:
        if self._seen_path is None:
            return
        try:
            atomic_write(self._seen_path, json.dumps({"version": 1, "seen": sorted(self.seen)}))
        except OSError as exc:
            log.warning("could not write %s: %s", self._seen_path, exc)

    # -- one cycle ------------------------------------------------------------------------------
    def _changed(self) -> bool:
        """Can rank_dir hold an event file that the last listing did not see? An event file is
        created (and removed by us), which changes the directory's mtime; heartbeats are written
        in place, which does not. A directory changed within ``RACY_SECONDS`` is listed again
        anyway: a file created in the same timestamp tick as the last listing leaves the mtime as
        it was. A listing that left files for later (the caps) is followed by another."""
        try:
            st = os.stat(self.rank_dir)
        except OSError:
            self._listed = None
            return True
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._listed and time.time() - st.st_mtime > RACY_SECONDS and not self.pending:
            return False
        self._listed = key  # taken before the listing: what changes during it is seen next time
        return True

    def read(self) -> list[OomEvent]:
        """The events that came since the last call; problems logged."""
        if not self._changed():
            return []
        self.scans += 1
        events, problems = self.read_new()
        for p in problems:
            log.info("CUDA OOM event skipped: %s", p)
        return events

    def read_new(self) -> tuple[list[OomEvent], list[str]]:
        """Read the event files not read before (and remove them where it may); returns
        (events, problems). Never raises for a bad file; OSError when rank_dir cannot be read."""
        events: list[OomEvent] = []
        problems: list[str] = []
        try:
            dir_fd = os.open(self.rank_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return events, problems
        try:
            listed = _listing(dir_fd)
            present = {_key(st) for _, st in listed}
            before = len(self.seen)
            self.seen &= present  # a file gone is forgotten
            changed = len(self.seen) != before
            per_owner: dict[int, int] = {}
            taken = 0
            self.pending = False
            for name, st in listed:
                key = _key(st)
                if key in self.seen:
                    continue
                n = per_owner.get(st.st_uid, 0)
                if n >= MAX_NEW_PER_OWNER or taken >= MAX_EVENTS_PER_SCAN:
                    self.pending = True
                    continue
                if len(self.seen) >= MAX_REMEMBERED:
                    if not self._warned_full:
                        self._warned_full = True
                        log.warning(
                            "%d CUDA OOM event files are read but cannot be removed from "
                            "%s: newer ones are not read until some are gone",
                            MAX_REMEMBERED,
                            self.rank_dir,
                        )
                    break
                per_owner[st.st_uid] = n + 1
                taken += 1
                path = os.path.join(self.rank_dir, name)
                try:
                    events.append(_read_one(dir_fd, name, path, st))
                except OSError as exc:
                    problems.append(f"{path}: {exc.strerror}")
                except ValueError as exc:  # json.JSONDecodeError is a ValueError
                    problems.append(f"{path}: {exc}")
                if self._removed(dir_fd, name, path):
                    continue
                self.seen.add(key)
                changed = True
        finally:
            os.close(dir_fd)
        if changed:
            self._save()
        return events, problems

    def _removed(self, dir_fd: int, name: str, path: str) -> bool:
        if not self.remove:
            return False
        try:
            os.unlink(name, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if not self._warned_remove:
                self._warned_remove = True
                log.warning(
                    "cannot remove CUDA OOM event files from %s (%s, e.g. %s): each is "
                    "remembered instead and counted once",
                    self.rank_dir,
                    exc.strerror,
                    path,
                )
            return False


def read_events(rank_dir: str, remove: bool = True) -> tuple[list[OomEvent], list[str]]:
    """Read (and remove, bad ones too) the event files; returns (events, problems). Never raises
    for a bad file. One listing with no memory between calls (tests, ``gpuwatchd`` tools)."""
    try:
        return OomEventFiles(rank_dir, remove=remove).read_new()
    except OSError:
        return [], []
