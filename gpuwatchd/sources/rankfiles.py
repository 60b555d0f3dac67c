"""Rank files (launcher -> daemon contract, DESIGN §3) and rank discovery from /proc/PID/environ.

Reads every ``*.json`` in ``rank_dir`` (schema v1, ``gpuwatchd/rank/rankfile.schema.json``, parsed
by rank/rankfile.py). A file is parsed again only when its (inode, size, mtime) changes, so a cycle
costs one ``scandir`` plus one ``lstat`` per file: the listing's, which gives each file's owner (so
that the file caps are applied per owner before anything is opened: ``_choose``) and is used again
to read it. Each non-root owner's files are then read within a budget (``_Budget``: at most
``MAX_RANKS_PER_OWNER`` ranks, ``MAX_PARSE_BYTES_PER_OWNER`` bytes parsed per scan), and a file
that could name more ranks than an owner may have is refused before it is decoded: one user's
256 files of 4096 ranks each got the daemon OOM-killed at 256 MiB when every rank of every file
was parsed before any cap. Files that are symlinks, hard links, not
regular, larger than ``MAX_FILE_BYTES``, nested deeper than ``MAX_DEPTH`` or invalid are returned
as ``BadRankFile`` with a reason; they never stop the good files beside them, and nothing in one
file (numbers of any size, NaN, odd Unicode, deep nesting, duplicate keys) can raise out of
``scan``. Ownership (root or the PID's own uid, and who owns the job:
``gpuwatchd/join/rank_claims.py``) is checked in the join, where the process's uid is known. A
``rank_dir`` that cannot be listed raises ``RankDirMissing`` (the collector is down).

Entries written inside a container (``pid_ns``) are resolved to host PIDs by ``guard_entries``
with ``sources/pidns.py``; heartbeats are looked for inside the rank's own root
(``sources/heartbeats.py``). Discovery from the environment lives in ``sources/discovery.py``.
Shell equivalent: ``cat /run/gpuwatch/ranks/*.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat as statmod
from collections.abc import Iterable
from dataclasses import dataclass

from gpuwatchd.model import BadRankFile, RankEntry
from gpuwatchd.rank.rankfile import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_FILES_PER_OWNER,
    MAX_RANKS_PER_JOB,
    MAX_RANKS_PER_NODE,
    MAX_RANKS_PER_OWNER,
    RankFileError,
    bad_name,
    loads_strict,
    parse_rank_document,
)
from gpuwatchd.sources.heartbeats import HeartbeatRoots, heartbeat_root
from gpuwatchd.sources.pidns import PidNamespaces

# Bytes of changed files of one non-root owner parsed per scan (four files at the size cap; a
# rank file is a few hundred bytes per rank, so 64 ranks registering at once are about 32 KB).
MAX_PARSE_BYTES_PER_OWNER = 1 << 20


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
        # of the last scan: owners whose files were not all read, and whether an owner lost files
        # within its own share (the total cap was hit): ``check --kill`` then kills none of theirs
        self.unread_owners: frozenset[int] = frozenset()
        self.incomplete = False

    def scan(self) -> tuple[list[RankEntry], list[BadRankFile]]:
        """This cycle's entries and refusals. Caps are applied per owner, from the ``lstat`` that
        listing needs anyway and before any file is opened (``_choose``): root's files first (up
        to ``MAX_FILES``), then at most ``MAX_FILES_PER_OWNER`` of each other owner, with a fair
        share of what is left when several owners have more. Then each non-root owner's files
        are read in name order within its ``_Budget`` (ranks, and bytes parsed this scan), also
        checked before a file is opened. What an owner has beyond that is named in one
        ``BadRankFile``; ``unread_owners`` says whose files were not all read, and
        ``incomplete`` whether any owner lost files it was entitled to (the collector is then
        reported down: the reading is partial)."""
        entries: list[RankEntry] = []
        bad: list[BadRankFile] = []
        try:
            listed, stats = self._list()
        except OSError as e:
            self._cache.clear()
            raise RankDirMissing(e.errno, f"rank_dir {self.rank_dir}: {e.strerror}") from None
        chosen, skipped, self.incomplete = _choose(listed)
        self.unread_owners = frozenset(skipped)
        for uid, (n, kept) in sorted(skipped.items()):
            bad.append(
                BadRankFile(
                    f"{self.rank_dir} (uid {uid})",
                    f"uid {uid} has {n} rank files; only {kept} are read (at most "
                    f"{MAX_FILES_PER_OWNER} per owner, {MAX_FILES} in all): {n - kept} ignored",
                )
            )
        live = set()
        budgets: dict[int, _Budget] = {}
        for name in chosen:
            path = os.path.join(self.rank_dir, name)
            if bad_name(name):
                bad.append(
                    BadRankFile(os.path.join(self.rank_dir, ascii(name)[1:-1]), "name is not printable UTF-8 (refused)")
                )
                continue
            st = stats.get(name)
            budget = (
                None
                if st is not None and st.st_uid == 0
                else budgets.setdefault(st.st_uid if st is not None else -1, _Budget())
            )
            if budget is not None and not budget.may_read(self._cached(path, st), st):
                continue
            live.add(path)
            try:
                got, error = self._read(path, st)
            except Exception as e:  # noqa: BLE001 - one file's content never affects another
                self._cache.pop(path, None)
                got, error = [], f"could not be read ({type(e).__name__})"
            if budget is not None:
                budget.ranks += len(got)
            if error is not None:
                bad.append(BadRankFile(path, error))
            entries.extend(got)
        for uid, budget in sorted(budgets.items()):
            if budget.unread:
                self.unread_owners |= {uid}
                bad.append(
                    BadRankFile(
                        f"{self.rank_dir} (uid {uid})",
                        f"uid {uid}'s rank files: {budget.unread} not read this cycle (at most "
                        f"{MAX_RANKS_PER_OWNER} ranks and {MAX_PARSE_BYTES_PER_OWNER} bytes parsed "
                        f"per owner and cycle)",
                    )
                )
        for stale in set(self._cache) - live:
            del self._cache[stale]
        return entries, bad

    def _cached(self, path: str, st: os.stat_result | None) -> bool:
        """Is ``path``'s reading cached for this (inode, size, mtime)? (Then it costs no parse.)"""
        cached = self._cache.get(path)
        return cached is not None and st is not None and cached.key == _key(st)

    def _list(self) -> tuple[dict[int, list[str]], dict[str, os.stat_result]]:
        """(owner uid -> its ``*.json`` names, name -> its lstat) (uid -1: the lstat failed;
        ``_read`` says why); a name gone between the listing and its stat is left out. Cost: one
        getdents pass and one lstat per name, which ``_read`` uses again for the chosen ones
        (100,000 names: 0.35 s on the 2-core test machine, against 0.12 s for listing alone)."""
        out: dict[int, list[str]] = {}
        stats: dict[str, os.stat_result] = {}
        with os.scandir(self.rank_dir) as it:
            for e in it:
                if not e.name.endswith(".json"):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError:
                    uid = -1
                else:
                    uid = st.st_uid
                    stats[e.name] = st
                out.setdefault(uid, []).append(e.name)
        return out, stats

    def _read(self, path: str, st: os.stat_result | None = None) -> tuple[list[RankEntry], str | None]:
        """``st``: the listing's lstat of ``path`` (None: stat it now). The file is opened only
        when that key (inode, size, mtime) is new, and then checked again against it (``_parse``)."""
        if st is None:
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
        key = _key(st)
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
        # Each rank is a JSON object, so a file names fewer ranks than it has "{": one that could
        # name more than an owner may have is refused before the decoder builds them (4096 ranks
        # in 100 KB made 4096 objects and entries per file: 16 such files, 76 MB of RSS).
        if st.st_uid != 0 and raw.count(b"{") - 1 > MAX_RANKS_PER_OWNER:
            return [], (
                f"names more than {MAX_RANKS_PER_OWNER} ranks (at most that many of one owner are watched; not parsed)"
            )
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


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class _Budget:
    """What one non-root owner's files may cost in one scan, checked before each file is opened:
    ``MAX_RANKS_PER_OWNER`` ranks in all (no file is read once they are reached: more would be
    cut by ``cap_ranks`` anyway) and ``MAX_PARSE_BYTES_PER_OWNER`` bytes of files that changed
    (the rest wait for the next scan; a file cached unchanged costs nothing). So one uid's files
    cost a bounded time and memory per cycle, and never another uid's reading."""

    ranks: int = 0
    parsed: int = 0
    unread: int = 0

    def may_read(self, cached: bool, st: os.stat_result | None) -> bool:
        size = st.st_size if st is not None else 0
        if self.ranks >= MAX_RANKS_PER_OWNER or (
            not cached and self.parsed > 0 and self.parsed + size > MAX_PARSE_BYTES_PER_OWNER
        ):
            self.unread += 1
            return False
        if not cached:
            self.parsed += min(size, MAX_FILE_BYTES)
        return True


def _choose(
    by_owner: dict[int, list[str]],
    total: int = MAX_FILES,
    per_owner: int = MAX_FILES_PER_OWNER,
) -> tuple[list[str], dict[int, tuple[int, int]], bool]:
    """(the names to read, owner uid -> (files, files read) for each owner not read in full,
    whether an owner lost files below ``per_owner``). Root's files come first; the other owners
    share what is left max-min fairly (the owner with fewest files first, each taking at most an
    equal part of the rest), each owner's files in name order."""
    chosen: list[str] = []
    skipped: dict[int, tuple[int, int]] = {}
    incomplete = False
    root = sorted(by_owner.get(0, ()))
    chosen += root[:total]
    if len(root) > total:
        skipped[0], incomplete = (len(root), total), True
    left = total - len(chosen)
    owners = sorted(((uid, names) for uid, names in by_owner.items() if uid != 0), key=lambda kv: (len(kv[1]), kv[0]))
    for i, (uid, names) in enumerate(owners):
        take = min(len(names), per_owner, left // (len(owners) - i))
        chosen += sorted(names)[:take] if take < len(names) else sorted(names)
        left -= take
        if take < len(names):
            skipped[uid] = (len(names), take)
            incomplete = incomplete or take < min(len(names), per_owner)
    return chosen, skipped, incomplete


def claimant(e: RankEntry) -> int:
    """Who makes a claim: a rank file's owner (root for root's files), a discovered process's
    uid (-1: unknown). Every cap before the claims are decided is per claimant."""
    if e.source == "rankfile" and e.owner_uid is None:
        return 0
    return e.owner_uid if e.owner_uid is not None else -1


def cap_ranks(
    entries: Iterable[RankEntry],
    bad: Iterable[BadRankFile] = (),
    per_job: int = MAX_RANKS_PER_JOB,
    per_owner: int = MAX_RANKS_PER_OWNER,
    per_node: int = MAX_RANKS_PER_NODE,
) -> tuple[list[RankEntry], list[BadRankFile]]:
    """Keep at most ``per_job`` ranks of a job *from one claimant* and ``per_owner`` ranks from
    one non-root rank-file owner (lowest ranks first), then at most ``per_node`` in all
    (``cap_node``); each cap that is hit adds one BadRankFile naming it. These caps run before
    the claims are decided (``join/rank_claims.py``), so none of them may let one uid's claims
    push out another's: a user's 256 claims on root's job would otherwise have taken the job's
    256 places and evicted root's own ranks. The job's series limit over its accepted ranks is
    ``rank_claims.select``'s, after ownership."""
    kept: list[RankEntry] = []
    out_bad = list(bad)
    per_job_n: dict[tuple[str, int], int] = {}
    per_owner_n: dict[int, int] = {}
    hit: dict[str, BadRankFile] = {}
    for e in sorted(entries, key=lambda e: (e.source != "rankfile", e.job_id, e.rank, e.pid)):
        who = claimant(e)
        n = per_job_n.get((e.job_id, who), 0)
        if n >= per_job:
            hit.setdefault(
                f"job\0{e.job_id}\0{who}",
                BadRankFile(
                    e.path or "discovery",
                    f"job {e.job_id} claims more than {per_job} ranks on this node by uid {who}; "
                    f"ranks above the cap are ignored (series limit)",
                ),
            )
            continue
        owner = e.owner_uid if e.source == "rankfile" else None
        if owner is not None and owner != 0:
            if per_owner_n.get(owner, 0) >= per_owner:
                hit.setdefault(
                    f"uid\0{owner}",
                    BadRankFile(
                        e.path,
                        f"rank files of uid {owner} claim more than {per_owner} ranks on this "
                        f"node; ranks above the cap are ignored (series limit)",
                    ),
                )
                continue
            per_owner_n[owner] = per_owner_n.get(owner, 0) + 1
        per_job_n[(e.job_id, who)] = n + 1
        kept.append(e)
    kept, node_bad = cap_node(kept, per_node)
    return kept, out_bad + list(hit.values()) + node_bad


def cap_node(
    entries: list[RankEntry],
    per_node: int = MAX_RANKS_PER_NODE,
) -> tuple[list[RankEntry], list[BadRankFile]]:
    """At most ``per_node`` entries, shared max-min fairly between the claimants (a rank file's
    owner, root for root's files; a discovered process's uid): the claimant with fewest first,
    each taking at most an equal part of what is left, its lowest (job, rank) first, so that no
    one's many ranks crowd out another's few. One BadRankFile per claimant cut; order is kept."""
    if len(entries) <= per_node:
        return entries, []
    groups: dict[int, list[RankEntry]] = {}
    for e in entries:
        groups.setdefault(claimant(e), []).append(e)
    keep: set[int] = set()
    bad: list[BadRankFile] = []
    left = per_node
    owners = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0]))
    for i, (uid, group) in enumerate(owners):
        n = min(len(group), left // (len(owners) - i))
        keep.update(id(e) for e in group[:n])
        left -= n
        if n < len(group):
            bad.append(
                BadRankFile(
                    group[n].path or "discovery",
                    f"uid {uid} claims {len(group)} ranks; only {n} are watched (at most {per_node} "
                    f"ranks on a node, shared fairly between users; memory budget)",
                )
            )
    return [e for e in entries if id(e) in keep], bad


def guard_entries(
    entries: Iterable[RankEntry],
    bad: Iterable[BadRankFile] = (),
    procfs: str = "/proc",
    namespaces: PidNamespaces | None = None,
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
                e = dataclasses.replace(e, heartbeat_root=root, heartbeat=e.heartbeat if root is not None else None)
        out.append(e)
    if roots is not None:
        roots.end_cycle()
    return out, out_bad
