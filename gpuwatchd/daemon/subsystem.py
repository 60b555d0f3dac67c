"""What a subsystem is, what of the daemon it may use, and what each part of the track stage
returns: a leaf module, so that the subsystems (daemon/nvml.py, kernel_log.py, stall.py, memory.py,
...) and the daemon that runs them (daemon/core.py) both import it and never each other.

``DaemonContext`` is the part of ``daemon.core.Daemon`` a subsystem sees: its configuration, host
paths, clock, counters, /proc reader, stop event, the shared services (daemon/services.py: the
py-spy runner, the Xid de-duplicator, the event log), the state-file writer, and ``request_exit``.
Nothing else of the daemon is reachable (no other subsystem), and nothing is patched onto it.

Each part is built whole from the configuration and the services (``daemon/wiring.py:
build_parts``). The track stage (``daemon/wiring.py: track``) calls each part by name with what
it needs as arguments: every part gets the cycle's ``Ranks``; the NVML part the last state; the
stall part the heartbeats and this cycle's GPU readings of each rank; the straggler the
heartbeats; the flight recorder and NCCL RAS the stall verdicts of the stall part. Each part returns its own
typed output, and ``Tracked`` holds one field per part: every field has exactly one producer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpuwatchd.config.schema import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.services import Services
from gpuwatchd.join.orphans import RankTrees
from gpuwatchd.model import (
    CgroupPaths,
    NodeState,
    ProcessInfo,
    RankEntry,
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
class Ranks:
    """The cycle's accepted ranks and their processes: what every part of the track stage reads.
    Producer: ``Daemon.read`` (rank files, /proc) narrowed by ``rank_claims.decide``."""

    now: float
    entries: tuple[RankEntry, ...]  # the accepted claims only
    processes: Mapping[int, ProcessInfo]  # each rank tree's /proc reading
    descendants: Mapping[int, tuple[int, ...]]  # rank PID -> its live descendants
    cgroups: Mapping[int, CgroupPaths]  # rank PID -> its cgroup (the process view)
    trees: RankTrees = field(default_factory=RankTrees)  # pid -> the live rank whose tree it is in


class Subsystem:
    """A part of the daemon with its own threads or polled source (NVML, kernel log, GIL ...).

    The parts that feed the join have a typed ``track`` method of their own, which the track stage
    calls by name. ``observe`` is for a part that reads the cycle's ranks but adds nothing to the
    join (series retention). Each call runs isolated: a part that raises loses its own output for
    that cycle and reads as a collector that is down, nothing else.
    """

    name = "subsystem"

    def start(self, daemon: DaemonContext) -> None:
        """Start threads; ``daemon.stop_event`` says when to end."""

    def observe(self, daemon: DaemonContext, ranks: Ranks) -> None:
        """See the cycle's ranks (a part with no output for the join)."""

    def after_join(self, daemon: DaemonContext, ranks: Ranks, state: NodeState) -> None:
        """See the new state and the cycle's ranks it was joined from (e.g. remember rank trees,
        emit events for new findings)."""

    def stop(self) -> None:
        """Release resources; threads end on ``daemon.stop_event``."""
