"""Monotonic counters shared by the streaming sources and the exporter.

Counters are the one piece of mutable state the outputs read: the kernel log, the GIL sampler and
the CUDA-OOM reader increment them from their own threads; the exporter reads a snapshot. Names and
label order are fixed in ``model.COUNTER_LABELS``; a wrong arity is a programming error.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from gpuwatchd.model import COUNTER_LABELS


class CounterStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in COUNTER_LABELS}
        self.version = 0  # bumped on every change: lets the exporter reuse a rendered scrape

    def _check(self, name: str, labels: tuple[str, ...]) -> None:
        want = COUNTER_LABELS.get(name)
        if want is None:
            raise KeyError(f"unknown counter {name!r}")
        if len(labels) != len(want):
            raise ValueError(f"counter {name} takes labels {want}, got {labels}")

    def inc(self, name: str, labels: tuple[str, ...] = (), n: float = 1.0) -> None:
        self._check(name, labels)
        if n < 0:
            raise ValueError("counters only go up")
        with self._lock:
            series = self._values[name]
            series[labels] = series.get(labels, 0.0) + n
            self.version += 1

    def ensure(self, name: str, labels: tuple[str, ...] = ()) -> None:
        """Create the series at 0 so that ``increase()`` sees its first increment."""
        self._check(name, labels)
        with self._lock:
            if labels not in self._values[name]:
                self._values[name][labels] = 0.0
                self.version += 1

    def get(self, name: str, labels: tuple[str, ...] = ()) -> float:
        with self._lock:
            return self._values.get(name, {}).get(labels, 0.0)

    def snapshot(self) -> Mapping[str, Mapping[tuple[str, ...], float]]:
        with self._lock:
            return {name: dict(series) for name, series in self._values.items()}
