"""Who may claim a ``(job_id, rank)``: the trust rules applied to one cycle's rank entries.

Pure: reads only the entries and the processes /proc showed this cycle. The rules (README "Trust
rules", docs/security.md §4):

1. A rank-file entry counts only when the file's owner is root or the uid of the process it names.
2. A job belongs to one uid: the uid of the process of its first trusted live claim (a root-owned
   file, a user's file naming that user's own live process, or a discovered live process; the
   earliest-started process first, among the claims of the cycle the job is first seen in).
   Once learnt it is kept (``owners``) while the job has ranks, and across restarts of the
   daemon (``state_dir/job_owners.json``, sources/job_owners.py): it is never decided again
   from start times, where an older process of another user claiming the job would win.
   A claim by any other uid for that job (a user's file, even for the user's own process, or a
   discovered process of another user) is refused; root-owned files are never refused by this.
   One claim beats a remembered owner: a process in the job's own Slurm cgroup
   (``/slurm/uid_U/job_N``, made by slurmstepd as root) claiming job N or N.STEP makes U the
   owner, so a user who claimed a predictable Slurm job id before it started loses it.
   ``gpuwatchd check`` applies rules 1 and 3 only (``one_owner_per_job=False``): for it, rule 2
   could only make a user's own registered rank look unregistered, and be killed.
3. Of several claims on one ``(job_id, rank)`` the most trusted wins: root-owned files, then
   users' files whose PID is alive and theirs, then discovery of a live process, then claims
   whose PID does not exist (unverifiable: they never displace a verified one).

A discovered claim is made by its process's uid as last seen alive (``claimant_uids``): a process
that changes uid after discovery (a root wrapper that drops to a user) and is refused for it stays
refused once it has exited, rather than being judged again by the uid discovery once read; and a
discovered rank that exited stays a dead rank (rank_down) when another user's process takes its
PID, rather than becoming that process's refused claim.

``decide`` is the one place that says which claims of a cycle are accepted: the daemon calls it
once, right after /proc is read and before any subsystem looks at a rank, and every reading of the
cycle (heartbeats, stall verdicts, GIL samples, memory, stragglers, flight recorder, the join)
sees only its ``accepted`` entries (a refused claim must never drive another rank's readings).

The series limit of a job (``MAX_RANKS_PER_JOB`` accepted ranks) is applied here, after
ownership, the most trusted claims first: the caps before the claims (sources/rankfiles.py) are
per claimant, so that no uid's claims take another's places.

Every refusal is returned as a ``BadRankFile`` (a ``bad_rank_file`` finding, severity info):
it is never a rank, so it can never page.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.model import BadRankFile, CgroupPaths, ProcessInfo, RankEntry, RankId, RankProcess
from gpuwatchd.rank.rankfile import MAX_RANKS_PER_JOB

ROOT_FILE, VERIFIED_FILE, DISCOVERED, UNVERIFIED = range(4)
ClaimantKey = tuple[int, int | None]  # (pid, start ticks) of a discovered claim's process


def _tier(e: RankEntry, proc: ProcessInfo | None) -> int:
    if e.source == "rankfile" and e.owner_uid in (0, None):
        return ROOT_FILE
    if proc is None:
        return UNVERIFIED
    return VERIFIED_FILE if e.source == "rankfile" else DISCOVERED


def _process(
    e: RankEntry, processes: Mapping[int, ProcessInfo], known_ticks: Mapping[RankProcess, int] | None = None
) -> ProcessInfo | None:
    """The live process a claim names: only one started when the claim's process started
    (``start_ticks`` of the file or of discovery, else the start time the join first saw for this
    (job, rank, pid), ``known_ticks``). One that took the PID after the claimant exited is not
    the claimant, and the claim is that of a gone process: a rank file's stays a dead rank
    (rank_down) instead of becoming that process's refused claim, a discovered
    one is judged by its last uid (``claimant_uids``)."""
    proc = processes.get(e.pid)
    if proc is None:
        return None
    ticks = e.start_ticks
    if ticks is None and known_ticks is not None:
        ticks = known_ticks.get(e.rank_process)
    if ticks is not None and proc.start_ticks != ticks:
        return None
    return proc


def _where(e: RankEntry) -> str:
    return e.path or f"discovery (pid {e.pid})"


# Slurm's cgroup v1 layout (task/cgroup plugin): made by slurmstepd as root, so a process in it
# is in that Slurm job of that uid; a user cannot move a process into another user's job.
_SLURM_CGROUP = re.compile(r"/slurm/uid_([0-9]{1,10})/job_([0-9]{1,12})(?:/|$)", re.ASCII)


def slurm_jobs(cgroups: Mapping[int, CgroupPaths]) -> dict[int, tuple[str, int]]:
    """pid -> (Slurm job id, its uid) for each process whose cgroup path says so (v1's
    ``/slurm/uid_U/job_N``; the v2 layout names no uid and is not used)."""
    out: dict[int, tuple[str, int]] = {}
    for pid, paths in cgroups.items():
        m = _SLURM_CGROUP.search(paths.memory_v1) or _SLURM_CGROUP.search(paths.unified)
        if m is not None:
            out[pid] = (m[2], int(m[1]))
    return out


def _scheduler_owner(e: RankEntry, proc: ProcessInfo, scheduler: Mapping[int, tuple[str, int]]) -> bool:
    """Is ``e`` a claim of its own Slurm job (job id N or N.STEP) by a process in that job?"""
    job = scheduler.get(e.pid)
    return job is not None and proc.uid == job[1] and (e.job_id == job[0] or e.job_id.startswith(job[0] + "."))


def job_owners(
    entries: Iterable[RankEntry],
    processes: Mapping[int, ProcessInfo],
    known: Mapping[str, int],
    known_ticks: Mapping[RankProcess, int] | None = None,
    scheduler: Mapping[int, tuple[str, int]] | None = None,
) -> dict[str, int]:
    """job_id -> owning uid: a live claim by a process of that Slurm job (``scheduler``: the
    scheduler's word beats anyone's earlier claim of a predictable job id), else ``known``,
    else the first trusted live claim of each job."""
    owners = dict(known)
    live: list[tuple[int, int, str, int, RankEntry, ProcessInfo]] = []
    for e in entries:
        proc = _process(e, processes, known_ticks)
        if proc is None:
            continue
        tier = _tier(e, proc)
        if tier == VERIFIED_FILE and proc.uid != e.owner_uid:
            continue  # rule 1 refuses it
        live.append((tier, proc.start_ticks, e.path, e.pid, e, proc))
    for *_, e, proc in sorted(live, key=lambda t: t[:4]):
        owners.setdefault(e.job_id, proc.uid)
    for *_, e, proc in live:
        if scheduler and _scheduler_owner(e, proc, scheduler):
            owners[e.job_id] = proc.uid
    return owners


def claimant_uids(
    entries: Iterable[RankEntry], processes: Mapping[int, ProcessInfo], last: Mapping[ClaimantKey, int]
) -> dict[ClaimantKey, int]:
    """(pid, start ticks) of each discovered claim -> the uid of its process when last seen alive:
    this cycle's where it is alive (and started when discovery saw it start), ``last``'s where it
    is gone. Bounded by this cycle's entries."""
    out: dict[ClaimantKey, int] = {}
    for e in entries:
        if e.source == "rankfile":
            continue
        key = (e.pid, e.start_ticks)
        proc = _process(e, processes)
        if proc is not None:
            out[key] = proc.uid
        elif key in last:
            out[key] = last[key]
    return out


def select(
    entries: Iterable[RankEntry],
    processes: Mapping[int, ProcessInfo],
    known_owners: Mapping[str, int] | None = None,
    last_uids: Mapping[ClaimantKey, int] | None = None,
    known_ticks: Mapping[RankProcess, int] | None = None,
    one_owner_per_job: bool = True,
    per_job: int = MAX_RANKS_PER_JOB,
    scheduler: Mapping[int, tuple[str, int]] | None = None,
) -> tuple[list[RankEntry], list[BadRankFile], dict[str, int]]:
    """(accepted entries, refusals, job owners of the accepted jobs). ``last_uids``:
    ``claimant_uids`` of this cycle (a gone process's claim is judged by its last uid);
    ``known_ticks``: the start time first seen per (job_id, rank, pid) (``JoinMemory``).
    ``one_owner_per_job`` False: rule 2 is not applied (``gpuwatchd check``: a user's own file
    naming the user's own process registers it, whoever owns the job). At most ``per_job``
    ranks of a job are accepted (series limit), counted after ownership, the most trusted
    claims first: another uid's claims never take a job's places."""
    entries = list(entries)
    last_uids = last_uids or {}
    owners = job_owners(entries, processes, known_owners or {}, known_ticks, scheduler)
    if not one_owner_per_job:
        owners = {}
    per_job_n: dict[str, int] = {}
    capped: set[str] = set()
    accepted: dict[RankId, RankEntry] = {}
    refused: list[BadRankFile] = []
    claimed_pids: set[int] = set()
    ranked = sorted(
        entries, key=lambda e: (_tier(e, _process(e, processes, known_ticks)), e.path, e.job_id, e.rank, e.pid)
    )
    for e in ranked:
        proc = _process(e, processes, known_ticks)
        tier = _tier(e, proc)
        if tier == VERIFIED_FILE and proc is not None and proc.uid != e.owner_uid:
            refused.append(
                BadRankFile(
                    e.path,
                    f"owner uid {e.owner_uid} may not claim pid {e.pid} (owned by uid {proc.uid}); "
                    f"entry for rank {e.rank} of job {e.job_id} refused",
                )
            )
            continue
        if e.source == "rankfile":
            claimant = e.owner_uid
        else:
            claimant = proc.uid if proc is not None else last_uids.get((e.pid, e.start_ticks), e.owner_uid)
        owner = owners.get(e.job_id)
        if tier != ROOT_FILE and owner is not None and claimant is not None and claimant != owner:
            refused.append(
                BadRankFile(
                    _where(e),
                    f"job {e.job_id} belongs to uid {owner}; claim of rank {e.rank} (pid {e.pid}) by "
                    f"uid {claimant} refused (rank_conflict)",
                )
            )
            continue
        key = e.rank_id
        if key in accepted:
            first = accepted[key]
            if e.source == "rankfile" and first.pid != e.pid:
                refused.append(
                    BadRankFile(
                        e.path,
                        f"rank {e.rank} of job {e.job_id} is already claimed by {_where(first)}; duplicate ignored",
                    )
                )
            continue
        if e.source != "rankfile" and e.pid in claimed_pids:
            continue
        if per_job_n.get(e.job_id, 0) >= per_job:
            if e.job_id not in capped:
                capped.add(e.job_id)
                refused.append(
                    BadRankFile(
                        _where(e),
                        f"job {e.job_id} has more than {per_job} ranks on this node; "
                        f"ranks above the cap are ignored (series limit)",
                    )
                )
            continue
        per_job_n[e.job_id] = per_job_n.get(e.job_id, 0) + 1
        accepted[key] = e
        claimed_pids.add(e.pid)
    kept_jobs = {e.job_id for e in accepted.values()}
    return list(accepted.values()), refused, {j: u for j, u in owners.items() if j in kept_jobs}


@dataclass(frozen=True)
class Claims:
    """The verdict on one cycle's claims (``decide``): what every later stage may read."""

    accepted: tuple[RankEntry, ...]
    refused: tuple[BadRankFile, ...]
    job_owners: Mapping[str, int]  # of the accepted jobs, kept for the next cycle
    claimant_uids: Mapping[ClaimantKey, int]  # kept for the next cycle

    ids: frozenset[RankProcess] = field(init=False)  # (job_id, rank, pid) accepted

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", frozenset(e.rank_process for e in self.accepted))

    def accepts(self, job_id: str, rank: int, pid: int) -> bool:
        return (job_id, rank, pid) in self.ids


def decide(
    entries: Iterable[RankEntry],
    processes: Mapping[int, ProcessInfo],
    known_owners: Mapping[str, int] | None = None,
    last_uids: Mapping[ClaimantKey, int] | None = None,
    known_ticks: Mapping[RankProcess, int] | None = None,
    cgroups: Mapping[int, CgroupPaths] | None = None,
) -> Claims:
    """``claimant_uids`` then ``select``: the accepted entries, the refusals and the memory for
    the next cycle (``known_owners``, ``last_uids`` and ``known_ticks`` are the last cycle's;
    ``cgroups``: this cycle's cgroup of each claimed process, ``slurm_jobs``)."""
    entries = list(entries)
    uids = claimant_uids(entries, processes, last_uids or {})
    accepted, refused, owners = select(
        entries, processes, known_owners, uids, known_ticks, scheduler=slurm_jobs(cgroups or {})
    )
    return Claims(tuple(accepted), tuple(refused), owners, uids)
