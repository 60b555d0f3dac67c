"""Per-rank memory history: growth rates of the cgroup working set and of the tree's RSS, and which
processes of the tree hold and gained the memory. Pure: readings and times in, ``RankMemory`` out.

Growth is the least-squares slope over the last ``window_seconds`` of samples (one per cycle), and
only once the samples span ``min_window_seconds``: one allocation burst is not a trend. The fit's
sums slide with the window (``_Fit``: O(1) per cycle and rank, not O(points); ``slope`` is the
textbook form it is tested against). Memory is
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
    den = sum([d**2 for d in dts])
    if den <= 0:
        return None
    return sum([d * (v - mv) for d, v in zip(dts, vs, strict=True)]) / den


class _Fit:
    """The least-squares sums of a sliding window of (t, value) points: adding or dropping a point
    is O(1), where ``slope`` walks the whole window (two fits per rank per cycle, up to
    ``window_seconds / interval`` points each). Times are kept relative to ``origin``, which
    moves to the oldest point whenever the sums are rebuilt from the points (``rebuild``, every
    window's worth of additions), so that rounding never accumulates with uptime."""

    __slots__ = ("n", "origin", "st", "stt", "stv", "sv")

    def __init__(self, origin: float) -> None:
        self.n = 0
        self.origin = origin
        self.st = self.sv = self.stt = self.stv = 0.0

    def add(self, t: float, v: float, sign: int = 1) -> None:
        t -= self.origin
        self.n += sign
        self.st += sign * t
        self.sv += sign * v
        self.stt += sign * t * t
        self.stv += sign * t * v

    def slope(self) -> float | None:
        """What ``slope`` returns for the window's points, up to rounding."""
        n = self.n
        if n < 2:
            return None
        den = self.stt - self.st * self.st / n
        if den <= 1e-12 * self.stt:  # all at one time (the textbook sum is exactly 0 there)
            return None
        return (self.stv - self.st * self.sv / n) / den


@dataclass
class _History:
    """A rank's points (t, working set or None, tree RSS) over the window, with their two fits:
    the tree RSS over every point, the working set over the points that have one (its slope is
    used only when every point has one)."""

    points: deque[tuple[float, float | None, float]]
    ws: _Fit
    rss: _Fit
    added: int = 0  # points added since the fits were last rebuilt

    @classmethod
    def new(cls, now: float) -> _History:
        return cls(deque(), _Fit(now), _Fit(now))

    def append(self, point: tuple[float, float | None, float]) -> None:
        if len(self.points) >= MAX_POINTS:
            self._drop()
        self.points.append(point)
        t, ws, rss = point
        self.rss.add(t, rss)
        if ws is not None:
            self.ws.add(t, ws)
        self.added += 1
        if self.added >= max(len(self.points), 16):
            self.rebuild()

    def _drop(self) -> None:
        t, ws, rss = self.points.popleft()
        self.rss.add(t, rss, -1)
        if ws is not None:
            self.ws.add(t, ws, -1)

    def rebuild(self) -> None:
        """The sums again from the points, relative to the oldest one."""
        origin = self.points[0][0] if self.points else 0.0
        self.ws, self.rss, self.added = _Fit(origin), _Fit(origin), 0
        for t, ws, rss in self.points:
            self.rss.add(t, rss)
            if ws is not None:
                self.ws.add(t, ws)

    def trend(self, now: float, window: float, min_window: float) -> tuple[float | None, float | None]:
        while self.points and self.points[0][0] < now - window:
            self._drop()
        if not self.points or now - self.points[0][0] < min_window:
            return None, None
        ws = self.ws.slope() if self.ws.n == len(self.points) else None
        return ws, self.rss.slope()


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
            hist = self._ranks[key] = _History.new(now)
        ws = cg.working_set_bytes if cg is not None else None
        hist.append((now, float(ws) if ws is not None else None, float(tree_rss)))
        cg_rate, rss_rate = hist.trend(now, window, min_window)
        top = self._top(now, members, pid, window)
        if cg is None:
            return RankMemory(job_id, rank, pid, tree_rss, rss_rate, top=top)
        psi = cg.pressure
        return RankMemory(
            job_id,
            rank,
            pid,
            tree_rss,
            rss_rate,
            cgroup=cg.path,
            cgroup_version=cg.version,
            usage_bytes=cg.usage_bytes,
            working_set_bytes=cg.working_set_bytes,
            limit_bytes=cg.limit_bytes,
            high_bytes=cg.high_bytes,
            cgroup_growth_bytes_per_second=cg_rate,
            pressure_some_avg10=psi.some_avg10 if psi else None,
            pressure_some_seconds=psi.some_total_seconds if psi else None,
            pressure_full_seconds=psi.full_total_seconds if psi else None,
            top=top,
        )

    def _top(
        self, now: float, members: list[ProcessInfo], rank_pid: int, window: float
    ) -> tuple[TreeProcessMemory, ...]:
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
            out.append(
                TreeProcessMemory(
                    p.pid, p.comm, p.rss_bytes, p.rss_bytes - base, max(0.0, now - base_t), p.pid != rank_pid
                )
            )
        out.sort(key=lambda m: (-m.gained_bytes, -m.rss_bytes))
        return tuple(out[:TOP_PROCESSES])

    def forget(self, live_ranks: Iterable[TrackedRank], live_procs: Iterable[ProcKey]) -> None:
        ranks, procs = set(live_ranks), set(live_procs)
        for k in [k for k in self._ranks if k not in ranks]:
            del self._ranks[k]
        for pk in [pk for pk in self._procs if pk not in procs]:
            del self._procs[pk]
