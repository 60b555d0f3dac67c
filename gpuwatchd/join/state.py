"""The join: one cycle's readings -> an immutable ``NodeState``. Pure: no I/O, no clock.

Decides which claimed ranks are trusted and alive (PID-reuse guard by start time), builds each
rank's process tree, attributes GPU processes to ranks, measures fd growth, runs the finding rules
and keeps, in ``JoinMemory``, the little history those need (first start time seen per rank PID,
when a rank was first seen dead, the first fd sample, when each finding started).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd import findings
from gpuwatchd.config import Config
from gpuwatchd.findings.context import RuleReadings, readings_of
from gpuwatchd.join import rank_claims
from gpuwatchd.join.nccl_ras import counts_moving
from gpuwatchd.model import (
    BadRankFile,
    CgroupPaths,
    CollectorStatus,
    Finding,
    GpuDevice,
    GpuProcess,
    GpuProcessRow,
    NodeState,
    Orphan,
    ProcessInfo,
    RankEntry,
    RankId,
    RankProcess,
    RankState,
    frozen_map,
    rank_alive,
)
from gpuwatchd.model.collectives import CollectiveStatus


@dataclass(frozen=True)
class CycleInputs(RuleReadings):
    now: float
    config: Config
    entries: tuple[RankEntry, ...] = ()
    bad_files: tuple[BadRankFile, ...] = ()
    processes: Mapping[int, ProcessInfo] = field(default_factory=frozen_map)
    # rank PID -> its live descendants (DataLoader workers, compile workers, ...)
    descendants: Mapping[int, tuple[int, ...]] = field(default_factory=frozen_map)
    env_flags: Mapping[int, tuple[str, ...]] = field(default_factory=frozen_map)
    # rank PID -> its cgroup (the daemon's per-cycle process view: /proc/PID/cgroup re-read every
    # CGROUP_TTL seconds per process; the only producer): memory and OOM attribution read it
    cgroups: Mapping[int, CgroupPaths] = field(default_factory=frozen_map)
    gpus: tuple[GpuDevice, ...] = ()
    gpu_processes: tuple[GpuProcess, ...] = ()
    orphans: tuple[Orphan, ...] = ()
    # (job_id, rank) -> its heartbeat's mtime (the daemon's /proc reading, the only producer)
    heartbeats: Mapping[RankId, float] = field(default_factory=frozen_map)
    # (job_id, rank) -> last progress timestamp by the stall tracker (heartbeat or observed
    # change; the stall subsystem, the only producer; a rank it did not judge: its heartbeat);
    # (job_id, rank) -> stalled
    progress: Mapping[RankId, float] = field(default_factory=frozen_map)
    stalled: Mapping[RankId, bool] = field(default_factory=frozen_map)
    collectors: tuple[CollectorStatus, ...] = ()
    counters: Mapping[str, Mapping[tuple[str, ...], float]] = field(default_factory=frozen_map)
    cycle_seconds: float = 0.0
    # (job_id, rank) -> step of the last heartbeat(step); flight-recorder state per rank and group
    steps: Mapping[RankId, int] = field(default_factory=frozen_map)
    collectives: tuple[CollectiveStatus, ...] = ()
    # The claims decided before the subsystems ran (``rank_claims.decide``): ``entries`` are then
    # its accepted ones, every (job_id, rank) reading above is of the accepted pid, and the join
    # does not decide again. None (tests that build inputs by hand): the join decides.
    claims: rank_claims.Claims | None = None


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
    entries: tuple[RankEntry, ...], processes: Mapping[int, ProcessInfo],
    job_owners: Mapping[str, int] | None = None,
) -> tuple[list[RankEntry], list[BadRankFile]]:
    """Apply the trust rules and resolve duplicates (``gpuwatchd.join.rank_claims``)."""
    accepted, refused, _owners = rank_claims.select(entries, processes, job_owners)
    return accepted, refused


def build_state(inputs: CycleInputs, memory: JoinMemory | None = None) -> tuple[NodeState, JoinMemory]:
    memory = memory or JoinMemory()
    now = inputs.now
    claims = inputs.claims or rank_claims.decide(inputs.entries, inputs.processes,
                                                 memory.job_owners, memory.claimant_uids,
                                                 memory.start_ticks)
    entries, refused = claims.accepted, claims.refused
    job_owners, claimant_uids = claims.job_owners, claims.claimant_uids

    start_ticks: dict[RankProcess, int] = {}
    died_at: dict[RankProcess, float] = {}
    fd_first: dict[RankProcess, tuple[float, int]] = {}
    fd_rates: dict[RankId, float] = {}
    ranks: list[RankState] = []
    pid_owner: dict[int, RankId] = {}

    for e in sorted(entries, key=lambda e: (e.job_id, e.rank)):
        rid, key = e.rank_id, e.rank_process  # once per rank (the loop below is per process)
        proc = inputs.processes.get(e.pid)
        expected = e.start_ticks if e.start_ticks is not None else memory.start_ticks.get(key)
        alive = rank_alive(proc, expected)
        if alive and proc is not None:
            start_ticks[key] = proc.start_ticks
        elif expected is not None:
            start_ticks[key] = expected
        if not alive:
            died_at[key] = memory.died_at.get(key, now)
        tree: tuple[int, ...] = ()
        if alive and proc is not None:
            tree = (e.pid, *inputs.descendants.get(e.pid, ()))
            for pid in tree:
                pid_owner.setdefault(pid, rid)
            if proc.open_fds is not None:
                first = memory.fd_first.get(key)
                if first is None or proc.open_fds < first[1]:
                    first = (now, proc.open_fds)
                fd_first[key] = first
                elapsed = now - first[0]
                if elapsed >= max(inputs.config.fds.min_window_seconds, 1e-3) and proc.open_fds > first[1]:
                    fd_rates[rid] = (proc.open_fds - first[1]) / elapsed
        ranks.append(RankState(
            job_id=e.job_id, rank=e.rank, pid=e.pid, local_rank=e.local_rank,
            world_size=e.world_size, alive=alive, process=proc if alive else None, tree=tree,
            gpus=e.gpus, progress_timestamp=inputs.progress.get(
                rid, inputs.heartbeats.get(rid)),
            stalled=bool(inputs.stalled.get(rid, False)) and alive and not counts_moving(
                inputs.nccl_ras.get(e.job_id), e.pid, now, inputs.config.stall.nccl_ras_interval_seconds),
            died_at=died_at.get(key), ns_pid=e.ns_pid, container=e.container,
            step=inputs.steps.get(rid) if alive else None,
        ))

    rows: list[GpuProcessRow] = []
    for gp in inputs.gpu_processes:
        proc = inputs.processes.get(gp.pid)
        owner = pid_owner.get(gp.pid)
        rows.append(GpuProcessRow(
            gpu_index=gp.gpu_index, uuid=gp.uuid, pid=gp.pid,
            used_memory_bytes=gp.used_memory_bytes,
            comm=proc.comm if proc else "", user=proc.user if proc else "",
            job_id=owner[0] if owner else "", rank=str(owner[1]) if owner else "",
        ))

    ctx = findings.FindingContext(
        now=now, config=inputs.config, ranks=tuple(ranks), processes=inputs.processes,
        env_flags=inputs.env_flags, bad_files=inputs.bad_files, refused=tuple(refused),
        fd_rates=fd_rates, gpus=inputs.gpus, gpu_processes=tuple(rows), orphans=inputs.orphans,
        **readings_of(inputs),
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
        timestamp=now, ranks=tuple(ranks), gpus=inputs.gpus, gpu_processes=tuple(rows),
        orphans=inputs.orphans, findings=tuple(stamped), collectors=inputs.collectors,
        counters=inputs.counters, cycle_seconds=inputs.cycle_seconds,
        rank_memory=tuple(m for m in inputs.rank_memory if RankProcess(m.job_id, m.rank, m.pid) in live),
        node_memory=inputs.node_memory,
        collectives=tuple(c for c in inputs.collectives
                          if any(r.alive and r.rank_process == RankProcess(c.job_id, c.rank, c.pid)
                                 for r in ranks)),
        nccl_ras=tuple(s for job in inputs.nccl_ras.values() for s in job.local
                       if any(r.alive and r.rank_process == RankProcess(s.job_id, s.rank, s.pid)
                              for r in ranks)),
    )
    return state, JoinMemory(
        start_ticks=start_ticks, died_at=died_at, fd_first=fd_first, finding_since=since,
        job_owners=job_owners, claimant_uids=claimant_uids,
    )
