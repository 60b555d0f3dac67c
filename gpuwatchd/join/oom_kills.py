"""The lines of one kernel OOM kill, grouped into one ``Kill``.

One kill prints a header, a memory dump, the ``oom-kill:`` summary (4.19+) and the ``Killed
process`` line, possibly interleaved with other records; ``KillGrouper`` joins them by time and
PID and hands each complete kill (or one that timed out waiting for its last line) to the
processor (join/kernel_events.py). Pure; bounded by the pending kills it holds.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model.kernel import KILLER_EARLYOOM, KILLER_KERNEL, LogRecord, Parsed, rss_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kill:
    pid: int
    comm: str
    killer: str
    boot_id: str
    time: float  # Unix seconds
    monotonic_usec: int | None
    rss_bytes: int | None = None
    memcg: str = ""  # the victim's memory cgroup (task_memcg)
    oom_memcg: str = ""  # the cgroup whose limit was hit ("" for a global OOM)
    constraint: str = ""  # CONSTRAINT_MEMCG | CONSTRAINT_NONE | ... | "" (old kernels)
    scope: str = ""  # "Out of memory" | "Memory cgroup out of memory" | ... as printed
    detail: str = ""
    source: str = ""

    @property
    def key(self) -> str:
        stamp = self.monotonic_usec if self.monotonic_usec is not None else int(self.time * 1e6)
        return f"{self.boot_id}:{self.killer}:{self.pid}:{stamp}"


def _kill(p: Parsed, rec: LogRecord, killer: str, **fields: Any) -> Kill:
    """A Kill of the victim ``p`` names, stamped with the record it was read from."""
    assert p.pid is not None
    base: dict[str, Any] = {"monotonic_usec": rec.monotonic_usec, **fields}
    return Kill(
        pid=p.pid, comm=p.comm, killer=killer, boot_id=rec.boot_id, time=rec.realtime, source=rec.source, **base
    )


class KillGrouper:
    """Feeds kernel records of any format; returns complete kills. Not thread-safe (one reader)."""

    def __init__(self, group_timeout: float = 2.0, dedup_seconds: float = 30.0) -> None:
        self.group_timeout = group_timeout
        self.dedup_seconds = dedup_seconds
        # pid -> (summary fields, record) of an oom-kill: summary still waiting for its kill line
        self._summaries: dict[tuple[str, int], tuple[Parsed, LogRecord]] = {}
        self._memcg = ""  # "Memory cgroup stats for X" / "Task in X killed ..." of the current dump
        # (scope, time) of the last pre-4.19 "<scope>: Kill process N ... or sacrifice child" line:
        # those kernels print the scope there, not on the "Killed process" line that follows (its
        # PID differs when a child was sacrificed)
        self._old_scope: tuple[str, float] | None = None
        self._recent: deque[tuple[float, str, str, int]] = deque()  # (time, boot, killer, pid)
        self._seqs: dict[tuple[str, int], int] = {}

    def oldest_pending_seq(self) -> int | None:
        return min(self._seqs.values()) if self._seqs else None

    def _seen_recently(self, boot: str, killer: str, pid: int, t: float) -> bool:
        while self._recent and self._recent[0][0] < t - self.dedup_seconds:
            self._recent.popleft()
        return any(b == boot and k == killer and p == pid for _, b, k, p in self._recent)

    def _done(self, kill: Kill) -> list[Kill]:
        if self._seen_recently(kill.boot_id, kill.killer, kill.pid, kill.time):
            return []  # a second report of the same kill (earlyoom SIGTERM then SIGKILL, ...)
        self._recent.append((kill.time, kill.boot_id, kill.killer, kill.pid))
        return [kill]

    def feed(self, rec: LogRecord, p: Parsed) -> list[Kill]:
        out = self.flush(rec.realtime)
        if p.kind in ("memcg_stats", "oom_group"):
            self._memcg = p.fields.get("memcg", "")
        elif p.kind == "task_in":
            self._memcg = p.fields.get("task_memcg", "")
        elif p.kind == "invoked":
            self._memcg = ""
            self._old_scope = None
        elif p.kind == "kill_old":
            self._old_scope = (p.fields.get("kind", ""), rec.realtime)
        elif p.kind == "summary" and p.pid is not None:
            self._summaries[(rec.boot_id, p.pid)] = (p, rec)
            if rec.seq is not None:
                self._seqs[(rec.boot_id, p.pid)] = rec.seq
        elif p.kind == "killed" and p.pid is not None:
            summary = self._summaries.pop((rec.boot_id, p.pid), None)
            self._seqs.pop((rec.boot_id, p.pid), None)
            sf: Mapping[str, str] = summary[0].fields if summary else {}
            scope = p.fields.get("kind", "")
            if not scope and self._old_scope is not None and rec.realtime - self._old_scope[1] <= self.group_timeout:
                scope = self._old_scope[0]
            self._old_scope = None
            memcg = sf.get("task_memcg", "") or self._memcg
            oom_memcg = sf.get("oom_memcg", "")
            if not oom_memcg and scope == "Memory cgroup out of memory":
                oom_memcg = self._memcg
            out += self._done(
                _kill(
                    p,
                    rec,
                    KILLER_KERNEL,
                    rss_bytes=rss_bytes(p),
                    memcg=memcg,
                    oom_memcg=oom_memcg,
                    constraint=sf.get("constraint", ""),
                    scope=scope,
                )
            )
        elif p.kind == "earlyoom" and p.pid is not None:
            out += self._done(
                _kill(
                    p,
                    rec,
                    KILLER_EARLYOOM,
                    monotonic_usec=None,
                    rss_bytes=rss_bytes(p),
                    detail=p.fields.get("signal", ""),
                )
            )
        return out

    def flush(self, now: float) -> list[Kill]:
        """Summaries whose kill line never came (lost to an overrun) become kills on their own."""
        out: list[Kill] = []
        for k, (p, rec) in list(self._summaries.items()):
            if now - rec.realtime < self.group_timeout:
                continue
            del self._summaries[k]
            self._seqs.pop(k, None)
            if p.pid is None:
                continue
            out += self._done(
                _kill(
                    p,
                    rec,
                    KILLER_KERNEL,
                    memcg=p.fields.get("task_memcg", ""),
                    oom_memcg=p.fields.get("oom_memcg", ""),
                    constraint=p.fields.get("constraint", ""),
                    detail="kill line missing",
                )
            )
        return out
