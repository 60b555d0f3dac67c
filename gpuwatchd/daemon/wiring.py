"""Which parts a daemon runs, the track stage that calls them by name, and how one that failed is
exported: the wiring of ``daemon/core.py``'s cycle, and the only daemon module that imports the
subsystems.

``track`` is where the cycle's dependencies are written down: each part is called with the
outputs it needs as arguments (the flight recorder gets the stall part's verdicts, the
straggler and the stall part the heartbeats), never through a shared record that earlier parts
filled. ``gpuwatchd doctor`` reads its one PID through the same process view (daemon/proc_view.py)
and fork evidence (daemon/fork_evidence.py) and runs the same rules; the trackers here keep memory
across cycles (a stall is an absence of progress over minutes), which one look cannot have: for
those it shows the daemon's latest state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from gpuwatchd.config import Config
from gpuwatchd.daemon.exits import ExitsSubsystem
from gpuwatchd.daemon.finding_events import FindingEventsSubsystem
from gpuwatchd.daemon.flight_recorder import FlightRecorderSubsystem
from gpuwatchd.daemon.kernel_log import KernelLogSubsystem
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.nccl_ras import NcclRasSubsystem
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.retention import RetentionSubsystem
from gpuwatchd.daemon.stall import StallSubsystem
from gpuwatchd.daemon.straggler import StragglerSubsystem
from gpuwatchd.daemon.subsystem import (
    DaemonContext,
    ExitOutput,
    FlightOutput,
    GpuOutput,
    KernelOutput,
    MemoryOutput,
    Ranks,
    RasOutput,
    StallOutput,
    StragglerOutput,
    Subsystem,
    Tracked,
)
from gpuwatchd.isolation import attempt
from gpuwatchd.join.nccl_ras import confirm_by_ras
from gpuwatchd.model import CollectorStatus, RankId

S = TypeVar("S", bound=Subsystem)
T = TypeVar("T")


def down_statuses(reported: list[CollectorStatus], down: Mapping[str, str]) -> list[CollectorStatus]:
    """A subsystem that failed to start, or whose part of this cycle raised, is exported as a
    collector that is down (``gpuwatch_collector_success{collector=<subsystem>} 0``) unless it
    reported its own status: a failure must read 0, never make the series disappear."""
    names = {c.name for c in reported}
    return [CollectorStatus(name, False, 0.0, None, error) for name, error in down.items()
            if name not in names]


@dataclass
class Parts:
    """The daemon's subsystems by name (each at most once); ``others``: parts with no output
    for the join, which the track stage only lets ``observe`` the ranks."""

    stall: StallSubsystem | None = None
    flight_recorder: FlightRecorderSubsystem | None = None
    straggler: StragglerSubsystem | None = None
    kernel_log: KernelLogSubsystem | None = None
    nvml: NvmlSubsystem | None = None
    memory: MemorySubsystem | None = None
    exits: ExitsSubsystem | None = None
    nccl_ras: NcclRasSubsystem | None = None
    others: list[Subsystem] = field(default_factory=list)

    @classmethod
    def of(cls, subsystems: list[Subsystem]) -> Parts:
        parts = cls()
        named = {StallSubsystem: "stall", FlightRecorderSubsystem: "flight_recorder",
                 StragglerSubsystem: "straggler", KernelLogSubsystem: "kernel_log",
                 NvmlSubsystem: "nvml", MemorySubsystem: "memory", ExitsSubsystem: "exits",
                 NcclRasSubsystem: "nccl_ras"}
        for sub in subsystems:
            slot = next((n for t, n in named.items() if isinstance(sub, t)), None)
            if slot is None:
                parts.others.append(sub)
            elif getattr(parts, slot) is not None:
                raise ValueError(f"two {slot} subsystems: a part's output has one producer")
            else:
                setattr(parts, slot, sub)
        return parts


def track(parts: Parts, daemon: DaemonContext, ranks: Ranks, heartbeats: Mapping[RankId, float],
          down: dict[str, str]) -> Tracked:
    """Each part of the cycle by name, isolated: one that raises loses its own output (and is
    added to ``down``, exported as a collector that is down), nothing else."""

    def part(sub: S | None, call: Callable[[S], T], default: T) -> T:
        if sub is None:
            return default
        out, error = attempt(f"subsystem {sub.name} track", lambda: call(sub), default)
        if error is not None:
            down.setdefault(sub.name, error)
        return out

    p = parts
    stall = part(p.stall, lambda s: s.track(daemon, ranks, heartbeats), StallOutput())
    flight = part(p.flight_recorder, lambda s: s.track(daemon, ranks, stall.verdicts), FlightOutput())
    straggler = part(p.straggler, lambda s: s.track(daemon, ranks, heartbeats), StragglerOutput())
    kernel = part(p.kernel_log, lambda s: s.track(daemon, ranks), KernelOutput())
    gpu = part(p.nvml, lambda s: s.track(daemon, ranks), GpuOutput())
    memory = part(p.memory, lambda s: s.track(daemon, ranks), MemoryOutput())
    exits = part(p.exits, lambda s: s.track(daemon, ranks), ExitOutput())
    ras = part(p.nccl_ras, lambda s: s.track(daemon, ranks, stall.verdicts), RasOutput())
    if ras.jobs:  # a rank in a collective that RAS confirms stuck: stalled at the conclusive bound
        conf = daemon.config.stall
        confirmed = confirm_by_ras(stall.verdicts, ras.jobs, min(conf.conclusive_seconds, conf.after_seconds))
        if confirmed:
            stall = replace(stall, verdicts={**stall.verdicts, **confirmed},
                            stalled={**stall.stalled, **{k: True for k in confirmed}})
    for other in p.others:
        part(other, lambda s: s.observe(daemon, ranks), None)
    return Tracked(stall, flight, straggler, kernel, gpu, memory, exits, ras, down)


def default_subsystems(config: Config) -> list[Subsystem]:
    """The subsystems a real daemon runs (NVML, kernel log, py-spy ...), as configured. Their
    order is that of their after-join hooks and start; the track stage calls them by name."""
    gpu: list[Subsystem] = [NvmlSubsystem()] if config.nvml.enabled else []
    kernel = KernelLogSubsystem()
    fr: list[Subsystem] = ([FlightRecorderSubsystem(config.stall.flight_recorder_interval_seconds)]
                           if config.stall.flight_recorder else [])  # fmt: skip
    ras: list[Subsystem] = ([NcclRasSubsystem(config.stall.nccl_ras_interval_seconds,
                                              config.stall.nccl_ras_timeout_seconds)]
                            if config.stall.nccl_ras else [])  # fmt: skip
    slow: list[Subsystem] = [StragglerSubsystem(config.straggler)] if config.straggler.enabled else []
    memory: list[Subsystem] = [MemorySubsystem(config)] if config.memory.enabled else []
    return [StallSubsystem(config), *fr, *ras, *slow, kernel, ExitsSubsystem(), *gpu, *memory,
            FindingEventsSubsystem(), RetentionSubsystem()]
