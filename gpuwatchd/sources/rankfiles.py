"""Rank files (launcher -> daemon contract, DESIGN §3) and rank discovery from /proc/PID/environ.

Reads every ``*.json`` in ``rank_dir`` (schema v1, ``gpuwatchd/rank/rankfile.schema.json``, parsed
by rank/rankfile.py). A file is parsed again only when its (inode, size, mtime) changes, so a cycle
costs one ``scandir`` plus one ``lstat`` per file. Files that are symlinks, hard links, not
regular, larger than ``MAX_FILE_BYTES``, nested deeper than ``MAX_DEPTH`` or invalid are returned
as ``BadRankFile`` with a reason; they never stop the good files beside them, and nothing in one
file (numbers of any size, NaN, odd Unicode, deep nesting, duplicate keys) can raise out of
``scan``. Ownership (root or the PID's own uid, and who owns the job:
``gpuwatchd/join/rank_claims.py``) is checked in the join, where the process's uid is known. A
``rank_dir`` that cannot be listed raises ``RankDirMissing`` (the collector is down).

Entries written inside a container (``pid_ns``) are resolved to host PIDs by ``guard_entries``
with ``sources/pidns.py``; heartbeats are read inside the rank's own root (where one was found
there, ``HeartbeatRoots`` remembers it, so a cycle walks its path once, in ``heartbeat_mtime``). Discovery from the
environment lives in ``sources/discovery.py``.
Shell equivalent: ``cat /run/gpuwatch/ranks/*.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat as statmod
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwatchd.model import BadRankFile, RankEntry
from gpuwatchd.rank.rankfile import (
    DISCOVERY_VARS,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_RANKS_PER_JOB,
    MAX_RANKS_PER_OWNER,
    RankFileError,
    _bad_name,
    claim_from_env,
    loads_strict,
    parse_rank_document,
)
from gpuwatchd.sources.discovery import discover
from gpuwatchd.sources.heartbeat_step import read_step
from gpuwatchd.sources.pidns import PidNamespaces, open_parent_in_root, stat_in_root

__all__ = ["DISCOVERY_VARS", "claim_from_env", "discover"]  # re-exported: moved to discovery.py
@dataclass
class _Cached:
    key: tuple[int, int, int]
    entries: list[RankEntry]
    error: str | None


class RankDirMissing(OSError):
    """``rank_dir`` cannot be listed (gone, not a directory, not readable): the rankfiles
    collector is down until it is back, rather than reporting "no ranks" as a success."""


class RankFileReader:
    """Scans ``rank_dir`` each cycle; re-parses only files that changed."""

    def __init__(self, rank_dir: str) -> None:
        self.rank_dir = rank_dir
        self._cache: dict[str, _Cached] = {}

    def scan(self) -> tuple[list[RankEntry], list[BadRankFile]]:
        entries: list[RankEntry] = []
        bad: list[BadRankFile] = []
        try:
            with os.scandir(self.rank_dir) as it:
                names = sorted(e.name for e in it if e.name.endswith(".json"))
        except OSError as e:
            self._cache.clear()
            raise RankDirMissing(e.errno, f"rank_dir {self.rank_dir}: {e.strerror}") from None
        if len(names) > MAX_FILES:
            bad.append(BadRankFile(self.rank_dir, f"more than {MAX_FILES} rank files; extra ignored"))
            names = names[:MAX_FILES]
        live = set()
        for name in names:
            path = os.path.join(self.rank_dir, name)
            if _bad_name(name):
                bad.append(BadRankFile(os.path.join(self.rank_dir, ascii(name)[1:-1]),
                                       "name is not printable UTF-8 (refused)"))
                continue
            live.add(path)
            try:
                got, error = self._read(path)
            except Exception as e:  # noqa: BLE001 - one file's content never affects another
                self._cache.pop(path, None)
                got, error = [], f"could not be read ({type(e).__name__})"
            if error is not None:
                bad.append(BadRankFile(path, error))
            entries.extend(got)
        for stale in set(self._cache) - live:
            del self._cache[stale]
        return entries, bad

    def _read(self, path: str) -> tuple[list[RankEntry], str | None]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return [], None  # renamed away between listing and reading: not an error
        except OSError as e:
            return [], f"cannot stat: {e.strerror}"
        if statmod.S_ISLNK(st.st_mode):
            return [], "is a symbolic link (refused)"
        if not statmod.S_ISREG(st.st_mode):
            return [], "is not a regular file (refused)"
        if st.st_nlink > 1:
            return [], "has several hard links (refused: a link can point at another user's file)"
        if st.st_size > MAX_FILE_BYTES:
            return [], f"is {st.st_size} bytes, larger than the {MAX_FILE_BYTES}-byte cap"
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._cache.get(path)
        if cached is not None and cached.key == key:
            return cached.entries, cached.error
        entries, error = self._parse(path, st)
        self._cache[path] = _Cached(key, entries, error)
        return entries, error

    def _parse(self, path: str, st: os.stat_result) -> tuple[list[RankEntry], str | None]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            return [], f"cannot open: {e.strerror}"
        try:
            fst = os.fstat(fd)
            if (fst.st_ino, fst.st_dev) != (st.st_ino, st.st_dev) or not statmod.S_ISREG(fst.st_mode):
                return [], "changed while being opened (refused)"
            raw = os.read(fd, MAX_FILE_BYTES + 1)
        except OSError as e:
            return [], f"cannot read: {e.strerror}"
        finally:
            os.close(fd)
        if len(raw) > MAX_FILE_BYTES:
            return [], f"larger than the {MAX_FILE_BYTES}-byte cap"
        try:
            doc = loads_strict(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return [], "is not UTF-8 text"
        except json.JSONDecodeError as e:
            return [], f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        except RankFileError as e:
            return [], str(e)
        except RecursionError:
            return [], f"nested deeper than {MAX_DEPTH} levels"
        except ValueError as e:  # any other refusal of the decoder: this file only
            return [], f"is not valid JSON ({e!s:.80})"
        try:
            return parse_rank_document(doc, path, fst.st_uid), None
        except (RankFileError, RecursionError) as e:
            return [], str(e) if isinstance(e, RankFileError) else "nested too deeply"


def cap_ranks(entries: Iterable[RankEntry], bad: Iterable[BadRankFile] = (),
              per_job: int = MAX_RANKS_PER_JOB,
              per_owner: int = MAX_RANKS_PER_OWNER) -> tuple[list[RankEntry], list[BadRankFile]]:
    """Keep at most ``per_job`` ranks of a job and ``per_owner`` ranks from one non-root
    rank-file owner (lowest ranks first); each cap that is hit adds one BadRankFile naming it."""
    kept: list[RankEntry] = []
    out_bad = list(bad)
    per_job_n: dict[str, int] = {}
    per_owner_n: dict[int, int] = {}
    hit: dict[str, BadRankFile] = {}
    for e in sorted(entries, key=lambda e: (e.source != "rankfile", e.job_id, e.rank, e.pid)):
        n = per_job_n.get(e.job_id, 0)
        if n >= per_job:
            hit.setdefault(f"job\0{e.job_id}", BadRankFile(
                e.path or "discovery",
                f"job {e.job_id} claims more than {per_job} ranks on this node; ranks above the "
                f"cap are ignored (series limit)"))
            continue
        owner = e.owner_uid if e.source == "rankfile" else None
        if owner is not None and owner != 0:
            if per_owner_n.get(owner, 0) >= per_owner:
                hit.setdefault(f"uid\0{owner}", BadRankFile(
                    e.path, f"rank files of uid {owner} claim more than {per_owner} ranks on this "
                    f"node; ranks above the cap are ignored (series limit)"))
                continue
            per_owner_n[owner] = per_owner_n.get(owner, 0) + 1
        per_job_n[e.job_id] = n + 1
        kept.append(e)
    return kept, out_bad + list(hit.values())


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

    def __init__(self, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 max_dirs: int = MAX_HEARTBEAT_DIRS) -> None:
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
            out = dataclasses.replace(entry, heartbeat_root=root,
                                      heartbeat=entry.heartbeat if root is not None else None)
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
        st = (stat_in_root(entry.heartbeat_root, entry.heartbeat) if entry.heartbeat_root
              else os.stat(entry.heartbeat))
    except (OSError, ValueError):
        return None
    return st.st_mtime if _owner_may_see(entry, st) else None


def guard_entries(entries: Iterable[RankEntry], bad: Iterable[BadRankFile] = (),
                  procfs: str = "/proc", namespaces: PidNamespaces | None = None,
                  roots: HeartbeatRoots | None = None,
                  ) -> tuple[list[RankEntry], list[BadRankFile]]:
    """What every consumer of one cycle's rank entries sees: ``cap_ranks`` applied, PIDs of other
    PID namespaces resolved to host PIDs (``namespaces``, after the caps: its cost is bounded by
    them), and each heartbeat's ``heartbeat_root`` set (the heartbeat dropped where the owner
    rule forbids it)."""
    kept, out_bad = cap_ranks(entries, bad)
    if namespaces is not None:
        kept, refused = namespaces.resolve(kept)
        out_bad += refused
    out = []
    for e in kept:
        if e.heartbeat:
            if roots is not None:
                e = roots.guard(e, procfs)
            else:
                root = heartbeat_root(e, procfs)
                e = dataclasses.replace(e, heartbeat_root=root,
                                        heartbeat=e.heartbeat if root is not None else None)
        out.append(e)
    if roots is not None:
        roots.end_cycle()
    return out, out_bad
