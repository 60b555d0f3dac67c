"""gil_saturated: a rank's Python threads hold the GIL nearly all the time while its GPU waits.

Input: the GIL readings of the last samples per rank (``ctx.parts.stall.gil``: (job_id, rank) ->
``GilReading``s, oldest first, from gpuwatchd/daemon/gil.py) and the GPU utilisation of the rank's GPUs
(those its rank file names and those its tree holds memory on: a discovered rank names none) when
NVML knows it. Fires when the held ratio of each of the last two samples is at least
``gil.held_threshold`` and no GPU of the rank is busy (utilisation known and >= 60 % means the GPU
is being fed, so a busy Python loop is not the bottleneck). The top GIL-holding functions go in
the explanation and the evidence, never in labels (unbounded cardinality).
Shell equivalent: ``py-spy top --gil --pid PID`` (needs a TTY) or
``py-spy record --gil --nonblocking -d 5 -f raw -o F -p PID; wc``; ``nvidia-smi -q -d UTILIZATION``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from gpuwatchd.findings.context import FindingContext, rank_finding, rank_label
from gpuwatchd.model import WARNING, Finding, GilReading, GpuDevice, GpuProcessRow, RankId, RankState
from gpuwatchd.model.gpus import rank_gpu_devices

GPU_BUSY_RATIO = 0.6
CONSECUTIVE = 2


def _ratio(r: GilReading) -> float:
    return r.held / r.samples if r.samples > 0 else 0.0


def rank_gpu_utilization(r: RankState, gpus: Sequence[GpuDevice], rows: Sequence[GpuProcessRow],
                         held: Mapping[tuple[str, str], Collection[int]] | None = None,
                         ) -> list[tuple[str, float]]:  # fmt: skip
    """(gpu index, utilisation) for the rank's GPUs (``model/gpus.py: rank_gpu_devices``: named in its
    rank file or held by its tree, ``rows``; ``held``: ``held_by_rank(rows)`` made once for many
    ranks) whose utilisation NVML reports."""
    return [
        (str(g.index), g.utilization_ratio)
        for g in rank_gpu_devices(r, gpus, rows, held)
        if g.utilization_ratio is not None
    ]


def top_holders(readings: Sequence[GilReading], n: int = 3) -> list[tuple[str, float]]:
    """Functions by share of GIL-held ticks over ``readings``."""
    counts: dict[str, int] = {}
    for r in readings:
        for fn, c in r.top_functions:
            counts[fn] = counts.get(fn, 0) + c
    held = sum(r.held for r in readings) or 1
    return [(fn, c / held) for fn, c in sorted(counts.items(), key=lambda kv: -kv[1])[:n]]


def find(ctx: FindingContext) -> Iterable[Finding]:
    readings: Mapping[RankId, Sequence[GilReading]] = ctx.parts.stall.gil
    threshold = ctx.config.gil.held_threshold
    for r in ctx.ranks:
        recent = list(readings.get(r.rank_id, ()))[-CONSECUTIVE:]
        if not r.alive or len(recent) < CONSECUTIVE or any(x.pid != r.pid for x in recent):
            continue
        ratios = [_ratio(x) for x in recent]
        if min(ratios) < threshold:
            continue
        utils = rank_gpu_utilization(r, ctx.parts.gpu.gpus, ctx.gpu_processes)
        if utils and max(u for _, u in utils) >= GPU_BUSY_RATIO:
            continue
        held = sum(x.held for x in recent) / max(sum(x.samples for x in recent), 1)
        gpu_text = (
            "while its GPU " + ", ".join(f"{i} was {u:.0%} busy" for i, u in utils)
            if utils
            else "(GPU utilisation unknown)"
        )
        tops = top_holders(recent)
        top_text = ", ".join(f"{fn} {share:.0%}" for fn, share in tops) or "unknown"
        yield rank_finding(
            r,
            kind="gil_saturated",
            severity=WARNING,
            explanation=(
                f"{rank_label(r)}: Python held the GIL {held:.0%} of the sampled time over the "
                f"last {len(recent)} samples ({', '.join(f'{x:.0%}' for x in ratios)}) {gpu_text}; "
                f"top GIL holders: {top_text}"
            ),
            evidence={
                "held_ratio": round(held, 3),
                "samples": sum(x.samples for x in recent),
                "gpu_utilization": dict(utils),
                "top_functions": [[fn, round(s, 3)] for fn, s in tops],
            },
        )
