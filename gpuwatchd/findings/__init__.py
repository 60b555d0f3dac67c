"""Diagnoses: pure functions from one cycle's joined readings to ``Finding`` objects.

One module per kind. Each exposes ``find(ctx) -> Iterable[Finding]`` and is listed in ``RULES``.
They never touch /proc, NVML or the clock: everything comes in through ``FindingContext``, which
is what lets the tests run them on recorded inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.model import (
    BadRankFile,
    Finding,
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


__all__ = ["FindingContext", "evaluate", "fmt_bytes", "rank_label"]

Rule = Callable[[FindingContext], Iterable[Finding]]


def _rules() -> list[Rule]:
    from gpuwatchd.findings import (
        fds,
        fork,
        gil,
        memory,
        nccl_env,
        oom,
        orphans,
        rank_down,
        rankfile,
        stall,
        xid,
    )

    return [rank_down.find, fds.find, nccl_env.find, rankfile.find, gil.find, stall.find,
            oom.find, xid.find, orphans.find, fork.find, memory.find]


RULES: list[Rule] = _rules()
# Rules that also read the findings of RULES (rank_straggler names gil_saturated or
# rank_memory_pressure of the same rank as causes).
LateRule = Callable[[FindingContext, tuple[Finding, ...]], Iterable[Finding]]


def _late_rules() -> list[LateRule]:
    from gpuwatchd.findings import straggler

    return [straggler.find]


LATE_RULES: list[LateRule] = _late_rules()


def evaluate(ctx: FindingContext, rules: Iterable[Rule] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for rule in RULES if rules is None else rules:
        out.extend(rule(ctx))
    if rules is None:
        for late in LATE_RULES:
            out.extend(late(ctx, tuple(out)))
    return out
