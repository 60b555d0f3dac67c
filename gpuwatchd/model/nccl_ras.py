"""What NCCL RAS says about a job (gpuwatchd/join/nccl_ras.py makes them from its answers):
the ranks it reports, each local rank's operation counts, and the culprit in words."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class RasRank:
    """One rank of the communicator, as RAS reports it."""

    rank: int
    host: str
    pid: int
    cuda_dev: int = -1
    counts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # function -> operations issued
    init_state: int = 0
    async_error: int = 0
    abort: bool = False
    missing: str = ""  # "dead" | "unresponsive" | "missing" for a missing rank; "" when present

    @property
    def ops(self) -> int:
        return sum(self.counts.values())

    def where(self) -> str:
        """ "rank 3 on 10.1.0.5 (pid 4104)"; NCCL's text answers may know only the process (a
        dead one: rank -1) or only the rank (2.24-2.25's missing ranks: no host, pid -1)."""
        if self.rank < 0:
            return f"process {self.pid} on {self.host}"
        if self.pid < 0:
            return f"rank {self.rank}"
        return f"rank {self.rank} on {self.host} (pid {self.pid})"


@dataclass(frozen=True)
class RasRankStatus:
    """One local rank of a job as RAS sees it (``NodeState.nccl_ras``; ``gpuwatchd ps --json``)."""

    job_id: str
    rank: int  # gpuwatchd's rank
    pid: int
    ras_rank: int
    ops: int  # collectives issued, all functions
    counts: Mapping[str, int]
    moved_at: float  # when its count last changed (the first answer: when it was asked)
    asked_at: float
    async_error: int = 0
    # the job as RAS saw it in the same answer: its missing ranks by reason, ranks with an async
    # error or abort, and the culprit in words
    dead: int = 0
    unresponsive: int = 0
    errors: int = 0
    culprit: str = ""
    # the ranks named in it: (RAS rank, host, pid, "dead" | "unresponsive" | "missing" | "behind"
    # | "async_error"), at most join/nccl_ras.py MAX_NAMED of each kind
    culprits: tuple[tuple[int, str, int, str], ...] = ()
    # False: the rank's communicator has one rank, whose collectives NCCL never counts (a one-rank
    # collective is a local copy, ncclLaunchOneRank, launched with no kernel plan, and only a plan
    # adds to the counts RAS reads, comm->seqNumber: src/enqueue.cc, src/plugin/profiler.cc)
    counted: bool = True


@dataclass(frozen=True)
class RasJob:
    """What RAS says about one job, or why there is nothing (``error``)."""

    job_id: str
    asked_at: float
    error: str = ""
    nccl_version: str = ""
    size: int = 0
    local: tuple[RasRankStatus, ...] = ()
    missing: tuple[RasRank, ...] = ()
    errors: tuple[RasRank, ...] = ()  # async error or abort flag set
    behind: tuple[RasRank, ...] = ()  # the lowest counts, when counts stopped and differ
    progressing: bool | None = None  # counts moved since the previous answer (None: first)
    stopped_seconds: float = 0.0  # how long no rank's count moved
    missing_seconds: float = 0.0  # how long every answer named missing ranks (0: none now)
    statement: str = ""  # the culprit in words ("" when none)
