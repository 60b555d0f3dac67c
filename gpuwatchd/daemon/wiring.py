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
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from gpuwatchd.config.schema import Config
from gpuwatchd.daemon.exits import ExitsSubsystem
from gpuwatchd.daemon.finding_events import FindingEventsSubsystem
from gpuwatchd.daemon.flight_recorder import FlightRecorderSubsystem
from gpuwatchd.daemon.kernel_log import KernelLogSubsystem
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.nccl_ras import NcclRasSubsystem
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.off import Off
from gpuwatchd.daemon.retention import RetentionSubsystem
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.stall import StallSubsystem
from gpuwatchd.daemon.straggler import StragglerSubsystem
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.isolation import attempt
from gpuwatchd.join.nccl_ras import confirm_by_ras
from gpuwatchd.join.stall_spin import rank_gpu_readings
from gpuwatchd.model import CollectorStatus, NodeState, RankId
from gpuwatchd.model.parts import (
    ExitOutput,
    FlightOutput,
    GpuOutput,
    KernelOutput,
    MemoryOutput,
    RasOutput,
    StallOutput,
    StragglerOutput,
    Tracked,
)

S = TypeVar("S", bound=Subsystem)
T = TypeVar("T")


def down_statuses(reported: list[CollectorStatus], down: Mapping[str, str]) -> list[CollectorStatus]:
    """A subsystem that failed to start, or whose part of this cycle raised, is exported as a
    collector that is down (``gpuwatch_collector_success{collector=<subsystem>} 0``) unless it
    reported its own status: a failure must read 0, never make the series disappear."""
    names = {c.name for c in reported}
    return [CollectorStatus(name, False, 0.0, None, error) for name, error in down.items() if name not in names]


@dataclass(frozen=True)
class Parts:
    """The daemon's parts by name, each built whole (``build_parts``), or ``Off`` where the daemon
    does not run it: every slot holds a part, and the track stage calls each the same way. The
    order of ``all`` is that of their start and after-join hooks."""

    stall: StallSubsystem | Off[StallOutput] = Off("pyspy", StallOutput())
    flight_recorder: FlightRecorderSubsystem | Off[FlightOutput] = Off("flight_recorder", FlightOutput())
    nccl_ras: NcclRasSubsystem | Off[RasOutput] = Off("nccl_ras", RasOutput())
    straggler: StragglerSubsystem | Off[StragglerOutput] = Off("straggler", StragglerOutput())
    kernel_log: KernelLogSubsystem | Off[KernelOutput] = Off("kernel_log", KernelOutput())
    exits: ExitsSubsystem | Off[ExitOutput] = Off("exits", ExitOutput())
    nvml: NvmlSubsystem | Off[GpuOutput] = Off("nvml", GpuOutput())
    memory: MemorySubsystem | Off[MemoryOutput] = Off("memory", MemoryOutput())
    finding_events: FindingEventsSubsystem | Off[None] = Off("finding_events", None)
    retention: RetentionSubsystem | Off[None] = Off("retention", None)

    def all(self) -> list[Subsystem]:
        return [getattr(self, f.name) for f in fields(self)]


OFF = Parts()  # every part off: a daemon that reads rank files and /proc only


def build_parts(config: Config, services: Services) -> Parts:
    """The parts a real daemon runs (NVML, kernel log, py-spy ...), as configured: the one place
    they are built, each with every collaborator it has (``start`` only starts threads)."""
    s = config.stall
    return Parts(
        stall=StallSubsystem(config, services),
        flight_recorder=(
            FlightRecorderSubsystem(s.flight_recorder_interval_seconds) if s.flight_recorder else OFF.flight_recorder
        ),
        nccl_ras=(
            NcclRasSubsystem(s.nccl_ras_interval_seconds, s.nccl_ras_timeout_seconds) if s.nccl_ras else OFF.nccl_ras
        ),
        straggler=StragglerSubsystem(config, services) if config.straggler.enabled else OFF.straggler,
        kernel_log=KernelLogSubsystem(config, services),
        exits=ExitsSubsystem(services),
        nvml=NvmlSubsystem(config, services) if config.nvml.enabled else OFF.nvml,
        memory=MemorySubsystem(config, services) if config.memory.enabled else OFF.memory,
        finding_events=FindingEventsSubsystem(services),
        retention=RetentionSubsystem(services),
    )


def no_parts(config: Config, services: Services) -> Parts:
    """Every part off: a daemon that reads rank files and /proc only (``gpuwatchd ps`` without a
    running daemon, benches of the daemon's own reading)."""
    return OFF


def track(
    parts: Parts,
    daemon: DaemonContext,
    ranks: Ranks,
    heartbeats: Mapping[RankId, float],
    last: NodeState | None,
    down: dict[str, str],
) -> Tracked:
    """Each part of the cycle by name, in the order of what it needs (NVML before the stall part,
    which reads this cycle's GPUs; the stall verdicts before the flight recorder and NCCL RAS),
    each handed what it reads as arguments; ``last``: the previous cycle's state, the only thing
    of an earlier cycle a part is handed. ``down``: the parts that failed to start (not called).
    Each call isolated: one that raises loses its own output (and is added to ``down``, exported
    as a collector that is down), nothing else."""

    def part(sub: S, call: Callable[[S], T], default: T) -> T:
        if sub.name in down:  # failed to start: its default output
            return default
        out, error = attempt(f"subsystem {sub.name} track", lambda: call(sub), default)
        if error is not None:
            down.setdefault(sub.name, error)
        return out

    p = parts
    gpu = part(p.nvml, lambda s: s.track(daemon, ranks, last), GpuOutput())
    named = {e.rank_id: e.gpus for e in ranks.entries}
    gpus = rank_gpu_readings(ranks.now, named, ranks.trees.owner, gpu.gpus, gpu.holders)
    stall = part(p.stall, lambda s: s.track(daemon, ranks, heartbeats, gpus), StallOutput())
    flight = part(p.flight_recorder, lambda s: s.track(daemon, ranks, stall.verdicts), FlightOutput())
    ras = part(p.nccl_ras, lambda s: s.track(daemon, ranks, stall.verdicts), RasOutput())
    if ras.jobs:  # a rank in a collective that RAS confirms stuck: stalled at the conclusive bound
        conf = daemon.config.stall
        confirmed = confirm_by_ras(stall.verdicts, ras.jobs, min(conf.conclusive_seconds, conf.after_seconds))
        if confirmed:
            stall = replace(
                stall,
                verdicts={**stall.verdicts, **confirmed},
                stalled={**stall.stalled, **{k: True for k in confirmed}},
            )
    straggler = part(p.straggler, lambda s: s.track(daemon, ranks, heartbeats), StragglerOutput())
    kernel = part(p.kernel_log, lambda s: s.track(daemon, ranks), KernelOutput())
    memory = part(p.memory, lambda s: s.track(daemon, ranks), MemoryOutput())
    exits = part(p.exits, lambda s: s.track(daemon, ranks), ExitOutput())
    part(p.retention, lambda s: s.observe(daemon, ranks), None)
    return Tracked(stall, flight, straggler, kernel, gpu, memory, exits, ras, down)
