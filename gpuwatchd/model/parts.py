"""What each part of the daemon's track stage returns (daemon/wiring.py ``track``), the records
they carry, and ``Tracked``, one field per part: the rules read these as they are
(``FindingContext.parts``, findings/context.py), the join takes them whole (join/state.py). Each
reading is declared once, in the output of the part that produces it (tests/test_parts.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatchd.model import (
    CollectorStatus,
    GilReading,
    GpuDevice,
    GpuProcess,
    GpuUevent,
    NodeMemoryState,
    Orphan,
    ProcessInfo,
    ProcEvidence,
    RankId,
    RankMemory,
    frozen_map,
)
from gpuwatchd.model.collectives import CollectiveStatus
from gpuwatchd.model.cuda_oom import AttributedOom
from gpuwatchd.model.events import Event
from gpuwatchd.model.exits import RankExit
from gpuwatchd.model.nccl_ras import RasJob
from gpuwatchd.model.stall import StallVerdict


@dataclass(frozen=True)
class GpuRemoved:
    """A GPU's udev ``remove``/``unbind`` (sources/udev.py) not undone by an ``add``/``bind`` of
    the same PCI address since, with the index and UUID NVML last showed there ("" if none)."""

    uevent: GpuUevent
    gpu_index: str = ""
    uuid: str = ""


@dataclass(frozen=True)
class NvmlLostGpu:
    """NVML answered NVML_ERROR_GPU_IS_LOST for GPU ``index`` at this cycle's reading, seen at
    ``seen_at``; ``known``: its last good reading, if any."""

    index: int
    known: GpuDevice | None
    seen_at: float


@dataclass(frozen=True)
class FrReading:
    """One rank's answer: its groups, or why there is none."""

    job_id: str
    rank: int
    pid: int
    groups: tuple[CollectiveStatus, ...] = ()
    # pg -> {seq: profiling name} of the newest entries (for the desync check)
    names: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    # "waiting" just after a request, "no answer" after the grace, or the rank's own error
    error: str = ""


@dataclass(frozen=True)
class RankRate:
    job_id: str
    rank: int
    pid: int
    rate: float | None  # steps per second over the window; None until the window is half full
    window_seconds: float  # what the rate was measured over
    median: float | None  # median rate of the job's ranks on this node with a rate
    peers: tuple[int, ...]  # the ranks the median was taken over
    below_since: float | None  # first cycle of the current run below ratio * median
    straggler: bool
    throttled_periods: int = 0  # cpu.stat over the window
    periods: int = 0
    throttled_seconds: float = 0.0


@dataclass(frozen=True)
class StallOutput:
    """Producer: ``StallSubsystem.track`` (heartbeats, /proc, py-spy looks; the GIL sampler)."""

    progress: Mapping[RankId, float] = field(default_factory=frozen_map)  # last progress seen
    stalled: Mapping[RankId, bool] = field(default_factory=frozen_map)
    verdicts: Mapping[RankId, StallVerdict] = field(default_factory=frozen_map)
    gil: Mapping[RankId, Sequence[GilReading]] = field(default_factory=frozen_map)
    status: CollectorStatus | None = None  # collector ``pyspy``


@dataclass(frozen=True)
class FlightOutput:
    """Producer: ``FlightRecorderSubsystem.track`` (given the stall verdicts)."""

    records: Mapping[RankId, FrReading] = field(default_factory=frozen_map)  # of stalled jobs
    collectives: tuple[CollectiveStatus, ...] = ()


@dataclass(frozen=True)
class RasOutput:
    """Producer: ``NcclRasSubsystem.track`` (given the stall verdicts)."""

    jobs: Mapping[str, RasJob] = field(default_factory=frozen_map)  # suspect jobs only


@dataclass(frozen=True)
class StragglerOutput:
    """Producer: ``StragglerSubsystem.track`` (given the heartbeats)."""

    steps: Mapping[RankId, int] = field(default_factory=frozen_map)
    rates: Mapping[RankId, RankRate] = field(default_factory=frozen_map)


@dataclass(frozen=True)
class KernelOutput:
    """Producer: ``KernelLogSubsystem.track`` (the kernel-log thread's events, /proc/vmstat)."""

    events: tuple[Event, ...] = ()  # recent OOM kills and Xids
    status: CollectorStatus | None = None  # collector ``kernel_log``


@dataclass(frozen=True)
class GpuOutput:
    """Producer: ``NvmlSubsystem.track`` (NVML, devfds, CUDA-OOM files, udev)."""

    gpus: tuple[GpuDevice, ...] = ()
    holders: tuple[GpuProcess, ...] = ()  # the processes NVML lists on each GPU
    orphans: tuple[Orphan, ...] = ()
    other_processes: Mapping[int, ProcessInfo] = field(default_factory=frozen_map)  # GPU PIDs outside the rank trees
    fork_evidence: Mapping[int, ProcEvidence] = field(default_factory=frozen_map)
    orphan_jobs: Mapping[int, str] = field(default_factory=frozen_map)
    gpus_removed: tuple[GpuRemoved, ...] = ()
    gpus_lost: tuple[NvmlLostGpu, ...] = ()
    cuda_ooms: tuple[AttributedOom, ...] = ()
    status: CollectorStatus | None = None  # collector ``nvml``


@dataclass(frozen=True)
class MemoryOutput:
    """Producer: ``MemorySubsystem.track`` (memcg, /proc/meminfo, PSI)."""

    rank_memory: tuple[RankMemory, ...] = ()
    node: NodeMemoryState | None = None
    status: CollectorStatus | None = None  # collector ``memory``


@dataclass(frozen=True)
class ExitOutput:
    """Producer: ``ExitsSubsystem.track`` (the exit watcher's pidfds, joined with the kernel's
    fault lines and OOM-kill / Xid events)."""

    recent: tuple[RankExit, ...] = ()  # the recent exits (join/exits.py ExitLedger)
    status: CollectorStatus | None = None  # collector ``exits``
    # a process's /proc start ticks as a Unix time to the tick (sources/exits.start_clock, the
    # ledger's own); None where the part is off (then only /proc's whole-second ``btime``)
    started: Callable[[int], float] | None = None


@dataclass(frozen=True)
class Tracked:
    """The track stage's output (``daemon/wiring.py: track``): one field per part, each of which
    has that part as its only producer; a part absent or down this cycle leaves its default.
    The rules read it as ``FindingContext.parts``."""

    stall: StallOutput = StallOutput()
    flight: FlightOutput = FlightOutput()
    straggler: StragglerOutput = StragglerOutput()
    kernel: KernelOutput = KernelOutput()
    gpu: GpuOutput = GpuOutput()
    memory: MemoryOutput = MemoryOutput()
    exits: ExitOutput = ExitOutput()
    ras: RasOutput = RasOutput()
    down: Mapping[str, str] = field(default_factory=frozen_map)  # part -> why it is down
