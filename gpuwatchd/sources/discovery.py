"""Rank discovery from launcher variables in ``/proc/PID/environ`` (torchrun, Slurm, Open MPI).

Lists /proc and reads ``environ`` of each process: it runs at ``discovery.interval_seconds``, not
every cycle. It needs CAP_SYS_PTRACE/CAP_DAC_READ_SEARCH for other users' processes. The PIDs are
the host's (the daemon runs in the host PID namespace), so processes in containers are found too.
Shell equivalent:
``tr '\\0' '\\n' < /proc/PID/environ | grep -E '^(RANK|LOCAL_RANK|SLURM_PROCID|OMPI_COMM_WORLD_RANK)='``.

Cost, bounded whatever the host's users run (1500 processes with 1.9 MiB environments each kept
the rank collector past its 5 s time-out under ``CPUQuota=25%`` when every pass read 1 MiB of
each):

- ``environ`` is what the process was started with (the kernel shows the initial environment
  block; ``setenv`` does not change it), so each process's is read once in its lifetime: the
  verdict is kept per (pid, start ticks) for as long as the process is listed (``Discoverer``).
- Except at the start of a process's life: between fork and exec, ``environ`` is still the
  parent's (torchrun's, with no RANK), and the start time does not change at exec. A process
  that names no rank is read again at each pass for its first ``SETTLE_SECONDS`` (10 s) after
  it was first read; a claim, once read, is kept. (Kept from the first read, a torchrun worker
  read in that window was never discovered, so its exit was never watched: seen on the H100,
  three of eight 2-rank jobs lost a rank that way.)
- Only the first ``ENVIRON_PREFIX_BYTES`` (128 KiB) of it are read. Launchers put their variables
  into a normal-sized environment (a few KiB); a process whose rank variables sit behind more
  than 128 KiB of other variables is not discovered, and is registered with a rank file instead
  (docs/security.md). A 2 MiB environment costs what a 128 KiB one does.
- A pass reads at most ``PASS_ENVIRON_BYTES`` (16 MiB: 128 full prefixes, 4000 environments of
  4 KiB) of environments not seen before, shared max-min fairly in bytes between uids (the next
  read is for the uid that has read least in this pass; each uid's lowest PIDs first): one
  user's thousands of new processes, or huge environments, wait for later passes, never another
  uid's rank. What a pass leaves unread is read by the next.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwatchd.model import RankEntry
from gpuwatchd.rank.rankfile import DISCOVERY_VARS, claim_from_env
from gpuwatchd.sources.procfs import ProcessGone, ProcfsReader, environ_pick

__all__ = ["ENVIRON_PREFIX_BYTES", "PASS_ENVIRON_BYTES", "Discoverer", "discover"]

ENVIRON_PREFIX_BYTES = 128 * 1024
PASS_ENVIRON_BYTES = 16 * 1024 * 1024
MIN_READ_COST = 4096  # what a read counts against the pass's budget at least (an empty one too)
SETTLE_SECONDS = 10.0  # a process naming no rank is read again for this long (fork before exec)

Claim = tuple[str, int, "int | None", "int | None"]  # (job_id, rank, local_rank, world_size)


@dataclass(frozen=True)
class _Seen:
    """What one process's environment said, read once: its claim (None: it names no rank)."""

    start_ticks: int
    uid: int
    ppid: int
    claim: Claim | None
    read_at: float = 0.0  # the Discoverer's clock at the first read of this process


class Discoverer:
    """Discovery with memory across passes: each process's environment is read once (per pid
    and start time), and each pass reads at most ``budget`` bytes of new ones, shared by uid."""

    def __init__(
        self,
        prefix: int = ENVIRON_PREFIX_BYTES,
        budget: int = PASS_ENVIRON_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.budget = budget
        self.clock = clock
        self._seen: dict[int, _Seen] = {}
        self.deferred = 0  # processes of the last pass whose environment is still to be read
        self.reads = 0  # environments read, all passes (tests, bench)

    def scan(self, procfs: ProcfsReader, launchers: Iterable[str]) -> list[RankEntry]:
        """Ranks found from launcher variables. Children inherit their rank's environment
        (DataLoader workers), so of the processes that claim one (job, rank) the one whose parent
        does not claim it is the rank."""
        launchers = tuple(launchers)
        pending: dict[int, list[tuple[int, int, int]]] = {}  # uid -> (pid, start ticks, ppid)
        seen: dict[int, _Seen] = {}
        now = self.clock()
        first_read: dict[int, float] = {}  # pids read again while they settle: their first read
        for pid in procfs.pids():
            try:
                fields = procfs.read_stat(pid)[1]
                ticks, ppid = int(fields[19]), int(fields[1])
                uid = os.stat(procfs.paths.proc(pid)).st_uid
            except (ValueError, IndexError, ProcessGone, OSError):
                continue
            old = self._seen.get(pid)
            if (
                old is not None
                and old.start_ticks == ticks
                and old.claim is None
                and now - old.read_at < SETTLE_SECONDS
            ):
                first_read[pid] = old.read_at  # maybe read between fork and exec: read again
                pending.setdefault(uid, []).append((pid, ticks, ppid))
            elif old is not None and old.start_ticks == ticks:
                # the same process (a setuid since is its new claimant; its environment is the same)
                seen[pid] = old if old.uid == uid else dataclasses.replace(old, uid=uid)
            else:
                pending.setdefault(uid, []).append((pid, ticks, ppid))
        self.deferred = 0
        left = self.budget
        # Max-min fair in bytes: the next read is for the uid that has read least so far in this
        # pass, so root's 4 KiB environments are not held back by a user's 128 KiB ones.
        turns = [(0, uid, collections.deque(sorted(ps))) for uid, ps in sorted(pending.items())]
        heapq.heapify(turns)
        while turns:
            used, uid, queue = heapq.heappop(turns)
            if left < self.prefix:  # a prefix cut short would be remembered as the whole
                self.deferred += len(queue) + sum(len(q) for *_, q in turns)
                break
            pid, ticks, ppid = queue.popleft()
            raw = procfs.environ_block(pid, self.prefix)
            self.reads += 1
            cost = max(len(raw or b""), MIN_READ_COST)
            left -= cost
            if queue:
                heapq.heappush(turns, (used + cost, uid, queue))
            if not raw:  # gone, not permitted, or empty for a moment after exec: not remembered
                continue
            seen[pid] = _Seen(
                ticks, uid, ppid, _claim(environ_pick(raw, DISCOVERY_VARS), launchers), first_read.get(pid, now)
            )
        self._seen = seen  # processes no longer listed are forgotten
        return _ranks(procfs, seen)


def _claim(env: dict[str, str], launchers: tuple[str, ...]) -> Claim | None:
    try:
        return claim_from_env(env, launchers)
    except ValueError:  # a value the launcher parse refuses (RANK=²): no rank, the pass goes on
        return None


def _ranks(procfs: ProcfsReader, seen: dict[int, _Seen]) -> list[RankEntry]:
    out: list[RankEntry] = []
    for pid, s in sorted(seen.items()):
        if s.claim is None:
            continue
        job_id, rank, local_rank, world_size = s.claim
        parent = seen.get(s.ppid)
        if parent is not None and parent.claim is not None and parent.claim[:2] == (job_id, rank):
            continue
        out.append(
            RankEntry(
                job_id=job_id,
                rank=rank,
                pid=pid,
                local_rank=local_rank,
                world_size=world_size,
                source="environ",
                start_ticks=s.start_ticks,
                owner_uid=s.uid,
            )
        )
    return out


def discover(procfs: ProcfsReader, launchers: Iterable[str]) -> list[RankEntry]:
    """One pass with no memory (the CLI, tests): ``Discoverer().scan``."""
    return Discoverer().scan(procfs, launchers)
