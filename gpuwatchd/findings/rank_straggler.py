"""rank_straggler: a rank slower than its job's median, with the causes gpuwatchd can see.

Input: ``ctx.parts.straggler.rates`` ((job_id, rank) -> ``straggler.RankRate``: step rate over
``straggler.window_seconds``, the job's median on this node, how long it has been below
``straggler.ratio`` times it, its cgroup's CPU throttling over the window), the GIL readings
(``ctx.parts.stall.gil``), the rank's GPUs (NVML throttle reasons), its process tree and the
findings of the other rules (a late rule: ``gil_saturated`` and, where the memory helper
provides it, ``rank_memory_pressure`` of the same rank are named as causes by kind).
Shell equivalent: compare ``cat JOB.RANK.hb`` over time across ranks; ``cat .../cpu.stat``;
``nvidia-smi -q -d PERFORMANCE``; ``py-spy top --gil``.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext, rank_finding, rank_gpus, rank_label
from gpuwatchd.model import SLOWING_REASONS, THROTTLE_REASONS, WARNING, Finding, RankState

THROTTLED_SHARE = 0.1  # throttled in at least 10 % of the CFS periods of the window


def causes(r: RankState, ctx: FindingContext, found: tuple[Finding, ...]) -> list[str]:
    rr = ctx.parts.straggler.rates[r.rank_id]
    out = []
    mine = {f.kind: f for f in found if f.job_id == r.job_id and f.rank == str(r.rank)}
    gil = list(ctx.parts.stall.gil.get(r.rank_id, ()))
    if "gil_saturated" in mine:
        out.append("GIL saturated (gil_saturated)")
    elif (
        gil
        and gil[-1].pid == r.pid
        and gil[-1].samples
        and gil[-1].held / gil[-1].samples >= ctx.config.gil.held_threshold
    ):
        out.append(f"GIL held {gil[-1].held / gil[-1].samples:.0%} of the last sample")
    if rr.periods and rr.throttled_periods >= max(1, THROTTLED_SHARE * rr.periods):
        out.append(
            f"CPU throttled by its cgroup: {rr.throttled_periods} of {rr.periods} CFS "
            f"periods, {rr.throttled_seconds:.1f} s throttled in {rr.window_seconds:.0f} s "
            "(cpu.stat)"
        )
    for index, _, _ in rank_gpus(r, ctx):
        g = next(d for d in ctx.parts.gpu.gpus if str(d.index) == index)
        if g.throttle_reasons:
            slow = [n for n in SLOWING_REASONS if g.throttle_reasons & THROTTLE_REASONS[n]]
            if slow:
                out.append(f"GPU {index} clocks throttled: {', '.join(slow)} (NVML)")
    if "rank_memory_pressure" in mine:
        out.append("host memory pressure (rank_memory_pressure)")
    workers = [ctx.processes[p] for p in r.tree[1:] if p in ctx.processes]
    blocked = [p for p in workers if p.state in ("D", "T", "t")]
    if blocked:
        out.append(
            f"{len(blocked)} of {len(workers)} worker process(es) blocked: "
            + ", ".join(
                f"pid {p.pid} {'in D (uninterruptible I/O)' if p.state == 'D' else 'stopped'}" for p in blocked[:4]
            )
        )
    return out


def find(ctx: FindingContext, found: tuple[Finding, ...] = ()) -> Iterable[Finding]:
    rates = ctx.parts.straggler.rates
    for r in ctx.ranks:
        rr = rates.get(r.rank_id)
        if rr is None or not r.alive or rr.pid != r.pid or not rr.straggler or r.stalled:
            continue
        assert rr.rate is not None and rr.median is not None
        why = causes(r, ctx, found)
        because = (
            "; ".join(why)
            if why
            else ("no cause visible to gpuwatchd (look at its input pipeline, network, or the GPU itself)")
        )
        yield rank_finding(
            r,
            kind="rank_straggler",
            severity=WARNING,
            explanation=(
                f"{rank_label(r)} is a straggler: {rr.rate:.2f} steps/s over the last "
                f"{rr.window_seconds:.0f} s, {rr.rate / rr.median:.2f}x its job's median of "
                f"{rr.median:.2f} steps/s on this node (ranks {', '.join(map(str, rr.peers))}), "
                f"below {ctx.config.straggler.ratio:g}x for {ctx.now - (rr.below_since or ctx.now):.0f} s; "
                f"causes: {because}"
            ),
            evidence={
                "rate": round(rr.rate, 4),
                "median": round(rr.median, 4),
                "ratio": round(rr.rate / rr.median, 3) if rr.median else None,
                "peers": list(rr.peers),
                "causes": why,
                "throttled_periods": rr.throttled_periods,
                "periods": rr.periods,
            },
        )
