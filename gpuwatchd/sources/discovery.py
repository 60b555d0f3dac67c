"""Rank discovery from launcher variables in ``/proc/PID/environ`` (torchrun, Slurm, Open MPI).

Lists /proc and reads ``environ`` of each process: it runs at ``discovery.interval_seconds``, not
every cycle. It needs CAP_SYS_PTRACE/CAP_DAC_READ_SEARCH for other users' processes. The PIDs are
the host's (the daemon runs in the host PID namespace), so processes in containers are found too.
Shell equivalent:
``tr '\\0' '\\n' < /proc/PID/environ | grep -E '^(RANK|LOCAL_RANK|SLURM_PROCID|OMPI_COMM_WORLD_RANK)='``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from gpuwatchd.model import RankEntry
from gpuwatchd.sources.procfs import ProcessGone, ProcfsReader

DISCOVERY_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE",
)


def _maybe_int(s: str | None) -> int | None:
    if s is None:
        return None
    s = s.strip()
    return int(s) if s.isdigit() and len(s) < 9 else None


def _safe_job_id(s: str) -> str | None:
    s = re.sub(r"[^A-Za-z0-9._:@-]", "_", s.strip())[:128]
    return s or None


def claim_from_env(env: Mapping[str, str], launchers: Iterable[str]) -> tuple[str, int, int | None, int | None] | None:
    """(job_id, rank, local_rank, world_size) that a launcher's variables say, or None.

    torchrun wins over Slurm (``srun torchrun`` gives every worker both; SLURM_PROCID is then the
    agent's task, RANK the worker's), Slurm over Open MPI.
    """
    enabled = set(launchers)
    slurm_job = env.get("SLURM_JOB_ID")
    if "torchrun" in enabled and "TORCHELASTIC_RUN_ID" in env and _maybe_int(env.get("RANK")) is not None:
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        job = run_id if run_id and run_id != "none" else (slurm_job or "torchrun")
        job_id = _safe_job_id(job)
        rank = _maybe_int(env.get("RANK"))
        if job_id and rank is not None:
            return job_id, rank, _maybe_int(env.get("LOCAL_RANK")), _maybe_int(env.get("WORLD_SIZE"))
    if "slurm" in enabled and slurm_job and _maybe_int(env.get("SLURM_PROCID")) is not None:
        step = env.get("SLURM_STEP_ID")
        job_id = _safe_job_id(f"{slurm_job}.{step}" if step else slurm_job)
        rank = _maybe_int(env.get("SLURM_PROCID"))
        if job_id and rank is not None:
            return (job_id, rank, _maybe_int(env.get("SLURM_LOCALID")),
                    _maybe_int(env.get("SLURM_NTASKS")))
    if "openmpi" in enabled and _maybe_int(env.get("OMPI_COMM_WORLD_RANK")) is not None:
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or "openmpi"
        job_id = _safe_job_id(job)
        rank = _maybe_int(env.get("OMPI_COMM_WORLD_RANK"))
        if job_id and rank is not None:
            return (job_id, rank, _maybe_int(env.get("OMPI_COMM_WORLD_LOCAL_RANK")),
                    _maybe_int(env.get("OMPI_COMM_WORLD_SIZE")))
    return None


def discover(procfs: ProcfsReader, launchers: Iterable[str]) -> list[RankEntry]:
    """Ranks found from launcher variables. Children inherit their rank's environment (DataLoader
    workers), so of the processes that claim one (job, rank) the one whose parent does not claim it
    is the rank."""
    launchers = tuple(launchers)
    claims: dict[int, tuple[str, int, int | None, int | None]] = {}
    parents: dict[int, int] = {}
    uids: dict[int, int] = {}  # the claimant of a discovered rank is its process's uid
    for pid in procfs.pids():
        env = procfs.environ(pid, DISCOVERY_VARS)
        if not env:
            continue
        claim = claim_from_env(env, launchers)
        if claim is None:
            continue
        try:
            parents[pid] = int(procfs.read_stat(pid)[1][1])
            uids[pid] = os.stat(procfs.paths.proc(pid)).st_uid
        except (ValueError, IndexError, ProcessGone, OSError):
            continue
        claims[pid] = claim
    out: list[RankEntry] = []
    for pid, (job_id, rank, local_rank, world_size) in sorted(claims.items()):
        parent_claim = claims.get(parents.get(pid, 0))
        if parent_claim is not None and parent_claim[:2] == (job_id, rank):
            continue
        out.append(
            RankEntry(
                job_id=job_id, rank=rank, pid=pid, local_rank=local_rank, world_size=world_size,
                source="environ", start_ticks=procfs.start_ticks(pid), owner_uid=uids[pid],
            )
        )
    return out
