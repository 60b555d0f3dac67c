"""Rank discovery from launcher variables in ``/proc/PID/environ`` (torchrun, Slurm, Open MPI).

Lists /proc and reads ``environ`` of each process: it runs at ``discovery.interval_seconds``, not
every cycle. It needs CAP_SYS_PTRACE/CAP_DAC_READ_SEARCH for other users' processes. The PIDs are
the host's (the daemon runs in the host PID namespace), so processes in containers are found too.
Shell equivalent:
``tr '\\0' '\\n' < /proc/PID/environ | grep -E '^(RANK|LOCAL_RANK|SLURM_PROCID|OMPI_COMM_WORLD_RANK)='``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from gpuwatchd.model import RankEntry
from gpuwatchd.rank.rankfile import DISCOVERY_VARS, claim_from_env
from gpuwatchd.sources.procfs import ProcessGone, ProcfsReader

__all__ = ["discover"]

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
