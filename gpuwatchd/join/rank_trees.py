"""Who was in which rank's tree: the attribution record the kernel-event processor uses to map a
killed PID (gone by the time the kill is printed) back to its job and rank.

Kept in memory and in ``state_dir/rank_trees.json`` (``RankTreeRecord``: bounded by
``MAX_RECORD_BYTES`` on load, members of ended ranks kept ``retention.ended_rank_seconds``), read
back as untrusted input at start (``tree_member`` rejects anything malformed).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model import ProcessInfo, RankState
from gpuwatchd.statefile import StateFiles, read_capped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeMember:
    """A process seen in a rank's tree: the rank process itself or a descendant (worker)."""

    pid: int
    start_time: float | None  # Unix seconds; None when unknown
    job_id: str
    rank: int
    rank_pid: int
    worker: bool
    comm: str
    last_seen: float
    cgroup: str = ""
    world_size: int | None = None


def members_from(
    ranks: Iterable[RankState],
    processes: Mapping[int, ProcessInfo],
    now: float,
    cgroups: Mapping[int, str] | None = None,
) -> list[TreeMember]:
    """The live members of every rank tree of one cycle."""
    out: list[TreeMember] = []
    for r in ranks:
        if not r.alive:
            continue
        tree = r.tree or (r.pid,)
        for pid in tree:
            p = processes.get(pid) or (r.process if pid == r.pid else None)
            out.append(
                TreeMember(
                    pid=pid,
                    start_time=p.start_time if p is not None else None,
                    job_id=r.job_id,
                    rank=r.rank,
                    rank_pid=r.pid,
                    worker=pid != r.pid,
                    comm=p.comm if p is not None else "",
                    last_seen=now,
                    cgroup=(cgroups or {}).get(pid, "") if pid == r.pid else "",
                    world_size=r.world_size,
                )
            )
    return out


MAX_RECORD_BYTES = 64 << 20
_MEMBER_TYPES: Mapping[str, tuple[type, ...]] = {
    "pid": (int,),
    "start_time": (int, float, type(None)),
    "job_id": (str,),
    "rank": (int,),
    "rank_pid": (int,),
    "worker": (bool,),
    "comm": (str,),
    "last_seen": (int, float),
    "cgroup": (str,),
    "world_size": (int, type(None)),
}
_MEMBER_REQUIRED = ("pid", "start_time", "job_id", "rank", "rank_pid", "worker", "comm", "last_seen")


def tree_member(d: Any) -> TreeMember | None:
    """A stored member, or None when it is not one (missing or unknown keys, wrong types, numbers
    out of range: 1e400 reads as inf, and an inf start time would match every later kill)."""
    if not isinstance(d, dict) or not all(k in d for k in _MEMBER_REQUIRED):
        return None
    for k, v in d.items():
        types = _MEMBER_TYPES.get(k)
        if types is None or not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            return None
        if isinstance(v, float) and not math.isfinite(v):
            return None
    if not (0 < d["pid"] < 1 << 32 and 0 < d["rank_pid"] < 1 << 32 and 0 <= d["rank"] < 1 << 31):
        return None
    return TreeMember(**d)


class RankTreeRecord:
    """Recently seen rank-tree members, kept ``ttl`` seconds after they were last seen alive and
    persisted in ``state_dir`` so that a kill that happens while the daemon is down is still
    attributed when it starts again; a member seen to leave while the daemon runs is kept only
    ``ended_grace_seconds`` (``retention.ended_rank_seconds``), so job churn does not grow it."""

    # A kill's timestamp and a process's start time come from different clocks (printk's
    # local_clock vs btime + start ticks, btime is whole seconds): allow this much disagreement.
    SLACK_SECONDS = 2.0

    def __init__(
        self,
        path: str | None = None,
        ttl_seconds: float = 900.0,
        files: StateFiles | None = None,
        ended_grace_seconds: float | None = None,
    ) -> None:
        """``ended_grace_seconds``: a member that the daemon, running, saw leave its rank tree
        (the process ended, the job churned away) is kept only this long (its kill line, if any,
        arrives within seconds), not ``ttl_seconds``, which is for members last seen alive before
        the daemon stopped (a kill while it was down). None: ``ttl_seconds`` for all."""
        self.path = path
        self.ttl = ttl_seconds
        self.ended_grace = ended_grace_seconds
        self._gone: dict[tuple[int, float | None], float] = {}  # member -> first update without it
        self.files = files or StateFiles()
        self._lock = threading.Lock()
        self._members: dict[tuple[int, float | None], TreeMember] = {}
        self._saved_at = 0.0
        self._saved_keys: frozenset[tuple[int, float | None]] = frozenset()
        if path:
            self._load(path)

    def _load(self, path: str) -> None:
        """Every member of the file that is well-formed; the others are skipped and counted (the
        file is untrusted input: a crash, a disk error or an edit can leave anything in it)."""
        try:
            raw = read_capped(path, MAX_RECORD_BYTES)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("rank tree record %s unreadable, starting empty: %s", path, e)
            self.files.rejected(path, "unreadable")
            return
        try:
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
            data = json.loads(raw)
            members = data.get("members") if isinstance(data, dict) else None
            if not isinstance(members, list):
                raise ValueError("no list of members")
        except (ValueError, RecursionError) as e:
            log.warning("rank tree record %s unusable, starting empty: %s", path, str(e)[:200])
            self.files.rejected(path, "malformed")
            return
        for d in members:
            m = tree_member(d)
            if m is None:
                self.files.rejected(path, "bad_member")
                continue
            self._members[(m.pid, m.start_time)] = m

    def update(self, members: Iterable[TreeMember], now: float) -> None:
        with self._lock:
            present = set()
            for m in members:
                self._members[(m.pid, m.start_time)] = m
                present.add((m.pid, m.start_time))
            gone = {k: self._gone.get(k, now) for k in self._members if k not in present}
            self._gone = gone
            grace = self.ended_grace
            for k in [
                k
                for k, m in self._members.items()
                if m.last_seen < now - self.ttl or (grace is not None and k in gone and now - gone[k] > grace)
            ]:
                del self._members[k]
                self._gone.pop(k, None)
            keys = frozenset(self._members)
            if self.path and (keys != self._saved_keys or now - self._saved_at > 60.0):
                self._save(now, keys)

    def _save(self, now: float, keys: frozenset[tuple[int, float | None]]) -> None:
        assert self.path is not None
        data = {"members": [m.__dict__ for m in self._members.values()]}
        if self.files.write(self.path, json.dumps(data)):
            self._saved_at, self._saved_keys = now, keys

    def lookup(self, pid: int, at: float) -> TreeMember | None:
        """The member that was ``pid`` at time ``at``: seen alive within ``ttl`` before it and not
        started after it. With PID reuse the latest such process wins."""
        best: TreeMember | None = None
        with self._lock:
            for m in self._members.values():
                if m.pid != pid or m.last_seen < at - self.ttl:
                    continue
                if m.start_time is not None and m.start_time > at + self.SLACK_SECONDS:
                    continue  # started after the kill: a reused PID
                if best is None or (m.start_time or 0.0) > (best.start_time or 0.0):
                    best = m
        return best

    def ranks_in_cgroup(self, cgroup: str, at: float) -> list[TreeMember]:
        """Rank processes whose cgroup is ``cgroup`` or below it (systemd-oomd kills a cgroup)."""
        prefix = cgroup.rstrip("/") + "/"
        with self._lock:
            return [
                m
                for m in self._members.values()
                if not m.worker
                and m.cgroup
                and (m.cgroup == cgroup or m.cgroup.startswith(prefix))
                and m.last_seen >= at - self.ttl
            ]
