"""The join: one cycle's readings -> an immutable ``NodeState``. Pure: no I/O, no clock.

Given the claims decided before the parts ran, decides which accepted ranks are alive (PID-reuse
guard by start time), builds each rank's process tree, attributes GPU processes to ranks,
measures fd growth, runs the finding rules (handing them every part's output as the part
returned it) and keeps, in ``JoinMemory``, the little history those need (first start time seen
per rank PID, when a rank was first seen dead, the first fd sample, when each finding started).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd import findings
from gpuwatchd.config.schema import Config
from gpuwatchd.join import rank_claims
from gpuwatchd.join.nccl_ras import counts_moving
from gpuwatchd.join.orphans import RankTrees
from gpuwatchd.model import (
    BadRankFile,
    CollectorStatus,
    Finding,
    GpuProcessRow,
    NodeState,
    ProcessInfo,
    RankEntry,
    RankId,
    RankProcess,
    RankState,
    frozen_map,
)
from gpuwatchd.model.parts import Tracked


@dataclass(frozen=True)
class JoinMemory:
    start_ticks: Mapping[RankProcess, int] = field(default_factory=frozen_map)
    died_at: Mapping[RankProcess, float] = field(default_factory=frozen_map)
    fd_first: Mapping[RankProcess, tuple[float, int]] = field(default_factory=frozen_map)
    finding_since: Mapping[tuple[str, str, str, str], float] = field(default_factory=frozen_map)
    # job_id -> uid that owns it (first trusted claim keeps it), for jobs that still have ranks
    job_owners: Mapping[str, int] = field(default_factory=frozen_map)
    # (pid, start ticks) of each discovered claim -> its process's uid when last seen alive
    claimant_uids: Mapping[rank_claims.ClaimantKey, int] = field(default_factory=frozen_map)


def select_entries(
    entries: tuple[RankEntry, ...],
    processes: Mapping[int, ProcessInfo],
    job_owners: Mapping[str, int] | None = None,
) -> tuple[list[RankEntry], list[BadRankFile]]:
    """Apply the trust rules and resolve duplicates (``gpuwatchd.join.rank_claims``)."""
    accepted, refused, _owners = rank_claims.select(entries, processes, job_owners)
    return accepted, refused


def build_state(
    now: float,
    config: Config,
    claims: rank_claims.Claims,
    trees: RankTrees,
    parts: Tracked,
    memory: JoinMemory,
    *,
    processes: Mapping[int, ProcessInfo] = frozen_map(),
    descendants: Mapping[int, tuple[int, ...]] = frozen_map(),
    env_flags: Mapping[int, tuple[str, ...]] = frozen_map(),
    bad_files: tuple[BadRankFile, ...] = (),
    heartbeats: Mapping[RankId, float] = frozen_map(),
    collectors: tuple[CollectorStatus, ...] = (),
    counters: Mapping[str, Mapping[tuple[str, ...], float]] = frozen_map(),
) -> tuple[NodeState, JoinMemory]:
    """The cycle joined: ``claims`` decided before the parts ran (``rank_claims.decide``; every
    reading is of an accepted pid), ``trees`` each accepted rank's liveness and tree, computed
    once for the cycle before the parts ran (join/orphans.py ``trees_from_entries``), ``parts``
    the track stage's outputs as the parts returned them, and the daemon's own reading of the
    rank trees (``processes``: each tree's /proc, ``descendants``, ``env_flags``;
    ``heartbeats``: each accepted rank's heartbeat mtime), the rank files refused while read
    (``bad_files``), the collectors' statuses and the counters."""
    gpu = parts.gpu
    # the rank trees' processes and the GPU processes outside them (the NVML part's reading)
    processes = {**processes, **gpu.other_processes} if gpu.other_processes else processes
    stall = parts.stall
    entries, refused = claims.accepted, claims.refused
    job_owners, claimant_uids = claims.job_owners, claims.claimant_uids

    start_ticks: dict[RankProcess, int] = {}
    died_at: dict[RankProcess, float] = {}
    fd_first: dict[RankProcess, tuple[float, int]] = {}
    fd_rates: dict[RankId, float] = {}
    ranks: list[RankState] = []
    pid_owner = trees.owner

    for e in sorted(entries, key=lambda e: (e.job_id, e.rank)):
        rid, key = e.rank_id, e.rank_process  # once per rank (the loop below is per process)
        proc = processes.get(e.pid)
        expected = e.start_ticks if e.start_ticks is not None else memory.start_ticks.get(key)
        alive = key in trees.alive
        if alive and proc is not None:
            start_ticks[key] = proc.start_ticks
        elif expected is not None:
            start_ticks[key] = expected
        if not alive:
            died_at[key] = memory.died_at.get(key, now)
        tree: tuple[int, ...] = ()
        if alive and proc is not None:
            tree = (e.pid, *descendants.get(e.pid, ()))
            if proc.open_fds is not None:
                first = memory.fd_first.get(key)
                if first is None or proc.open_fds < first[1]:
                    first = (now, proc.open_fds)
                fd_first[key] = first
                elapsed = now - first[0]
                if elapsed >= max(config.fds.min_window_seconds, 1e-3) and proc.open_fds > first[1]:
                    fd_rates[rid] = (proc.open_fds - first[1]) / elapsed
        ranks.append(
            RankState(
                job_id=e.job_id,
                rank=e.rank,
                pid=e.pid,
                local_rank=e.local_rank,
                world_size=e.world_size,
                alive=alive,
                process=proc if alive else None,
                tree=tree,
                gpus=e.gpus,
                progress_timestamp=stall.progress.get(rid, heartbeats.get(rid)),
                stalled=bool(stall.stalled.get(rid, False))
                and alive
                and not counts_moving(parts.ras.jobs.get(e.job_id), e.pid, now, config.stall.nccl_ras_interval_seconds),
                died_at=died_at.get(key),
                ns_pid=e.ns_pid,
                container=e.container,
                step=parts.straggler.steps.get(rid) if alive else None,
            )
        )

    rows: list[GpuProcessRow] = []
    for gp in gpu.holders:
        proc = processes.get(gp.pid)
        owner = pid_owner.get(gp.pid)
        rows.append(
            GpuProcessRow(
                gpu_index=gp.gpu_index,
                uuid=gp.uuid,
                pid=gp.pid,
                used_memory_bytes=gp.used_memory_bytes,
                comm=proc.comm if proc else "",
                user=proc.user if proc else "",
                job_id=owner[0] if owner else "",
                rank=str(owner[1]) if owner else "",
            )
        )

    ctx = findings.FindingContext(
        now=now,
        config=config,
        ranks=tuple(ranks),
        processes=processes,
        env_flags=env_flags,
        bad_files=bad_files,
        refused=tuple(refused),
        fd_rates=fd_rates,
        gpu_processes=tuple(rows),
        parts=parts,
    )
    found = findings.evaluate(ctx)
    since: dict[tuple[str, str, str, str], float] = {}
    stamped: list[Finding] = []
    for f in found:
        start = memory.finding_since.get(f.key, f.since or now)
        since.setdefault(f.key, start)
        stamped.append(replace(f, since=since[f.key]))

    live = {r.rank_process for r in ranks if r.alive}  # host memory: accepted ranks only
    state = NodeState(
        timestamp=now,
        ranks=tuple(ranks),
        gpus=gpu.gpus,
        gpu_processes=tuple(rows),
        orphans=gpu.orphans,
        findings=tuple(stamped),
        collectors=collectors,
        counters=counters,
        rank_memory=tuple(m for m in parts.memory.rank_memory if RankProcess(m.job_id, m.rank, m.pid) in live),
        node_memory=parts.memory.node,
        collectives=tuple(
            c
            for c in parts.flight.collectives
            if any(r.alive and r.rank_process == RankProcess(c.job_id, c.rank, c.pid) for r in ranks)
        ),
        nccl_ras=tuple(
            s
            for job in parts.ras.jobs.values()
            for s in job.local
            if any(r.alive and r.rank_process == RankProcess(s.job_id, s.rank, s.pid) for r in ranks)
        ),
    )
    return state, JoinMemory(
        start_ticks=start_ticks,
        died_at=died_at,
        fd_first=fd_first,
        finding_since=since,
        job_owners=job_owners,
        claimant_uids=claimant_uids,
    )
