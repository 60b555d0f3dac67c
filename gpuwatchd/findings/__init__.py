"""Diagnoses: pure functions from one cycle's joined readings to ``Finding`` objects.

One module per kind. Each exposes ``find(ctx) -> Iterable[Finding]`` and is listed in ``RULES``.
They never touch /proc, NVML or the clock: everything comes in through ``FindingContext``, which
is what lets the tests run them on recorded inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuwatchd.findings import (
    cuda_oom,
    fds,
    fork,
    gil,
    gpu_lost,
    job_crashed,
    memory,
    nccl_env,
    nccl_ras,
    oom,
    orphans,
    rank_down,
    rankfile,
    stall,
    straggler,
    xid,
)
from gpuwatchd.findings.context import FindingContext, rank_label
from gpuwatchd.model import Finding
from gpuwatchd.units import fmt_bytes

__all__ = ["RULES", "FindingContext", "evaluate", "fmt_bytes", "rank_label"]

Rule = Callable[[FindingContext], Iterable[Finding]]

RULES: list[Rule] = [rank_down.find, fds.find, nccl_env.find, rankfile.find, gil.find, stall.find,
                     oom.find, xid.find, gpu_lost.find, orphans.find, fork.find, memory.find,
                     cuda_oom.find, job_crashed.find, nccl_ras.find]
# Rules that also read the findings of RULES (rank_straggler names gil_saturated or
# rank_memory_pressure of the same rank as causes).
LateRule = Callable[[FindingContext, tuple[Finding, ...]], Iterable[Finding]]
LATE_RULES: list[LateRule] = [straggler.find]

def evaluate(ctx: FindingContext, rules: Iterable[Rule] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for rule in RULES if rules is None else rules:
        out.extend(rule(ctx))
    if rules is None:
        for late in LATE_RULES:
            out.extend(late(ctx, tuple(out)))
    return out
