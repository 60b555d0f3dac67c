"""What a finding rule reads: ``FindingContext`` (one cycle's joined readings), and the helpers
rules share to name a rank. A leaf of ``findings/``: every rule imports this module, none imports
another rule or ``findings/__init__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.config.schema import Config
from gpuwatchd.join.flight_recorder import compare
from gpuwatchd.model import (
    BadRankFile,
    Finding,
    GpuProcessRow,
    ProcessInfo,
    RankId,
    RankState,
    frozen_map,
)
from gpuwatchd.model.gpus import is_rank_gpu
from gpuwatchd.model.parts import Tracked

# a peer of a death started at least this long before it (start ticks are 10 ms; the death's time
# is when the exit watcher read it, a few ms after; a launcher's restart comes after the teardown)
PEER_SLACK_SECONDS = 0.05


@dataclass(frozen=True)
class FindingContext:
    """One cycle as the rules read it: the join's own products (the ranks with their liveness and
    trees, the GPU processes joined to them, fd growth, the refused claims) and every part's
    output as the part returned it (``parts``: model/parts.py ``Tracked``, e.g.
    ``ctx.parts.gpu.gpus_lost``, ``ctx.parts.stall.verdicts``). Typed fields: a misspelt name is
    a mypy error, not a finding that silently never appears."""

    now: float
    config: Config
    ranks: tuple[RankState, ...] = ()
    processes: Mapping[int, ProcessInfo] = field(default_factory=frozen_map)  # rank trees + GPU PIDs
    env_flags: Mapping[int, tuple[str, ...]] = field(default_factory=frozen_map)
    bad_files: tuple[BadRankFile, ...] = ()
    refused: tuple[BadRankFile, ...] = ()  # rank entries refused by the trust rules
    # (job_id, rank) -> open fds per second, measured over the rank's lifetime in this daemon
    fd_rates: Mapping[RankId, float] = field(default_factory=frozen_map)
    gpu_processes: tuple[GpuProcessRow, ...] = ()  # the NVML holders joined to the rank trees
    parts: Tracked = field(default_factory=Tracked)


def collective_words(ctx: FindingContext, job_id: str) -> list[str]:
    """The flight-recorder answers of ``job_id``'s stalled ranks compared, in words: which rank
    is behind in which collective (join/flight_recorder.py ``compare``), after NCCL RAS's culprit
    when it names one (join/nccl_ras.py); [] without answers."""
    ras = ctx.parts.ras.jobs.get(job_id)
    first = [ras.statement] if ras is not None and ras.statement else []
    return first + compare(x for k, x in ctx.parts.flight.records.items() if k[0] == job_id)


def rank_label(r: RankState) -> str:
    """ "rank 0 of job llm (pid 48213 (1 in its container), Kubernetes pod 0b8d...)"."""
    pid = f"pid {r.pid}" + (f" ({r.ns_pid} in its container)" if r.ns_pid is not None else "")
    return f"rank {r.rank} of job {r.job_id} ({pid}{', ' + r.container if r.container else ''})"


def rank_finding(
    r: RankState,
    kind: str,
    severity: str,
    explanation: str,
    evidence: Mapping[str, Any] | None = None,
    since: float = 0.0,
) -> Finding:
    """A finding about one rank: its job, rank and pid as the finding's identity."""
    return Finding(
        kind=kind,
        severity=severity,
        explanation=explanation,
        job_id=r.job_id,
        rank=str(r.rank),
        pid=str(r.pid),
        evidence=frozen_map() if evidence is None else evidence,
        since=since,
    )


def ranks_gpu_memory(ctx: FindingContext) -> dict[tuple[str, str], dict[str, int]]:
    """(job, rank) -> gpu index -> bytes its tree holds there: ``rank_gpus``'s ``held`` for every
    rank at once (a rule that asks for many ranks reads the process list once)."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for p in ctx.gpu_processes:
        if p.job_id and p.used_memory_bytes is not None:  # ("": no rank's tree)
            held = out.setdefault((p.job_id, p.rank), {})
            held[str(p.gpu_index)] = held.get(str(p.gpu_index), 0) + p.used_memory_bytes
    return out


def rank_gpus(r: RankState, ctx: FindingContext,
              memory: Mapping[tuple[str, str], Mapping[str, int]] | None = None,
              ) -> list[tuple[str, float | None, int | None]]:  # fmt: skip
    """(gpu index, utilisation or None, bytes held by the rank's tree or None) per GPU of the
    rank (``model/gpus.py: is_rank_gpu``): those named in its rank file and those its processes
    hold memory on (``memory``: ``ranks_gpu_memory(ctx)``, made once by a caller that asks for
    many ranks)."""
    if memory is None:
        memory = ranks_gpu_memory(ctx)
    held = memory.get((r.job_id, str(r.rank)), {})
    indices = {int(i) for i in held}
    return [
        (str(g.index), g.utilization_ratio, held.get(str(g.index)))
        for g in ctx.parts.gpu.gpus
        if is_rank_gpu(g, r.gpus, indices)
    ]


__all__ = [
    "FindingContext",
    "collective_words",
    "rank_finding",
    "rank_gpus",
    "rank_label",
    "ranks_gpu_memory",
]


def live_peers(ctx: FindingContext, job_id: str, pid: int, died: float | None = None) -> int:
    """The ranks of the job alive now that were already running at ``died`` (a death): a rank
    started after it is the launcher's restart of the job (torchrun --max-restarts ends every
    rank and starts new ones within seconds), waiting for nobody. A start is the exit part's
    boot clock on the process's start ticks, to the tick: a peer started ``PEER_SLACK_SECONDS``
    before the death, even within its second, is one. Where that part is off, only /proc's start
    time is known, on /proc/stat's whole-second ``btime``, up to a second early: a peer is then
    one that started at least a second before the death."""
    exits = ctx.parts.exits

    def before(p: ProcessInfo | None) -> bool:
        if died is None or p is None:
            return True
        if exits.started is None:
            return p.start_time <= died - 1.0
        return exits.started(p.start_ticks) <= died - PEER_SLACK_SECONDS

    return sum(1 for p in ctx.ranks if p.job_id == job_id and p.alive and p.pid != pid and before(p.process))
