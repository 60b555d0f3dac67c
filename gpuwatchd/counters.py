"""Monotonic counters shared by the streaming sources and the exporter.

Counters are the one piece of mutable state the outputs read: the kernel log, the GIL sampler and
the CUDA-OOM reader increment them from their own threads; the exporter reads a snapshot. Names and
label order are fixed in ``model.COUNTER_LABELS``; a wrong arity is a programming error.

Each series remembers when it last changed (``touched``): the retention policy (retention.py)
drops the series of ranks that have ended, and needs to know how recent their last event was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from gpuwatchd.model import COUNTER_LABELS

Series = tuple[str, tuple[str, ...]]  # (counter name, label values)


def rank_label_positions() -> dict[str, tuple[int, int]]:
    """Counter name -> positions of its ``job_id`` and ``rank`` labels (per-rank counters only)."""
    return {
        name: (labels.index("job_id"), labels.index("rank"))
        for name, labels in COUNTER_LABELS.items()
        if "job_id" in labels and "rank" in labels
    }


class CounterStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in COUNTER_LABELS}
        self._touched: dict[Series, float] = {}
        self.version = 0  # bumped on every change: lets the exporter reuse a rendered scrape

    def _check(self, name: str, labels: tuple[str, ...]) -> None:
        want = COUNTER_LABELS.get(name)
        if want is None:
            raise KeyError(f"unknown counter {name!r}")
        if len(labels) != len(want):
            raise ValueError(f"counter {name} takes labels {want}, got {labels}")

    def inc(self, name: str, labels: tuple[str, ...] = (), n: float = 1.0, at: float | None = None) -> None:
        """Add ``n``; ``at`` is when it happened (an event replayed from the log at start is as
        old as the event, not as the restart)."""
        self._check(name, labels)
        if not n >= 0 or n == float("inf"):  # also refuses NaN
            raise ValueError(f"counters only go up by finite amounts, got {n!r}")
        when = self.clock() if at is None else at
        with self._lock:
            series = self._values[name]
            series[labels] = series.get(labels, 0.0) + n
            key = (name, labels)
            self._touched[key] = max(when, self._touched.get(key, when))
            self.version += 1

    def ensure(self, name: str, labels: tuple[str, ...] = ()) -> None:
        """Create the series at 0 so that ``increase()`` sees its first increment."""
        self._check(name, labels)
        with self._lock:
            if labels not in self._values[name]:
                self._values[name][labels] = 0.0
                self._touched[(name, labels)] = self.clock()
                self.version += 1

    def get(self, name: str, labels: tuple[str, ...] = ()) -> float:
        with self._lock:
            return self._values.get(name, {}).get(labels, 0.0)

    def snapshot(self) -> Mapping[str, Mapping[tuple[str, ...], float]]:
        with self._lock:
            return {name: dict(series) for name, series in self._values.items()}

    def series(self) -> list[tuple[str, tuple[str, ...], float, float]]:
        """Every series as (name, labels, value, last changed)."""
        with self._lock:
            return [
                (name, labels, v, self._touched.get((name, labels), 0.0))
                for name, series in self._values.items()
                for labels, v in series.items()
            ]

    def remove(self, drop: Iterable[Series]) -> int:
        """Forget these series (their rank has ended); returns how many were there."""
        n = 0
        with self._lock:
            for name, labels in drop:
                if self._values.get(name, {}).pop(labels, None) is not None:
                    n += 1
                self._touched.pop((name, labels), None)
            if n:
                self.version += 1
        return n
