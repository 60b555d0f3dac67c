"""Per-rank memory history: growth rates of the cgroup working set and of the tree's RSS, and which
processes of the tree hold and gained the memory. Pure: readings and times in, ``RankMemory`` out.

Growth is the least-squares slope over the last ``window_seconds`` of samples (one per cycle), and
only once the samples span ``min_window_seconds``: one allocation burst is not a trend. Memory is
bounded: at most ``MAX_POINTS`` samples per rank and per tree process, histories of ranks and
processes no longer seen are dropped each cycle (``forget``), so nothing grows with uptime or job
churn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from gpuwatchd.model import CgroupMemory, ProcessInfo, RankMemory, TreeProcessMemory

MAX_POINTS = 720
TOP_PROCESSES = 5


class TrackedRank(NamedTuple):
    """What a rank's memory history is kept under: its ``RankProcess`` and that process's start
    time (/proc/PID/stat field 22), so that a reused PID starts a new history."""

    job_id: str
    rank: int
    pid: int
    start_ticks: int


ProcKey = tuple[int, int]  # pid, start_ticks


def slope(points: Iterable[tuple[float, float]]) -> float | None:
    """Least-squares slope (units per second) of (t, value) points; None for fewer than 2."""
    pts = list(points)
    n = len(pts)
    if n < 2:
        return None
    # the same sums in the same order as the textbook form, over lists (two per rank per cycle)
    ts = [t for t, _ in pts]
    vs = [v for _, v in pts]
    mt = sum(ts) / n
    mv = sum(vs) / n
    dts = [t - mt for t in ts]
    den = sum([d ** 2 for d in dts])
    if den <= 0:
        return None
    return sum([d * (v - mv) for d, v in zip(dts, vs, strict=True)]) / den


@dataclass
class _History:
    points: deque[tuple[float, float | None, float]]  # (t, working set or None, tree RSS)

    def trend(self, now: float, window: float, min_window: float) -> tuple[float | None, float | None]:
        while self.points and self.points[0][0] < now - window:
            self.points.popleft()
        if not self.points or now - self.points[0][0] < min_window:
            return None, None
        ws = [(t, w) for t, w, _ in self.points if w is not None]
        rss = slope((t, r) for t, _, r in self.points)
        return (slope(ws) if len(ws) == len(self.points) else None), rss


class MemoryTracker:
    """Not thread-safe: the daemon's cycle is its only caller."""

    def __init__(self) -> None:
        self._ranks: dict[TrackedRank, _History] = {}
        self._procs: dict[ProcKey, deque[tuple[float, int]]] = {}

    def observe(
        self,
        now: float,
        key: TrackedRank,
        tree: tuple[int, ...],
        processes: Mapping[int, ProcessInfo],
        cg: CgroupMemory | None,
        window: float,
        min_window: float,
    ) -> RankMemory:
        job_id, rank, pid, _ = key
        members = [processes[p] for p in tree if p in processes]
        tree_rss = sum(p.rss_bytes for p in members)
        hist = self._ranks.get(key)
        if hist is None:
            hist = self._ranks[key] = _History(deque(maxlen=MAX_POINTS))
        ws = cg.working_set_bytes if cg is not None else None
        hist.points.append((now, float(ws) if ws is not None else None, float(tree_rss)))
        cg_rate, rss_rate = hist.trend(now, window, min_window)
        top = self._top(now, members, pid, window)
        if cg is None:
            return RankMemory(job_id, rank, pid, tree_rss, rss_rate, top=top)
        psi = cg.pressure
        return RankMemory(
            job_id, rank, pid, tree_rss, rss_rate, cgroup=cg.path, cgroup_version=cg.version,
            usage_bytes=cg.usage_bytes, working_set_bytes=cg.working_set_bytes,
            limit_bytes=cg.limit_bytes, high_bytes=cg.high_bytes,
            cgroup_growth_bytes_per_second=cg_rate,
            pressure_some_avg10=psi.some_avg10 if psi else None,
            pressure_some_seconds=psi.some_total_seconds if psi else None,
            pressure_full_seconds=psi.full_total_seconds if psi else None,
            top=top,
        )

    def _top(self, now: float, members: list[ProcessInfo], rank_pid: int,
             window: float) -> tuple[TreeProcessMemory, ...]:
        """The tree's processes by what they gained over the window, then by what they hold."""
        out = []
        for p in members:
            k = (p.pid, p.start_ticks)
            h = self._procs.get(k)
            if h is None:
                h = self._procs[k] = deque(maxlen=MAX_POINTS)
            h.append((now, p.rss_bytes))
            while len(h) > 1 and h[0][0] < now - window:
                h.popleft()
            if p.start_time >= h[0][0]:  # started within the window: all it holds is gained
                base_t, base = p.start_time, 0
            else:
                base_t, base = h[0]
            out.append(TreeProcessMemory(p.pid, p.comm, p.rss_bytes, p.rss_bytes - base,
                                         max(0.0, now - base_t), p.pid != rank_pid))
        out.sort(key=lambda m: (-m.gained_bytes, -m.rss_bytes))
        return tuple(out[:TOP_PROCESSES])

    def forget(self, live_ranks: Iterable[TrackedRank], live_procs: Iterable[ProcKey]) -> None:
        ranks, procs = set(live_ranks), set(live_procs)
        for k in [k for k in self._ranks if k not in ranks]:
            del self._ranks[k]
        for pk in [pk for pk in self._procs if pk not in procs]:
            del self._procs[pk]
