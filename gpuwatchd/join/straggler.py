"""Slow, not stopped: each rank's step rate from ``heartbeat(step)``, against its job's median.

Each cycle: the step of every heartbeat rank (read only when its heartbeat's mtime changed,
``due``; read by sources/step_cpu.py) goes into a window of ``straggler.window_seconds``; its rate is the
steps over the window divided by the time. A rank whose rate is below ``straggler.ratio`` times
the median rate of its job's ranks on this node (at least two with a rate) at every cycle for
``straggler.for_seconds`` is a straggler (findings/rank_straggler.py says why, with the causes
gpuwatchd can see). The same window keeps its cgroup's ``cpu.stat`` (sources/cgroup_cpu.py), so
CPU throttling over the window is known when it is named a straggler. Across nodes the exported
``gpuwatch_rank_step`` gives the alert rule ``GPURankStraggler`` the same comparison.

``StragglerTracker.observe`` returns ``steps`` ((job_id, rank) -> step, exported as
``gpuwatch_rank_step``) and the rates ((job_id, rank) -> ``RankRate``, ``StragglerOutput.rates``);
the daemon's part is daemon/straggler.py. Memory: at most ``MAX_SAMPLES`` samples
per live rank; dead ranks are forgotten at once.
Pure: the reads (one small read of a heartbeat that changed, the cgroup's cpu.stat once per
cgroup per cycle) are sources/step_cpu.py's, and their cost is described there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatchd.config.schema import StragglerConfig
from gpuwatchd.model import CpuStat, RankEntry, RankId
from gpuwatchd.model.parts import RankRate

MAX_SAMPLES = 512


def _median(values: list[float]) -> float:
    """statistics.median, without importing statistics (decimal, fractions) into the daemon."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass
class _Rank:
    pid: int
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    cpu: deque[tuple[float, CpuStat]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    mtime: float | None = None
    step: int | None = None
    below_since: float | None = None


class StragglerTracker:
    """Pure given its readings: which ranks' steps to read this cycle (``due``), then the rates
    from the steps and cpu.stat readings (``observe``). The reads are sources/step_cpu.py's."""

    def __init__(self, cfg: StragglerConfig) -> None:
        self.cfg = cfg
        self._ranks: dict[RankId, _Rank] = {}

    def due(self, entries: list[RankEntry], mtimes: Mapping[RankId, float]) -> list[RankEntry]:
        """The heartbeat ranks whose step is to be read: those whose heartbeat's mtime changed."""
        out = []
        for e in entries:
            if not e.heartbeat:
                continue
            tr = self._ranks.get(e.rank_id)
            mtime = mtimes.get(e.rank_id)
            if mtime is not None and (tr is None or tr.pid != e.pid or mtime != tr.mtime):
                out.append(e)
        return out

    def observe(self, now: float, entries: list[RankEntry], mtimes: Mapping[RankId, float],
                read_steps: Mapping[RankId, int | None],
                cpu: Mapping[RankId, CpuStat | None],
                ) -> tuple[dict[RankId, int], dict[RankId, RankRate]]:  # fmt: skip
        """``read_steps``: the steps read of the ``due`` ranks; ``cpu``: each heartbeat rank's
        cgroup cpu.stat this cycle (None: unknown)."""
        window = self.cfg.window_seconds
        live = {e.rank_id: e for e in entries if e.heartbeat}
        for key in set(self._ranks) - set(live):
            del self._ranks[key]
        steps: dict[RankId, int] = {}
        rates: dict[RankId, tuple[float | None, float]] = {}
        for key, e in live.items():
            tr = self._ranks.get(key)
            if tr is None or tr.pid != e.pid:
                tr = self._ranks[key] = _Rank(e.pid)
            mtime = mtimes.get(key)
            if mtime is not None and mtime != tr.mtime and key in read_steps:
                tr.mtime = mtime
                step = read_steps[key]
                if step is not None and (tr.step is None or step < tr.step):
                    tr.samples.clear()  # first sight, or the job restarted from an earlier step
                tr.step = step
            if tr.step is not None:
                steps[key] = tr.step
                tr.samples.append((now, tr.step))
            while tr.samples and now - tr.samples[0][0] > window:
                tr.samples.popleft()
            stat = cpu.get(key)
            if stat is not None:
                tr.cpu.append((now, stat))
            while tr.cpu and now - tr.cpu[0][0] > window:
                tr.cpu.popleft()
            rates[key] = self._rate(tr, now)
        return steps, self._judge(now, live, rates)

    def _rate(self, tr: _Rank, now: float) -> tuple[float | None, float]:
        if len(tr.samples) < 2:
            return None, 0.0
        (t0, s0), (t1, s1) = tr.samples[0], tr.samples[-1]
        span = t1 - t0
        if span < self.cfg.window_seconds / 2:
            return None, span
        return (s1 - s0) / span, span

    def _judge(self, now: float, live: Mapping[RankId, RankEntry],
               rates: Mapping[RankId, tuple[float | None, float]],
               ) -> dict[RankId, RankRate]:  # fmt: skip
        jobs: dict[str, list[tuple[int, float]]] = {}
        for (job, rank), (rate, _) in rates.items():
            if rate is not None:
                jobs.setdefault(job, []).append((rank, rate))
        # each job's median and peers once (not once per rank: 64 ranks of one job sorted 64 times)
        medians = {
            job: (_median([r for _, r in peers]) if len(peers) >= 2 else None, tuple(sorted(r for r, _ in peers)))
            for job, peers in jobs.items()
        }
        out: dict[RankId, RankRate] = {}
        for key, e in live.items():
            tr = self._ranks[key]
            rate, span = rates[key]
            median, ranks = medians.get(e.job_id, (None, ()))
            below = rate is not None and median is not None and median > 0 and rate < self.cfg.ratio * median
            if below:
                tr.below_since = tr.below_since if tr.below_since is not None else now
            else:
                tr.below_since = None
            straggler = tr.below_since is not None and now - tr.below_since >= self.cfg.for_seconds
            first, last = (tr.cpu[0][1], tr.cpu[-1][1]) if tr.cpu else (None, None)
            out[key] = RankRate(
                e.job_id, e.rank, e.pid, rate, span, median, ranks,
                tr.below_since, straggler,
                throttled_periods=(last.throttled_periods - first.throttled_periods) if first and last else 0,
                periods=(last.periods - first.periods) if first and last else 0,
                throttled_seconds=(last.throttled_seconds - first.throttled_seconds) if first and last else 0.0,
            )  # fmt: skip
        return out
