"""Diagnoses: pure functions from one cycle's joined readings to ``Finding`` objects.

One module per kind, named as the kind (``stall`` and ``nccl_env`` raise several). Each exposes
``find(ctx) -> Iterable[Finding]`` and is listed in ``RULES``. They never touch /proc, NVML or
the clock: everything comes in through ``FindingContext``, which is what lets the tests run them
on recorded inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuwatchd.findings import (
    bad_rank_file,
    cuda_oom,
    fd_exhaustion,
    fork_after_cuda,
    gil_saturated,
    gpu_lost,
    job_crashed,
    nccl_env,
    nccl_rank_missing,
    orphan_gpu_memory,
    rank_down,
    rank_memory_pressure,
    rank_oom_killed,
    rank_straggler,
    stall,
    xid_critical,
)
from gpuwatchd.findings.context import FindingContext, rank_label
from gpuwatchd.model import Finding
from gpuwatchd.units import fmt_bytes

__all__ = ["RULES", "FindingContext", "evaluate", "fmt_bytes", "rank_label"]

Rule = Callable[[FindingContext], Iterable[Finding]]

RULES: list[Rule] = [rank_down.find, fd_exhaustion.find, nccl_env.find, bad_rank_file.find,
                     gil_saturated.find, stall.find, rank_oom_killed.find, xid_critical.find,
                     gpu_lost.find, orphan_gpu_memory.find, fork_after_cuda.find,
                     rank_memory_pressure.find, cuda_oom.find, job_crashed.find,
                     nccl_rank_missing.find]
# Rules that also read the findings of RULES (rank_straggler names gil_saturated or
# rank_memory_pressure of the same rank as causes).
LateRule = Callable[[FindingContext, tuple[Finding, ...]], Iterable[Finding]]
LATE_RULES: list[LateRule] = [rank_straggler.find]

def evaluate(ctx: FindingContext, rules: Iterable[Rule] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for rule in RULES if rules is None else rules:
        out.extend(rule(ctx))
    if rules is None:
        for late in LATE_RULES:
            out.extend(late(ctx, tuple(out)))
    return out
