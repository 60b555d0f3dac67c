"""CUDA out-of-memory events: rank/cuda_oom.py writes them, sources/cuda_oom_events.py reads them
(``OomEvent``), join/cuda_oom.py attributes them (``AttributedOom``, with the ``CoTenant``s that
held memory on the GPU then) and findings/cuda_oom.py words them."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.model import RankProcess


@dataclass(frozen=True)
class OomEvent:
    job_id: str
    rank: int
    pid: int
    timestamp: float
    device_uuid: str
    requested_bytes: int | None
    co_tenants: tuple[tuple[int, int | None], ...] | None  # (pid, bytes) at the moment, if known
    path: str = ""
    owner_uid: int | None = None  # of the event file (None: not read from a file)


@dataclass(frozen=True)
class CoTenant:
    """Another process that held memory on the GPU at the moment of the error, as the daemon knew
    it then: its job and rank if a rank's tree holds it, else why it is an orphan ("" if none)."""

    pid: int
    used_memory_bytes: int | None
    comm: str = ""
    job_id: str = ""
    rank: str = ""
    orphan_reason: str = ""


@dataclass(frozen=True)
class AttributedOom:
    """One CUDA OOM event attributed at the cycle that read it: ``event.pid`` is the host PID
    (``ns_pid`` the PID the rank wrote from inside its container, if different), ``gpu`` the
    NVML index of ``event.device_uuid`` ("" if unknown), ``co_tenants`` every process that held
    memory there (the rank's snapshot, else the daemon's latest reading), the rank itself
    included. What the ``cuda_oom`` rule (findings/cuda_oom.py) reads."""

    event: OomEvent
    gpu: str = ""
    ns_pid: int | None = None
    co_tenants: tuple[CoTenant, ...] = ()

    @property
    def since(self) -> float:
        return self.event.timestamp

    @property
    def key(self) -> RankProcess:
        return RankProcess(self.event.job_id, self.event.rank, self.event.pid)
