"""What a finding rule reads: ``FindingContext`` (one cycle's joined readings), and the helpers
rules share to name a rank. A leaf of ``findings/``: every rule imports this module, none imports
another rule or ``findings/__init__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.model import (
    BadRankFile,
    GpuDevice,
    GpuProcessRow,
    Orphan,
    ProcessInfo,
    RankState,
    frozen_map,
)
from gpuwatchd.units import fmt_bytes


@dataclass(frozen=True)
class FindingContext:
    now: float
    config: Config
    ranks: tuple[RankState, ...] = ()
    processes: Mapping[int, ProcessInfo] = field(default_factory=frozen_map)
    env_flags: Mapping[int, tuple[str, ...]] = field(default_factory=frozen_map)
    bad_files: tuple[BadRankFile, ...] = ()
    refused: tuple[BadRankFile, ...] = ()  # rank entries refused by the trust rules
    # (job_id, rank) -> open fds per second, measured over the rank's lifetime in this daemon
    fd_rates: Mapping[tuple[str, int], float] = field(default_factory=frozen_map)
    gpus: tuple[GpuDevice, ...] = ()
    gpu_processes: tuple[GpuProcessRow, ...] = ()
    orphans: tuple[Orphan, ...] = ()
    extras: Mapping[str, Any] = field(default_factory=frozen_map)


def rank_label(r: RankState) -> str:
    """"rank 0 of job llm (pid 48213 (1 in its container), Kubernetes pod 0b8d...)"."""
    pid = f"pid {r.pid}" + (f" ({r.ns_pid} in its container)" if r.ns_pid is not None else "")
    return f"rank {r.rank} of job {r.job_id} ({pid}{', ' + r.container if r.container else ''})"


__all__ = ["FindingContext", "fmt_bytes", "rank_label"]
