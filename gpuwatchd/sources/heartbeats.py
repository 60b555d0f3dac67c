"""Heartbeats of ranks: where to look for a rank's heartbeat file (in the rank's own root), its
mtime (the rank's progress) and its step, each cycle.

A heartbeat named in a rank file is resolved in the rank's own mount namespace and root
(``/proc/PID/root``, with ``stat_in_root``: symlinks never lead out of it), so a heartbeat in the
job's /tmp or container is found although the daemon runs with PrivateTmp=yes. ``HeartbeatRoots``
remembers, per rank, where the heartbeat was found and keeps an ``O_PATH`` fd of its directory,
so a cycle reads a heartbeat with one ``fstatat`` (and its step with one ``openat``) instead of
opening every directory on its path. Used by ``rankfiles.guard_entries`` and the daemon's cycle.
"""

from __future__ import annotations

import dataclasses
import os
import stat as statmod
import threading
import time
from collections.abc import Callable

from gpuwatchd.model import RankEntry
from gpuwatchd.sources.heartbeat_step import read_step
from gpuwatchd.sources.pidns import open_parent_in_root, stat_in_root


def _owner_may_see(entry: RankEntry, st: os.stat_result) -> bool:
    return entry.owner_uid is None or entry.owner_uid == 0 or st.st_uid == entry.owner_uid


def heartbeat_root(entry: RankEntry, procfs: str = "/proc") -> str | None:
    """Where to look for a rank's heartbeat, or None when it may not be used.

    The path is resolved in the rank's own mount namespace and root (``/proc/PID/root``, with
    ``stat_in_root``: symlinks never lead out of the rank's root), so a heartbeat in the job's
    /tmp or container is found although the daemon runs with PrivateTmp=yes. For a process of the
    daemon's own PID namespace the daemon's view ("") is the fallback. A heartbeat named in a
    non-root rank file is used only when that same uid owns the file: the daemon
    (CAP_DAC_READ_SEARCH) must not reveal the mtime of another user's file to whoever reads
    /metrics.
    """
    return _heartbeat_root(entry, procfs)[0]


def _heartbeat_root(entry: RankEntry, procfs: str) -> tuple[str | None, bool]:
    """(``heartbeat_root``'s answer, whether the heartbeat was found there in the rank's root)."""
    if not entry.heartbeat:
        return None, False
    root = f"{procfs.rstrip('/')}/{entry.pid}/root"
    try:
        if _owner_may_see(entry, stat_in_root(root, entry.heartbeat)):
            return root, True
        return None, False
    except (OSError, ValueError):
        pass
    if entry.ns_pid is None:
        try:
            return ("" if _owner_may_see(entry, os.stat(entry.heartbeat)) else None), False
        except (OSError, ValueError):
            pass
    return root, False  # not written yet: look where the rank will write it


HbKey = tuple[int, int | None, str, int | None]
MAX_HEARTBEAT_DIRS = 512  # directory fds HeartbeatRoots keeps at most (one per rank heartbeat)


class HeartbeatRoots:
    """``heartbeat_root`` and ``heartbeat_mtime`` for the daemon's cycle.

    A heartbeat found in the rank's own root (the owner rule met) is looked for there again for
    ``ttl`` seconds without walking its path a second time each cycle. Every other answer (not
    there yet, only in the daemon's view, refused) is asked again each cycle.

    ``mtime`` keeps an ``O_PATH`` fd of the directory that holds such a heartbeat (resolved in
    the rank's root by ``open_parent_in_root``, again after ``ttl``) and reads the file with one
    ``fstatat`` per cycle, the owner rule checked each time, instead of opening every directory
    on its path. An fd is closed when a cycle no longer asks for that rank, after ``ttl`` (so it
    holds a finished container's filesystem for ``ttl`` at most), and when the file is not found
    through it; at most ``MAX_HEARTBEAT_DIRS`` are kept, any further heartbeat is walked.
    ``guard`` hands back last cycle's copy of an entry whose rank file did not change.
    Memory: the entries of the last cycle."""

    def __init__(
        self, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic, max_dirs: int = MAX_HEARTBEAT_DIRS
    ) -> None:
        self.ttl = ttl
        self.clock = clock
        self.max_dirs = max_dirs
        self.walks = 0  # heartbeat_root lookups made (tests, benchmarks)
        self.dir_walks = 0  # directories opened for mtime (tests, benchmarks)
        self._found: dict[HbKey, float] = {}
        self._seen: set[HbKey] = set()
        # id(entry as read) -> (that entry, its root, the guarded copy), for the entries of a cycle
        self._guarded: dict[int, tuple[RankEntry, str | None, RankEntry]] = {}
        self._guarded_next: dict[int, tuple[RankEntry, str | None, RankEntry]] = {}
        # (key, root) -> (opened at, directory fd, file name); under _lock: a collector that timed
        # out can still be reading while the next cycle ends
        self._dirs: dict[tuple[HbKey, str], tuple[float, int, str]] = {}
        self._dirs_seen: set[tuple[HbKey, str]] = set()
        self._lock = threading.Lock()

    def root(self, entry: RankEntry, procfs: str) -> str | None:
        if not entry.heartbeat:
            return None
        key = (entry.pid, entry.start_ticks, entry.heartbeat, entry.owner_uid)
        self._seen.add(key)
        now = self.clock()
        found_at = self._found.get(key)
        if found_at is not None and now - found_at < self.ttl:
            return f"{procfs.rstrip('/')}/{entry.pid}/root"
        self.walks += 1
        root, found = _heartbeat_root(entry, procfs)
        if found:
            self._found[key] = now
        else:
            self._found.pop(key, None)
        return root

    def guard(self, entry: RankEntry, procfs: str) -> RankEntry:
        """``entry`` with ``heartbeat_root`` set (the heartbeat dropped where refused)."""
        root = self.root(entry, procfs)
        hit = self._guarded.get(id(entry))
        if hit is not None and hit[0] is entry and hit[1] == root:
            out = hit[2]
        else:
            out = dataclasses.replace(
                entry, heartbeat_root=root, heartbeat=entry.heartbeat if root is not None else None
            )
        self._guarded_next[id(entry)] = (entry, root, out)
        return out

    def mtime(self, entry: RankEntry) -> float | None:
        """``heartbeat_mtime(entry)``, through a kept directory fd where the heartbeat is read in
        the rank's own root."""
        root, path = entry.heartbeat_root, entry.heartbeat
        if not path or not root:  # nothing to read, or the daemon's own view: one stat
            return heartbeat_mtime(entry)
        key = ((entry.pid, entry.start_ticks, path, entry.owner_uid), root)
        now = self.clock()
        with self._lock:
            self._dirs_seen.add(key)
            held = self._dirs.get(key)
            if held is not None and now - held[0] >= self.ttl:
                self._close(key)
                held = None
            if held is None and len(self._dirs) < self.max_dirs:
                try:
                    self.dir_walks += 1
                    fd, name = open_parent_in_root(root, path)
                    held = self._dirs[key] = (now, fd, name)
                except OSError:
                    return None  # not there (yet): looked for again next cycle
                except ValueError:  # no last name to keep a directory for ("x/.."): walk it
                    return heartbeat_mtime(entry)
            if held is None:
                return heartbeat_mtime(entry)
            try:
                st = os.stat(held[2], dir_fd=held[1], follow_symlinks=False)
            except OSError:
                self._close(key)  # gone, or its directory is: walk again next cycle
                return None
        if statmod.S_ISLNK(st.st_mode):  # a link as the last name: resolved in the root each time
            return heartbeat_mtime(entry)
        return st.st_mtime if _owner_may_see(entry, st) else None

    def step(self, entry: RankEntry) -> int | None:
        """The step in the heartbeat (``heartbeat(step)``), read where ``mtime`` reads it: in the
        rank's own root (its container, its private /tmp), not in the daemon's view."""
        root, path = entry.heartbeat_root, entry.heartbeat
        if not path or root is None:
            return None
        if not root:  # the daemon's own view
            return read_step(path, entry.owner_uid)
        key = ((entry.pid, entry.start_ticks, path, entry.owner_uid), root)
        with self._lock:
            held = self._dirs.get(key)
            if held is not None:
                return read_step(held[2], entry.owner_uid, dir_fd=held[1])
        try:
            fd, name = open_parent_in_root(root, path)
        except (OSError, ValueError):
            return None
        try:
            return read_step(name, entry.owner_uid, dir_fd=fd)
        finally:
            os.close(fd)

    def _close(self, key: tuple[HbKey, str]) -> None:
        held = self._dirs.pop(key, None)
        if held is not None:
            os.close(held[1])

    def end_cycle(self) -> None:
        """Forget the entries this cycle did not ask about (and close their directories)."""
        self._found = {k: v for k, v in self._found.items() if k in self._seen}
        self._seen = set()
        self._guarded, self._guarded_next = self._guarded_next, {}

    def end_reads(self) -> None:
        """After a cycle's ``mtime`` calls: close the directories no entry asked for."""
        with self._lock:
            for key in set(self._dirs) - self._dirs_seen:
                self._close(key)
            self._dirs_seen = set()

    def close(self) -> None:
        with self._lock:
            for key in list(self._dirs):
                self._close(key)


def heartbeat_mtime(entry: RankEntry) -> float | None:
    """mtime of ``entry.heartbeat`` where ``guard_entries`` said to look (``heartbeat_root``),
    with the owner rule checked again at the moment of reading."""
    if not entry.heartbeat or entry.heartbeat_root is None:
        return None
    try:
        st = stat_in_root(entry.heartbeat_root, entry.heartbeat) if entry.heartbeat_root else os.stat(entry.heartbeat)
    except (OSError, ValueError):
        return None
    return st.st_mtime if _owner_may_see(entry, st) else None
