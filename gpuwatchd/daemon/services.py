"""The daemon's shared services, built once per daemon and handed to every part explicitly
(``DaemonContext.services``), never found by scanning the other parts:

- ``spy``: the one py-spy runner, whose concurrency limit (``gil.max_concurrent``) bounds stall
  dumps, GIL sampling and memory snapshots together;
- ``xid_dedup``: the Xid de-duplicator the NVML Xid watcher and the kernel log both record into,
  so that a critical Xid reported by both is counted once;
- ``events``: the event log (``state_dir/events.jsonl`` and the counters it stands for), with one
  writer: finding transitions and memory snapshots go into the same store as the kernel events;
- ``faults``: the kernel's segfault / trap lines by PID, recorded by the kernel-log thread and
  read by the exits part when a rank's exit is joined with them.

Building them reads nothing but the py-spy binary's path (``shutil.which``); no thread starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gpuwatchd.config import Config
from gpuwatchd.join.event_store import EventStore
from gpuwatchd.join.kernel_faults import KernelFaults
from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.model.events import Event
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.pyspy import PySpy


class EventLog:
    """The daemon's one writer of ``events.jsonl``. The kernel-log part opens it on the store its
    processor reads back at start (``open``); until then, and in a daemon without a kernel-log
    part, ``record`` stores nothing and says so (False), like a duplicate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: EventStore | None = None

    def open(self, store: EventStore) -> None:
        with self._lock:
            self._store = store

    @property
    def is_open(self) -> bool:
        return self._store is not None

    def record(self, ev: Event) -> bool:
        """Store ``ev`` (counted exactly once by its key); False for a duplicate or a closed log."""
        store = self._store
        return store.add(ev) if store is not None else False

    def recent(self) -> list[Event]:
        """The kernel events (OOM kills, Xids) of the store's recent window; [] while closed."""
        store = self._store
        return store.recent() if store is not None else []


@dataclass
class Services:
    spy: PySpy
    xid_dedup: XidDeduper = field(default_factory=XidDeduper)
    events: EventLog = field(default_factory=EventLog)
    faults: KernelFaults = field(default_factory=KernelFaults)  # the kernel log's fault lines

    @classmethod
    def build(cls, config: Config, paths: HostPaths) -> Services:
        g = config.gil
        spy = PySpy.from_config(
            g.pyspy_path, paths=paths, max_concurrent=g.max_concurrent,
            timeout_seconds=g.timeout_seconds,
            dump_timeout_seconds=min(5.0, max(1.0, config.interval_seconds / 2)),
        )
        return cls(spy)
