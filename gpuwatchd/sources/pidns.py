"""Ranks in containers: PIDs of other PID namespaces resolved to host PIDs, paths resolved inside
a process's own root.

A rank file written inside a container names the PID as the container sees it (often 1) and, from
``gpuwatchd.register_rank()``, the inode of the writer's PID namespace (``pid_ns``: what
``/proc/self/ns/pid`` links to there, ``/proc/HOSTPID/ns/pid`` on the host). ``PidNamespaces``
accepts host PID H for such an entry only when all of these hold:

- ``/proc/H/ns/pid`` is that namespace, and the innermost ``NSpid`` of H is the file's ``pid``;
- H's start time (``/proc/H/stat`` field 22) equals the file's ``start_ticks`` (required here);
- for a file not owned by root, H's uid is the file owner (the join checks it again, every cycle).

So two pods that both run their rank as PID 1 are told apart by their namespaces, and a user
cannot borrow another user's container process. Everything downstream (the join, NVML, kernel OOM
and Xid lines, py-spy, fork detection, orphans, ``check``) then sees host PIDs only; the
in-container PID is kept (``RankEntry.ns_pid``) for people to read.

Cost: a resolved entry is re-verified with one ``stat`` read per cycle (the other facts are cached
per (PID, start time)). An entry not resolved yet costs one pass over /proc (one ``stat`` of
``/proc/P/ns/pid`` per process, a ``status`` read for processes in a wanted namespace), at most one
pass per cycle for all such entries together, and an entry that a pass did not find is looked for
again only after ``retry_seconds``. Needs PTRACE_MODE_READ on other users' processes
(CAP_SYS_PTRACE, which the unit grants). Shell equivalent: ``readlink /proc/*/ns/pid | grep INODE;
grep NSpid /proc/PID/status``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat as statmod
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwatchd.model import BadRankFile, RankEntry, RankProcess
from gpuwatchd.sources.containers import identity
from gpuwatchd.sources.procfs import ProcfsReader

MAX_LINKS = 40  # like the kernel's MAXSYMLINKS
RETRY_SECONDS = 30.0

# (pid namespace inode, pid in it, start ticks, rank-file owner): the owner is part of the key, so
# that a user's copy of another pod's claim never inherits its resolution
Key = tuple[int, int, int, int | None]


def _split(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _enter(stack: list[int], name: str) -> bool:
    """Open directory ``name`` of ``stack[-1]`` onto ``stack``; False when it is a symbolic link
    (O_NOFOLLOW|O_DIRECTORY on a link: ENOTDIR, or ELOOP) or no directory."""
    try:
        stack.append(os.open(name, _DIR_FLAGS, dir_fd=stack[-1]))
        return True
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        return False


def _follow(stack: list[int], name: str, parts: list[str], links: int, path: str) -> tuple[list[str], int]:
    """Symbolic link ``name`` of ``stack[-1]``: its target spliced into ``parts``, within the
    root (an absolute target starts again at the root, ``stack[0]``)."""
    links += 1
    if links > MAX_LINKS:
        raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
    target = os.readlink(name, dir_fd=stack[-1])
    if target.startswith("/"):
        while len(stack) > 1:
            os.close(stack.pop())
    return _split(target) + parts, links


def stat_in_root(root: str, path: str) -> os.stat_result:
    """``stat(2)`` of ``path`` as seen by the process whose root directory is ``root``
    (``/proc/PID/root``): symlinks are followed *within* that root (an absolute target starts
    again at it, ``..`` stops at it), never out of it into the daemon's own tree, as
    ``openat2(RESOLVE_IN_ROOT)`` would. Raises OSError."""
    stack = [os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        parts = _split(path)
        links = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            if parts and _enter(stack, name):  # a directory on the way: one open
                continue
            st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            if statmod.S_ISLNK(st.st_mode):
                parts, links = _follow(stack, name, parts, links, path)
                continue
            if not parts:
                return st
            stack.append(os.open(name, _DIR_FLAGS, dir_fd=stack[-1]))  # ENOTDIR: not a directory
        return os.fstat(stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def open_parent_in_root(root: str, path: str) -> tuple[int, str]:
    """An ``O_PATH`` fd of the directory holding ``path``'s last component, reached as
    ``stat_in_root`` reaches it (symlinks on the way followed within ``root``), and that
    component's name: a caller that stats the same file every cycle keeps the fd and makes one
    ``fstatat`` instead of a walk. The caller closes the fd. Raises OSError, or ValueError for a
    path that ends in ``..`` or names no file."""
    stack = [os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        parts = _split(path)
        links = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if not parts:
                    raise ValueError(f"{path!r} ends in ..")
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            if not parts:
                return stack.pop(), name  # kept open for the caller; the rest closed below
            if _enter(stack, name):
                continue
            st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            if not statmod.S_ISLNK(st.st_mode):
                raise OSError(errno.ENOTDIR, "not a directory", path)
            parts, links = _follow(stack, name, parts, links, path)
        raise ValueError(f"{path!r} names no file")
    finally:
        for fd in stack:
            os.close(fd)


@dataclass(frozen=True)
class _Facts:
    """What does not change while one process lives (keyed by PID and start time)."""

    nspid: tuple[int, ...]
    pid_ns: int | None
    uid: int | None
    container: str


def pid_text(pid: int, ns_pid: int | None) -> str:
    """How a person reads a rank's PID: "pid 48213 (1 in its container)"."""
    return f"pid {pid}" + (f" ({ns_pid} in its container)" if ns_pid is not None else "")


class PidNamespaces:
    def __init__(
        self, procfs: ProcfsReader, retry_seconds: float = RETRY_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.procfs = procfs
        self.retry_seconds = retry_seconds
        self.clock = clock
        self.own_ns = procfs.pid_ns("self")
        self._resolved: dict[Key, int] = {}  # also after the process ended: it is then "dead"
        self._missed: dict[Key, float] = {}  # when a pass over /proc last failed to find it
        self._facts: dict[tuple[int, int], _Facts] = {}
        # (job_id, rank, host pid) -> (ns_pid, container) last seen alive: a dead rank keeps them
        self._shown: dict[RankProcess, tuple[int | None, str]] = {}
        self._shown_now: set[RankProcess] = set()
        self._ticks: dict[int, int | None] = {}  # this call's start-time reads (one per PID)
        self.scans = 0  # passes over /proc so far (tests and benchmarks read it)

    def _facts_of(self, pid: int, start: int) -> _Facts | None:
        facts = self._facts.get((pid, start))
        if facts is None:
            nspid = self.procfs.nspid(pid)
            if nspid is None:
                return None
            try:
                uid: int | None = os.stat(self.procfs.paths.proc(pid)).st_uid
            except OSError:
                uid = None
            facts = _Facts(nspid, self.procfs.pid_ns(pid), uid, identity(self.procfs.cgroup(pid)))
            self._facts[(pid, start)] = facts
        return facts

    def _start_ticks(self, pid: int) -> int | None:
        if pid not in self._ticks:
            self._ticks[pid] = self.procfs.start_ticks(pid)
        return self._ticks[pid]

    def _matches(self, host: int, e: RankEntry) -> _Facts | None:
        start = self._start_ticks(host)
        if start is None or start != e.start_ticks:
            return None
        facts = self._facts_of(host, start)
        if facts is None or facts.pid_ns != e.pid_ns or facts.nspid[-1] != e.pid:
            return None
        if e.owner_uid not in (None, 0) and facts.uid != e.owner_uid:
            return None
        return facts

    def _scan(self, namespaces: set[int]) -> dict[tuple[int, int], list[int]]:
        """(namespace, innermost pid) -> host PIDs, for the given namespaces: one pass."""
        self.scans += 1
        index: dict[tuple[int, int], list[int]] = {}
        for pid in self.procfs.pids():
            ns = self.procfs.pid_ns(pid)
            if ns is None or ns not in namespaces:
                continue
            nspid = self.procfs.nspid(pid)
            if nspid:
                index.setdefault((ns, nspid[-1]), []).append(pid)
        return index

    def _annotate(self, e: RankEntry, live: set[tuple[int, int]]) -> RankEntry:
        """Add the in-container PID and the container's identity of a host-PID entry (those it
        had when last seen alive, once it is gone)."""
        shown = e.rank_process
        self._shown_now.add(shown)
        start = self._start_ticks(e.pid)
        facts = None
        if start is not None and (e.start_ticks is None or start == e.start_ticks):
            live.add((e.pid, start))
            facts = self._facts_of(e.pid, start)
        if facts is None:
            ns_pid, container = self._shown.get(shown, (e.ns_pid, e.container))
            return dataclasses.replace(e, ns_pid=ns_pid, container=container)
        ns_pid = e.ns_pid if e.ns_pid is not None else (facts.nspid[-1] if len(facts.nspid) > 1 else None)
        self._shown[shown] = (ns_pid, facts.container)
        if e.ns_pid == ns_pid and e.container == facts.container:
            return e  # a host process's entry as it was read (no copy each cycle)
        return dataclasses.replace(e, ns_pid=ns_pid, container=facts.container)

    def resolve(self, entries: Iterable[RankEntry]) -> tuple[list[RankEntry], list[BadRankFile]]:
        """Entries with host PIDs (and ``ns_pid``/``container`` where known), and the refusals of
        entries whose namespace PID matches no process."""
        self._ticks = {}
        out: list[RankEntry] = []
        bad: list[BadRankFile] = []
        pending: list[tuple[Key, RankEntry]] = []
        live: set[tuple[int, int]] = set()
        keys: set[Key] = set()
        for e in entries:
            if e.pid_ns is None or e.pid_ns == self.own_ns:
                out.append(self._annotate(e, live))
                continue
            if e.start_ticks is None:
                bad.append(
                    BadRankFile(
                        e.path,
                        f"rank {e.rank} of job {e.job_id}: a pid of another PID namespace needs start_ticks (refused)",
                    )
                )
                continue
            key = (e.pid_ns, e.pid, e.start_ticks, e.owner_uid)
            keys.add(key)
            host = self._resolved.get(key)
            if host is not None and self._matches(host, e):
                out.append(self._annotate(dataclasses.replace(e, pid=host, ns_pid=e.pid), live))
            else:
                pending.append((key, e))
        now = self.clock()
        wanted = {k[0] for k, _ in pending if now - self._missed.get(k, float("-inf")) >= self.retry_seconds}
        index = self._scan(wanted) if wanted else {}
        for key, e in pending:
            found = next((h for h in index.get((key[0], key[1]), ()) if self._matches(h, e)), None)
            if found is not None:
                self._resolved[key] = found
                self._missed.pop(key, None)
                out.append(self._annotate(dataclasses.replace(e, pid=found, ns_pid=e.pid), live))
                continue
            if key[0] in wanted:
                self._missed[key] = now
            host = self._resolved.get(key)
            if host is not None:  # resolved before, gone now: the join sees a dead rank
                out.append(self._annotate(dataclasses.replace(e, pid=host, ns_pid=e.pid), live))
            else:
                bad.append(
                    BadRankFile(
                        e.path,
                        f"rank {e.rank} of job {e.job_id}: no process is pid "
                        f"{e.pid} of PID namespace {e.pid_ns} with start_ticks "
                        f"{e.start_ticks}" + (f" and uid {e.owner_uid}" if e.owner_uid else ""),
                    )
                )
        for k in set(self._resolved) - keys:
            del self._resolved[k]
        for k in set(self._missed) - keys:
            del self._missed[k]
        for f in set(self._facts) - live:
            del self._facts[f]
        for s in set(self._shown) - self._shown_now:
            del self._shown[s]
        self._shown_now = set()
        self._ticks = {}
        return out, bad
