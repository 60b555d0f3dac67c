"""A rank's exit as a value: who ended, when (the exit watcher's wake, sources/exits.py), its wait
status, what the kernel said about it, and its place among its job's deaths. Built by
join/exits.py, read by findings/rank_down.py and findings/job_crashed.py and the event log. No I/O.

The cause is one of a fixed set of words, the label of ``gpuwatch_rank_exits_total`` (bounded):
``exit_0``, ``exit_nonzero``, a signal name of ``SIGNAL_CAUSES``, ``signal_other``, ``oom_kill``
(an OOM killer named the PID: kernel, systemd-oomd, earlyoom) or ``unknown`` (the status could not
be read: reaped before the read on a kernel without PIDFD_INFO_EXIT, or another user's process
without CAP_SYS_PTRACE).
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_0 = "exit_0"
EXIT_NONZERO = "exit_nonzero"
OOM_KILL = "oom_kill"
UNKNOWN = "unknown"
SIGNAL_OTHER = "signal_other"
SIGNAL_CAUSES = (
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGILL",
    "SIGTRAP",
    "SIGABRT",
    "SIGBUS",
    "SIGFPE",
    "SIGKILL",
    "SIGUSR1",
    "SIGSEGV",
    "SIGUSR2",
    "SIGPIPE",
    "SIGALRM",
    "SIGTERM",
    "SIGXCPU",
    "SIGXFSZ",
    "SIGSYS",
)
CAUSES = (EXIT_0, EXIT_NONZERO, *SIGNAL_CAUSES, SIGNAL_OTHER, OOM_KILL, UNKNOWN)

# What a job's first failure says about who ended it (join/exits.py ``verdict``):
FINISHED = "finished"  # exit 0
STOPPED = "stopped"  # SIGTERM / SIGINT / SIGHUP: a stop request (scheduler, user, launcher)
NODE = "node"  # an OOM killer, SIGBUS, a critical Xid naming the PID: the node's doing
KILLED = "killed"  # SIGKILL no OOM killer named, or a status that could not be read
CRASHED = "crashed"  # its own code: exit != 0, SIGSEGV, SIGABRT, SIGILL, SIGFPE, ...


@dataclass(frozen=True)
class RankExit:
    """One watched rank process that ended."""

    job_id: str
    rank: int
    pid: int
    comm: str
    time: float  # Unix seconds the exit watcher woke (to the millisecond)
    status: int | None  # wait status (waitpid(2)); None: unknown
    registered: bool = False  # claimed by a rank file (it stays registered and dead)
    local_rank: int | None = None
    world_size: int | None = None
    start_ticks: int = 0  # /proc/PID/stat field 22 of the process that ended
    cause: str = UNKNOWN  # one of CAUSES
    how: str = ""  # "exited with SIGSEGV (core dumped)"
    kernel: str = ""  # what the kernel said about this PID ("" for nothing)
    verdict: str = KILLED  # one of FINISHED .. CRASHED
    first_rank: int | None = None  # the rank of its job that failed first on this node
    first_pid: int | None = None  # and its pid (None: no rank of the job failed)
    after_seconds: float | None = None  # how long after that first failure this one ended
    unknown: str = ""  # why ``status`` is None
    read_by: str = ""  # "stat" (the zombie's) | "pidfd" (PIDFD_INFO_EXIT, after the reap)
    seq: int = 0  # the watcher's order: exits read in one wake share their time
    oom_event: str = ""  # the key of the OOM-kill event that named it or one of its workers

    @property
    def first(self) -> bool:
        """Is this the first of its job to fail on this node?"""
        return self.first_pid == self.pid
