"""What a subsystem is, and what of the daemon it may use: a leaf module, so that the subsystems
(daemon/gpu.py, kernel_log.py, gil.py, memory.py, finding_events.py) and the daemon that runs them
(daemon/core.py) both import it and never each other.

``DaemonContext`` is the part of ``daemon.core.Daemon`` a subsystem sees: its configuration, host
paths, clock, counters, /proc reader, stop event, the shared Xid de-duplicator, the state-file
writer, and
``request_exit``. Nothing else of the daemon is reachable, and nothing is patched onto it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gpuwatchd.config import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.model import NodeState
from gpuwatchd.paths import HostPaths
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
    # One for the daemon's lifetime, created by the daemon: the NVML Xid watcher and the kernel
    # log both record into it, so that a critical Xid reported twice is counted once.
    xid_dedup: XidDeduper
    state_files: StateFiles  # every state_dir write goes through it (counted write errors)

    @property
    def subsystems(self) -> Sequence[Subsystem]: ...

    def request_exit(self, status: int, why: str) -> None: ...


class Subsystem:
    """A part of the daemon with its own threads or polled source (NVML, kernel log, GIL ...).

    ``before_join`` returns keyword overrides for ``CycleInputs`` (e.g. ``gpus``, ``orphans``,
    ``extra_findings``, ``progress``); tuples are concatenated, mappings merged. Each call runs
    isolated: a subsystem that raises loses its contribution for that cycle, nothing else.
    """

    name = "subsystem"

    def start(self, daemon: DaemonContext) -> None:
        """Start threads; ``daemon.stop_event`` says when to end."""

    def before_join(self, daemon: DaemonContext, partial: Mapping[str, Any]) -> Mapping[str, Any]:
        return {}

    def after_join(self, daemon: DaemonContext, state: NodeState) -> None:
        """See the new state (e.g. remember rank trees, emit events for new findings)."""

    def stop(self) -> None:
        """Release resources; threads end on ``daemon.stop_event``."""
