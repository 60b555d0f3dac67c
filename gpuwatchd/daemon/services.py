"""The daemon's shared services, built once per daemon before its parts (``build_parts`` in
daemon/wiring.py takes them) and handed to every part in its constructor, never found by scanning
the other parts:

- ``paths``, ``clock``, ``counters``, ``state_files``, ``procfs``, ``heartbeat_roots``: the host's
  roots, the one clock, the counter store, the one writer of ``state_dir`` (counted write errors),
  the /proc reader and the heartbeat files read in each rank's own root;
- ``spy``: the one py-spy runner, whose concurrency limit (``gil.max_concurrent``) bounds stall
  dumps, GIL sampling and memory snapshots together;
- ``xid_dedup``: the Xid de-duplicator the NVML Xid watcher and the kernel log both record into,
  so that a critical Xid reported by both is counted once;
- ``events``: the event log (events/store.py: ``state_dir/events.jsonl``, the counters it stands
  for, and the bus that appends to it, the journal and Alertmanager), with one writer that every
  part records into: the kernel events, finding transitions, memory snapshots and rank exits;
- ``faults``: the kernel's segfault / trap lines by PID, recorded by the kernel-log thread and
  read by the exits part when a rank's exit is joined with them.

Building them reads the py-spy binary's path (``shutil.which``), the boot id, and
``state_dir/events.jsonl`` back into the counters (``event_log=False``: not read, for a one-cycle
reader such as ``gpuwatchd ps``); no thread starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatchd.config.schema import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.events.alertmanager import derive_instance
from gpuwatchd.events.bus import EventBus, build_bus
from gpuwatchd.events.log import EventFile
from gpuwatchd.events.store import EventStore
from gpuwatchd.join.kernel_faults import KernelFaults
from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.heartbeats import HeartbeatRoots
from gpuwatchd.sources.kmsg import read_boot_id
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.statefile import StateFiles, make_state_dir


@dataclass
class Services:
    paths: HostPaths
    clock: Callable[[], float]
    counters: CounterStore
    state_files: StateFiles
    procfs: ProcfsReader
    heartbeat_roots: HeartbeatRoots
    spy: PySpy
    events: EventStore
    boot_id: str = ""
    xid_dedup: XidDeduper = field(default_factory=XidDeduper)
    faults: KernelFaults = field(default_factory=KernelFaults)  # the kernel log's fault lines

    @classmethod
    def build(cls, config: Config, paths: HostPaths | None = None, *,
              clock: Callable[[], float] = time.time, counters: CounterStore | None = None,
              write_state: bool = True, event_log: bool = True, spy: PySpy | None = None,
              bus: EventBus | None = None) -> Services:  # fmt: skip
        """``write_state``: count ``state_dir`` writes (False: a read-only user's daemon).
        ``bus``: where new events go (None: the daemon's sinks, ``build_bus``)."""
        paths = paths or HostPaths(procfs=config.procfs)
        counters = counters or CounterStore()
        files = StateFiles(counters if write_state else None)
        g = config.gil
        spy = spy or PySpy.from_config(
            g.pyspy_path,
            paths=paths,
            max_concurrent=g.max_concurrent,
            timeout_seconds=g.timeout_seconds,
            dump_timeout_seconds=min(5.0, max(1.0, config.interval_seconds / 2)),
        )
        boot_id = read_boot_id(paths)
        if event_log:
            make_state_dir(config.state_dir)  # unwritable: events are still counted, writes counted
            am = config.alertmanager
            bus = bus or build_bus(
                config.state_dir,
                alertmanager_url=am.url,
                instance=am.instance or derive_instance(config.web.listen_address),
                timeout_seconds=am.timeout_seconds,
                scrape_job=am.job,
                files=files,
            )
        events = EventStore(
            EventFile(config.state_dir, files),
            counters,
            bus=bus if event_log else None,
            boot_id=boot_id,
            clock=clock,
            read_back=event_log,
            retention_seconds=config.retention.oom_kill_seconds,
        )
        return cls(paths, clock, counters, files, ProcfsReader(paths), HeartbeatRoots(), spy, events, boot_id)

    def close(self) -> None:
        """End what the services hold open (the event sinks, the heartbeat roots)."""
        if self.events.bus is not None:
            self.events.bus.close()
        self.heartbeat_roots.close()
