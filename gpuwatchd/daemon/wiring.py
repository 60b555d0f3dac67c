"""Which subsystems a daemon runs, in which order, and how one that failed is exported: the
wiring of ``daemon/core.py``'s cycle."""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatchd.config import Config
from gpuwatchd.daemon.collectives import FlightRecorderSubsystem
from gpuwatchd.daemon.finding_events import FindingEventsSubsystem
from gpuwatchd.daemon.gpu import GpuSubsystem
from gpuwatchd.daemon.kernel_log import KernelLogSubsystem
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.pyspy import PySpySubsystem
from gpuwatchd.daemon.retention import RetentionSubsystem
from gpuwatchd.daemon.straggler import StragglerSubsystem
from gpuwatchd.daemon.subsystem import Subsystem
from gpuwatchd.model import CollectorStatus


def down_statuses(reported: list[CollectorStatus], down: Mapping[str, str]) -> list[CollectorStatus]:
    """A subsystem that failed to start, or whose part of this cycle raised, is exported as a
    collector that is down (``gpuwatch_collector_success{collector=<subsystem>} 0``) unless it
    reported its own status: a failure must read 0, never make the series disappear."""
    names = {c.name for c in reported}
    return [CollectorStatus(name, False, 0.0, None, error) for name, error in down.items()
            if name not in names]


def default_subsystems(config: Config) -> list[Subsystem]:
    """The subsystems a real daemon runs (NVML, kernel log, py-spy ...), as configured."""
    gpu: list[Subsystem] = [GpuSubsystem()] if config.nvml.enabled else []

    kernel = KernelLogSubsystem()
    # the flight recorder reads the stall verdicts of the py-spy subsystem: it comes after it
    fr: list[Subsystem] = ([FlightRecorderSubsystem(config.stall.flight_recorder_interval_seconds)]
                           if config.stall.flight_recorder else [])  # fmt: skip
    slow: list[Subsystem] = [StragglerSubsystem(config.straggler)] if config.straggler.enabled else []
    memory: list[Subsystem] = [MemorySubsystem(config)] if config.memory.enabled else []
    return [PySpySubsystem(config), *fr, *slow, kernel, *gpu, *memory, FindingEventsSubsystem(),
            RetentionSubsystem()]
