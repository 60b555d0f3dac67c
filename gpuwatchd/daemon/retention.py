"""Retention of per-rank counter series: what is alive plus a bounded window of recent events.

Gauges of a rank vanish with it (each scrape builds fresh families from the latest state), but the
counters (``model.COUNTER_LABELS``) live in the ``CounterStore`` and, keyed by ``job_id`` and
``rank``, would otherwise grow with every job the node ever ran. Each cycle this subsystem looks at
the ranks registered now (rank files and discovery, alive or dead) and drops the counter series of
every other ``(job_id, rank)``:

- after ``retention.ended_rank_seconds`` (default 120 s) without the rank being registered and
  without an increment: its GIL sample counters, its OOM counters still at 0 and its exit counts
  (``rank_exits``: no alert looks back at them, Prometheus keeps their history);
- after ``retention.oom_kill_seconds`` (default 1800 s): its non-zero OOM-kill and CUDA-OOM
  counters (``EVENT_COUNTERS``). ``GPURankOOMKilled`` looks back 10 minutes (``increase(...[10m])``,
  ``offset 10m``), and its third branch (kill and ``gpuwatch_rank_up == 0``) holds while the rank
  is still registered, when nothing is dropped at all. Dropping a counter earlier than the rule's
  window would let it reappear from the event log after a restart and page again.

Series without a ``job_id`` (unattributed kills, Xids per GPU, the kernel-log counters) are
bounded by the node (GPUs, Xid codes, killers) and are kept. Cost: one pass over the counter
series per cycle; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.config.schema import RetentionConfig
from gpuwatchd.counters import CounterStore, Series, rank_label_positions
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem

EVENT_COUNTERS = frozenset({"oom_kills", "cuda_oom_errors"})
# (job_id, rank) as the label values the counter series carry: not a RankId, whose rank is an int
RankLabels = tuple[str, str]


class SeriesRetention:
    """The policy, apart from the daemon (tests drive it with their own clock)."""

    def __init__(self, counters: CounterStore) -> None:
        self.counters = counters
        self._positions = rank_label_positions()
        self._last_registered: dict[RankLabels, float] = {}

    def expired(self, registered: Iterable[RankLabels], now: float, config: RetentionConfig) -> list[Series]:
        live = set(registered)
        for key in live:
            self._last_registered[key] = now
        drop: list[Series] = []
        kept: set[RankLabels] = set()
        for name, labels, value, touched in self.counters.series():
            pos = self._positions.get(name)
            if pos is None or not labels[pos[0]]:
                continue
            key = (labels[pos[0]], labels[pos[1]])
            kept.add(key)
            if key in live:
                continue
            last = max(touched, self._last_registered.get(key, float("-inf")))
            keep = config.oom_kill_seconds if name in EVENT_COUNTERS and value > 0 else config.ended_rank_seconds
            if now - last > keep:
                drop.append((name, labels))
        # remember when a rank was last registered only while it has series (bounded by them)
        for key in [k for k in self._last_registered if k not in kept]:
            del self._last_registered[key]
        return drop

    def apply(self, registered: Iterable[RankLabels], now: float, config: RetentionConfig) -> int:
        return self.counters.remove(self.expired(registered, now, config))


class RetentionSubsystem(Subsystem):
    """Runs the policy in each cycle, before the counters are snapshotted for the state."""

    name = "retention"

    def __init__(self, services: Services) -> None:
        self.policy = SeriesRetention(services.counters)

    def observe(self, daemon: DaemonContext, ranks: Ranks) -> None:
        registered = [(e.job_id, str(e.rank)) for e in ranks.entries]
        self.policy.apply(registered, ranks.now, daemon.config.retention)
