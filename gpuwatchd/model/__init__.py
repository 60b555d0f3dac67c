"""Immutable data that flows from sources through the join to the outputs.

Sources produce the *reading* types (``ProcessInfo``, ``RankEntry``, ``GpuDevice``,
``GpuProcess``, ``KernelEvent`` ...). The join (``gpuwatchd.join.state``) turns one cycle's readings
into a ``NodeState``; the exporter, the event sinks and the CLI only ever read a ``NodeState``.
Everything here is a frozen dataclass so that a scrape can read the latest state without a lock.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, TypeGuard

from gpuwatchd.model.collectives import CollectiveStatus
from gpuwatchd.model.nccl_ras import RasRankStatus

# nvml.h clocksEventReasons bits -> the reason label of gpuwatch_gpu_clock_throttled
THROTTLE_REASONS: Mapping[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}
# the reasons that slow a busy GPU down (the others are idle, settings or benign)
SLOWING_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")

# Severities map one to one onto the Alertmanager routing in deploy/alertmanager/.
PAGE = "page"
WARNING = "warning"
INFO = "info"


def frozen_map(d: Mapping[Any, Any] | None = None) -> Mapping[Any, Any]:
    """A read-only view of a copy of ``d`` (dataclass default helper)."""
    return MappingProxyType(dict(d or {}))


class RankId(NamedTuple):
    """Who a rank is: rank ``rank`` of job ``job_id``, the key of every per-rank reading. A
    tuple, so it hashes and compares as the ``(job_id, rank)`` it replaces."""

    job_id: str
    rank: int


class RankProcess(NamedTuple):
    """One process that claims a rank: what is true of this PID only (its start time, when it
    died, its fd count), so that a restarted rank is a new key. A tuple like ``RankId``."""

    job_id: str
    rank: int
    pid: int

    @property
    def rank_id(self) -> RankId:
        return RankId(self.job_id, self.rank)


class RankIdentity:
    """What names the rank and the process of a value that carries ``job_id``, ``rank`` and
    ``pid`` (``RankEntry``, ``RankState``). Each is made once per value (a cycle asks a rank's
    ``rank_id`` over a thousand times at 64 ranks) and kept in the instance's ``__dict__``, out
    of the dataclass fields: equality, hashing, ``replace`` and state.json see the fields only."""

    __slots__ = ()
    job_id: str
    rank: int
    pid: int

    @functools.cached_property
    def rank_id(self) -> RankId:
        return RankId(self.job_id, self.rank)

    @functools.cached_property
    def rank_process(self) -> RankProcess:
        return RankProcess(self.job_id, self.rank, self.pid)


@dataclass(frozen=True)
class ProcessInfo:
    """One process as /proc shows it at one instant (see sources/procfs.py)."""

    pid: int
    ppid: int
    comm: str
    state: str  # one letter of /proc/PID/stat field 3: R S D Z T t I X
    uid: int
    user: str
    start_ticks: int  # /proc/PID/stat field 22, clock ticks after boot: PID-reuse guard
    start_time: float  # the same as a Unix timestamp
    cpu_seconds: float  # utime + stime
    rss_bytes: int
    threads: int
    open_fds: int | None  # None when /proc/PID/fd is unreadable
    max_fds_soft: int | None
    max_fds_hard: int | None


@dataclass(frozen=True)
class RankEntry(RankIdentity):
    """A claim that ``pid`` is rank ``rank`` of job ``job_id``: a rank file or /proc discovery."""

    job_id: str
    rank: int
    pid: int
    local_rank: int | None = None
    world_size: int | None = None
    gpus: tuple[str, ...] = ()
    heartbeat: str | None = None  # path whose mtime is the last progress
    start_ticks: int | None = None  # as written at registration; None: learnt at first sight
    source: str = "rankfile"  # "rankfile" | "environ"
    path: str = ""  # the rank file it came from ("" for discovery)
    # owner of the rank file, or the uid of a discovered process (trust: gpuwatchd/join/rank_claims.py)
    owner_uid: int | None = None
    env_flags: tuple[str, ...] = ()  # NCCL/TORCH variable *names* (never values) of interest
    # Containers (sources/pidns.py): the writer's PID namespace inode; once resolved ``pid`` is the
    # host PID and ``ns_pid`` the PID the container sees; ``container`` says which one (cgroup).
    pid_ns: int | None = None
    ns_pid: int | None = None
    container: str = ""
    # where ``heartbeat`` is resolved: the rank's own root (/proc/PID/root), "" = the daemon's view
    heartbeat_root: str | None = None


@dataclass(frozen=True)
class BadRankFile:
    path: str
    reason: str


def rank_alive(proc: ProcessInfo | None, expected_start_ticks: int | None) -> TypeGuard[ProcessInfo]:
    """The one rule for "is this rank alive": its process exists, is neither a zombie nor dead,
    and, when its start time is known (the rank file's, or the first one seen), is still the
    process that started then (not a reused PID). True says ``proc`` is a process (for mypy)."""
    return (
        proc is not None
        and proc.state not in ("Z", "X")
        and (expected_start_ticks is None or proc.start_ticks == expected_start_ticks)
    )


@dataclass(frozen=True)
class RankState(RankIdentity):
    job_id: str
    rank: int
    pid: int
    local_rank: int | None
    world_size: int | None
    alive: bool
    process: ProcessInfo | None  # None when dead
    tree: tuple[int, ...] = ()  # rank PID first, then its live descendants
    gpus: tuple[str, ...] = ()
    progress_timestamp: float | None = None
    stalled: bool = False
    died_at: float | None = None  # first cycle at which it was seen dead
    ns_pid: int | None = None  # the PID inside its container (None: the same as ``pid``)
    container: str = ""  # e.g. "Kubernetes pod UID", from the cgroup path (sources/containers.py)
    step: int | None = None  # the step of its last heartbeat(step), None when it sends none


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_ratio: float | None  # 0..1; None when the driver does not say
    # nvmlDeviceGetCurrentClocksEventReasons bit mask (why clocks are below maximum); None: unknown
    throttle_reasons: int | None = None
    # share of the last sample period in which device memory was read or written (NVML's
    # utilization.memory, read with utilization.gpu); None: unknown. The stall spin rules use it.
    memory_utilization_ratio: float | None = None


@dataclass(frozen=True)
class GpuProcess:
    """One process NVML lists on one GPU. ``used_memory_bytes`` None means N/A (MIG), never 0."""

    gpu_index: int
    uuid: str
    pid: int
    used_memory_bytes: int | None
    kind: str = "compute"  # compute | graphics


@dataclass(frozen=True)
class GpuProcessRow:
    """A ``GpuProcess`` joined with /proc and the rank trees (what the exporter shows)."""

    gpu_index: int
    uuid: str
    pid: int
    used_memory_bytes: int | None
    comm: str
    user: str
    job_id: str  # "" when the process belongs to no rank's tree
    rank: str  # "" likewise


@dataclass(frozen=True)
class Orphan:
    gpu_index: int
    uuid: str
    pid: int
    used_memory_bytes: int | None
    comm: str
    user: str
    reason: str  # reparented_to_init | job_ended | unregistered | defunct
    first_seen: float


@dataclass(frozen=True)
class Finding:
    """One active diagnosis. ``explanation`` is the one line a human reads (CLI, events, alerts)."""

    kind: str
    severity: str
    explanation: str
    job_id: str = ""
    rank: str = ""
    pid: str = ""
    evidence: Mapping[str, Any] = field(default_factory=frozen_map)
    since: float = 0.0

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.kind, self.job_id, self.rank, self.pid)


@dataclass(frozen=True)
class CollectorStatus:
    name: str
    success: bool
    duration_seconds: float
    last_success_timestamp: float | None
    error: str = ""


@dataclass(frozen=True)
class GilReading:
    """Result of one py-spy GIL sample of one rank (sources/pyspy.py)."""

    pid: int
    samples: int  # sampling ticks that counted (denominator)
    held: int  # ticks at which some thread held the GIL
    top_functions: tuple[tuple[str, int], ...] = ()
    timestamp: float = 0.0


# Counter names kept by the daemon's CounterStore (labels in this order).
COUNTER_LABELS: Mapping[str, tuple[str, ...]] = frozen_map(
    {
        "oom_kills": ("job_id", "rank", "comm", "killer"),
        "helper_oom_kills": ("helper", "killer"),
        "rank_exits": ("job_id", "rank", "cause"),
        "gpu_xid_errors": ("gpu", "uuid", "xid"),
        "cuda_oom_errors": ("job_id", "rank", "gpu"),
        "rank_gil_samples": ("job_id", "rank"),
        "rank_gil_held_samples": ("job_id", "rank"),
        "kernel_log_overruns": (),
        "kernel_log_lines_rejected": ("reason",),
        "web_connections_dropped": ("reason",),
        "state_write_errors": ("file",),
        "state_records_rejected": ("file", "reason"),
        "cycle_deferred_probes": ("probe",),
    }
)


@dataclass(frozen=True)
class TreeProcessMemory:
    """One process of a rank's tree: what it holds and what it gained over the tracker's window."""

    pid: int
    comm: str
    rss_bytes: int
    gained_bytes: int
    over_seconds: float
    worker: bool  # a descendant of the rank process, not the rank itself


@dataclass(frozen=True)
class RankMemory:
    """Host memory of one rank (memory_tracker.py): its memory cgroup's bounding level, its whole
    tree's RSS, and their growth over ``memory.window_seconds`` (None until measured long enough)."""

    job_id: str
    rank: int
    pid: int
    tree_rss_bytes: int
    tree_growth_bytes_per_second: float | None = None
    cgroup: str = ""  # path of the level whose limit bounds the rank ("" without memory cgroup)
    cgroup_version: int | None = None
    usage_bytes: int | None = None
    working_set_bytes: int | None = None  # usage minus inactive file cache (compared with limit)
    limit_bytes: int | None = None
    high_bytes: int | None = None
    cgroup_growth_bytes_per_second: float | None = None  # of the working set
    pressure_some_avg10: float | None = None  # 0..1 (PSI memory.pressure of the rank's cgroup)
    pressure_some_seconds: float | None = None  # PSI totals
    pressure_full_seconds: float | None = None
    top: tuple[TreeProcessMemory, ...] = ()  # the tree's largest holders and growers


@dataclass(frozen=True)
class NodeMemoryState:
    total_bytes: int
    available_bytes: int
    pressure_some_avg10: float | None = None
    pressure_some_seconds: float | None = None
    pressure_full_seconds: float | None = None


@dataclass(frozen=True)
class NodeState:
    timestamp: float
    ranks: tuple[RankState, ...] = ()
    gpus: tuple[GpuDevice, ...] = ()
    gpu_processes: tuple[GpuProcessRow, ...] = ()
    orphans: tuple[Orphan, ...] = ()
    findings: tuple[Finding, ...] = ()
    collectors: tuple[CollectorStatus, ...] = ()
    # counter name -> {label values tuple -> value}; see COUNTER_LABELS
    counters: Mapping[str, Mapping[tuple[str, ...], float]] = field(default_factory=frozen_map)
    cycle_seconds: float = 0.0
    rank_memory: tuple[RankMemory, ...] = ()  # memory_subsystem.py; () when off
    node_memory: NodeMemoryState | None = None
    collectives: tuple[CollectiveStatus, ...] = ()
    nccl_ras: tuple[RasRankStatus, ...] = ()  # live ranks of suspect jobs (join/nccl_ras.py)
    # the daemon's own /proc/self/oom_score_adj (None where unreadable): shows that the unit's
    # OOMScoreAdjust took effect
    oom_score_adj: int | None = None
    # the limit of the daemon's own memory cgroup (None: unlimited or unknown)
    memory_limit_bytes: int | None = None


# Who reported an Xid (join/xid_dedup.py counts one reported by both once).
SOURCE_NVML = "nvml"
SOURCE_KERNEL = "kernel"


# What the fd scan of a process found (sources/devfds.py; findings/fork_after_cuda.py words it)


@dataclass(frozen=True)
class ProcEvidence:
    pid: int
    ppid: int
    exe: str
    cmdline_digest: str
    nvidia_fds: tuple[tuple[int, str], ...]  # (fd number, device path), sorted

    @property
    def holds_cuda_device(self) -> bool:
        """Has the control device or the UVM device open: what a CUDA context keeps open."""
        return any(t.endswith(("/nvidiactl", "/nvidia-uvm")) for _, t in self.nvidia_fds)


# A GPU uevent (sources/udev.py reads them; findings/gpu_lost.py words a lost GPU)

LOST_ACTIONS = frozenset({"remove", "unbind"})  # uevent actions that take a GPU off the bus


@dataclass(frozen=True)
class GpuUevent:
    """What one GPU uevent said: ``lost`` for a remove/unbind (the GPU is off the bus)."""

    action: str
    pci_bus_id: str  # normalised "0000:3b:00"
    slot: str  # as the kernel names it, "0000:3b:00.0"
    driver: str
    timestamp: float

    @property
    def lost(self) -> bool:
        return self.action in LOST_ACTIONS


# A cgroup's CPU throttling counters (sources/cgroup_cpu.py reads them; join/straggler.py keeps a window)


@dataclass(frozen=True)
class CpuStat:
    periods: int
    throttled_periods: int
    throttled_seconds: float


# A process's cgroup (sources/memcg.py parses /proc/PID/cgroup; the daemon's process view carries it)


@dataclass(frozen=True)
class CgroupPaths:
    """Where one process lives: v1 memory controller path, v2 unified path, v1 cpu controller
    path ("" when absent)."""

    memory_v1: str
    unified: str
    cpu_v1: str = ""


@dataclass(frozen=True)
class Psi:
    """One PSI file: the share of the last 10 s stalled (0..1) and the totals (seconds)."""

    some_avg10: float
    full_avg10: float | None  # the "full" line is absent for the cpu file on old kernels
    some_total_seconds: float
    full_total_seconds: float | None


@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup level that bounds a rank (the least headroom on its path)."""

    version: int  # 1 | 2
    path: str  # as the kernel names it (/slurm/uid_0/job_7)
    usage_bytes: int
    working_set_bytes: int  # usage minus inactive file cache
    limit_bytes: int | None  # None: no limit on the whole path
    high_bytes: int | None = None  # v2 memory.high (throttling starts there), None when max
    pressure: Psi | None = None  # memory.pressure of the rank's own cgroup


@dataclass(frozen=True)
class NodeMemory:
    total_bytes: int
    available_bytes: int
    pressure: Psi | None


DEFUNCT = "defunct"


REPARENTED = "reparented_to_init"


JOB_ENDED = "job_ended"


UNREGISTERED = "unregistered"


REASONS = (DEFUNCT, REPARENTED, JOB_ENDED, UNREGISTERED)
