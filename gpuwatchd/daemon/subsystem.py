"""What a subsystem is, and what of the daemon it may use: a leaf module, so that the subsystems
(daemon/gpu.py, kernel_log.py, gil.py, memory.py, finding_events.py) and the daemon that runs them
(daemon/core.py) both import it and never each other.

``DaemonContext`` is the part of ``daemon.core.Daemon`` a subsystem sees: its configuration, host
paths, clock, counters, /proc reader, stop event, the shared services (daemon/services.py: the
py-spy runner, the Xid de-duplicator, the event log), the state-file writer, and ``request_exit``.
Nothing else of the daemon is reachable (no other subsystem), and nothing is patched onto it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwatchd.config import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.services import Services
from gpuwatchd.findings.context import RuleReadings
from gpuwatchd.join.state import CycleInputs
from gpuwatchd.model import (
    CollectiveStatus,
    CollectorStatus,
    GpuDevice,
    GpuProcess,
    NodeState,
    Orphan,
    ProcessInfo,
    frozen_map,
)
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.heartbeats import HeartbeatRoots
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.statefile import StateFiles


class DaemonContext(Protocol):
    """What ``Subsystem`` methods receive (``daemon.core.Daemon`` implements it)."""

    config: Config
    paths: HostPaths
    clock: Callable[[], float]
    counters: CounterStore
    procfs: ProcfsReader
    stop_event: threading.Event
    # Built once by the daemon (daemon/services.py): the one py-spy runner, Xid de-duplicator
    # and event log, shared by the subsystems that need them.
    services: Services
    state_files: StateFiles  # every state_dir write goes through it (counted write errors)
    heartbeat_roots: HeartbeatRoots  # heartbeats read in each rank's own root

    def request_exit(self, status: int, why: str) -> None: ...


@dataclass(frozen=True)
class Contribution(RuleReadings):
    """What one subsystem adds to a cycle's ``CycleInputs`` (same field names and types; the
    ``RuleReadings`` it extends go on unchanged to the finding rules).

    ``merge_into`` concatenates tuples, merges mappings (the contribution wins on a key) and sets
    ``node_memory`` when given; a field left at its default adds nothing.
    """

    gpus: tuple[GpuDevice, ...] = ()
    gpu_processes: tuple[GpuProcess, ...] = ()
    orphans: tuple[Orphan, ...] = ()
    processes: Mapping[int, ProcessInfo] = field(default_factory=frozen_map)  # e.g. GPU PIDs
    progress: Mapping[tuple[str, int], float] = field(default_factory=frozen_map)
    stalled: Mapping[tuple[str, int], bool] = field(default_factory=frozen_map)
    collectors: tuple[CollectorStatus, ...] = ()
    steps: Mapping[tuple[str, int], int] = field(default_factory=frozen_map)
    collectives: tuple[CollectiveStatus, ...] = ()

    def merge_into(self, inputs: CycleInputs) -> CycleInputs:
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (isinstance(value, (tuple, Mapping)) and not value):
                continue
            old = getattr(inputs, f.name)
            if isinstance(value, tuple):
                changes[f.name] = tuple(old) + value
            elif isinstance(value, Mapping):
                changes[f.name] = {**old, **value}
            else:
                changes[f.name] = value
        return dataclasses.replace(inputs, **changes) if changes else inputs


NOTHING = Contribution()


class Subsystem:
    """A part of the daemon with its own threads or polled source (NVML, kernel log, GIL ...).

    ``before_join`` sees the cycle's inputs so far (rank entries, /proc, and what the subsystems
    before it added) and returns its ``Contribution``. Each call runs isolated: a subsystem that
    raises loses its contribution for that cycle, nothing else.
    """

    name = "subsystem"

    def start(self, daemon: DaemonContext) -> None:
        """Start threads; ``daemon.stop_event`` says when to end."""

    def before_join(self, daemon: DaemonContext, cycle: CycleInputs) -> Contribution:
        return NOTHING

    def after_join(self, daemon: DaemonContext, state: NodeState) -> None:
        """See the new state (e.g. remember rank trees, emit events for new findings)."""

    def stop(self) -> None:
        """Release resources; threads end on ``daemon.stop_event``."""
