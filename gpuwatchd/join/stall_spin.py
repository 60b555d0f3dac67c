"""The spin rules of stall detection: when the same stack in every dump is a stall.

A thread that burns a core at one line is ambiguous from outside the process: a loop that syncs
the GPU every step (``.item()``, ``synchronize``) spins in the CUDA driver at the same line as a
rank whose GPU never finishes, and a loop that calls one GIL-releasing C function again and again
(``hashlib``, a numpy op) looks like one C call that never returns. Measured on real processes
(bench/stall_evidence.py, bench/results/stall_evidence_*.txt): their CPU share, voluntary and
non-voluntary context switches, minor faults, run slices, read/write syscalls, wchan and a burst of
ten ``py-spy dump``s (one distinct (line, GIL) pair in ten, for both) are the same. What does differ,
and what these rules use:

- **the GPU's memory controller** (``nvmlDeviceGetUtilizationRates().memory``, read every cycle
  anyway): a GPU that does work moves data; a kernel that never ends (a spin on a flag, a peer that
  never arrives) keeps the GPU "busy" with no memory traffic. A reading with memory activity on a
  GPU that only this rank's job uses counts as progress (``MEM_ACTIVE``); every reading over the window
  busy (``GPU_BUSY``) with none is a *GPU spin* and confirms the stall;
- **the GPU idle** in every reading while a Python thread sits in a torch GPU wait
  (``synchronize``, ``.item()`` with a torch frame of its own): the work it waits for never runs;
- **the peers of the same job**: a peer stalled without ambiguity (blocked at 0 % CPU, a lost
  heartbeat, stopped) means the collective cannot progress, so the spinning rank waits for it.

The readings are device-wide. On a GPU that another process (not a rank of the job) also holds
memory on, memory traffic may be that process's: it is no evidence of progress there. No traffic
at all, or an idle GPU, holds for every process on it, so those still confirm; after traffic there,
the readings after it decide once ``after_seconds`` have passed (as if it were the rank's progress).
Where nothing confirms a stall, the verdict is ``ambiguous`` (a warning, never a page) and says
what would: a heartbeat, NVML, ``gpuwatchd doctor``.

Pure, no I/O: the daemon's stall part hands the readings in before its looks, from the same
cycle's NVML reading (daemon/stall.py). Memory: at most
``MAX_READINGS`` readings per rank. Cost: linear in them, for suspect ranks only.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd.model import GpuDevice, GpuProcess, RankId
from gpuwatchd.model.gpus import is_rank_gpu
from gpuwatchd.model.stall import HangAnalysis, StallVerdict
from gpuwatchd.model.threads import ThreadStack

log = logging.getLogger(__name__)

MEM_ACTIVE = 0.01  # NVML reports whole percent: 1 % of memory-controller time is data moving
GPU_BUSY = 0.6  # as findings/stall.py's "busy"
GPU_IDLE = 0.05
MIN_READINGS = 3
MAX_READINGS = 240  # a 20-minute window at a 5 s cycle
WORK_SHARE = 0.05  # as join/stall.py: below it a thread did no work since the last look


@dataclass(frozen=True)
class GpuReading:
    """One cycle's NVML view of a rank's GPUs: the busiest GPU's utilisation and memory-controller
    share, and whether the ranks of its job are the only holders of memory on all of them."""

    at: float
    util: float | None
    mem: float | None
    exclusive: bool


@dataclass
class GpuWindow:
    readings: collections.deque[GpuReading] = field(default_factory=lambda: collections.deque(maxlen=MAX_READINGS))
    _active: GpuReading | None = None  # the last reading that showed data moving for it alone

    def add(self, r: GpuReading) -> None:
        self.readings.append(r)
        if r.exclusive and r.mem is not None and r.mem >= MEM_ACTIVE:
            self._active = r

    def active_at(self) -> float | None:
        """The last reading in the window that shows the GPU moving data for this rank alone
        (kept as the readings come: the window scanned at each call was 240 readings per rank
        per cycle for a rank whose GPU never moved data)."""
        a = self._active
        if a is None or not self.readings or a.at < self.readings[0].at:
            return None
        return a.at

    def verdict(self, since: float, now: float, after: float) -> tuple[str, str]:
        """("spin" | "idle" | "active" | "unknown", the readings in words) over [since, now];
        "spin" and "idle" need ``MIN_READINGS`` readings spanning at least ``after`` / 2 seconds.

        On a shared GPU, memory traffic may be this rank's progress or another process's: it is
        judged as on a GPU the rank alone uses, where it would be progress. The readings after the
        last of it decide, once ``after`` seconds have passed since it (measured: the traffic of a
        process starting beside a hung rank, kept in the window since the rank's last progress,
        left the hang "unknown" for as long as it lasted)."""
        rs = [r for r in self.readings if since <= r.at <= now]
        if not rs:
            return "unknown", "no NVML reading of its GPU"
        shared = not all(r.exclusive for r in rs)
        if any(r.util is None or r.mem is None for r in rs):
            return "unknown", "its GPU's utilisation or memory activity is unknown"
        moved = [r for r in rs if r.mem is not None and r.mem >= MEM_ACTIVE]
        if moved and not shared:
            return "active", self._words(rs, shared)
        if moved:
            last = moved[-1].at
            tail = [r for r in rs if r.at > last]
            words = self._words(tail or rs, shared) + (
                f"; memory traffic {now - last:.0f} s ago, maybe the other process's"
            )
            if not tail or now - last < after:
                return "unknown", words
            rs = tail
        else:
            words = self._words(rs, shared)
        utils = [r.util for r in rs if r.util is not None]
        if len(rs) < MIN_READINGS or rs[-1].at - rs[0].at < after / 2:
            return "unknown", words + " (too few to decide)"
        if min(utils) >= GPU_BUSY:
            return "spin", words
        if max(utils) < GPU_IDLE:
            return "idle", words
        return "unknown", words

    @staticmethod
    def _words(rs: list[GpuReading], shared: bool) -> str:
        utils = [r.util or 0.0 for r in rs]
        mems = [r.mem or 0.0 for r in rs]
        words = (
            f"{len(rs)} NVML readings over {rs[-1].at - rs[0].at:.0f} s: utilisation "
            f"{min(utils):.0%}-{max(utils):.0%}, memory controller {min(mems):.0%}-{max(mems):.0%}"
        )
        return words + "; shared with another process" if shared else words


def readings_for(now: float, gpus: Iterable[tuple[float | None, float | None, bool]]) -> GpuReading | None:
    """Fold (util, memory util, exclusive) of each of a rank's GPUs into one reading: the busiest
    GPU's numbers, exclusive only when every GPU is; None for a rank with no GPU."""
    rows = list(gpus)
    if not rows:
        return None
    utils = [u for u, _, _ in rows]
    mems = [m for _, m, _ in rows]
    return GpuReading(
        now, None if None in utils else max(u for u in utils if u is not None),
        None if None in mems else max(m for m in mems if m is not None),
        all(x for _, _, x in rows))  # fmt: skip


def spinning_python(stacks: Iterable[ThreadStack], spinning: frozenset[int]) -> frozenset[int]:
    """The Python threads among those burning a core (every spinning task when the dumps give
    no tids: Python 3.10, py-spy #567, or no py-spy). Native helper threads (NCCL, CUDA)
    spinning beside a blocked Python thread leave the block unambiguous."""
    stacks = tuple(stacks)
    tids = {s.tid for s in stacks if s.tid}
    if not tids or any(not s.tid for s in stacks):
        return spinning
    return spinning & frozenset(tids)


def new_spinners(stacks: Iterable[ThreadStack], spinning: frozenset[int], native: frozenset[int]) -> frozenset[int]:
    """The threads burning a core that the last dump did not show: started since (the catalog's
    GIL fault starts a thread that keeps the GIL in one C call while the rank trains), neither a
    Python thread of that dump nor a native one it showed spinning (``native``). Empty before the
    first dump and where the dumps give no tids (``spinning_python`` counts every spinner then)."""
    stacks = tuple(stacks)
    if not stacks or any(not s.tid for s in stacks):
        return frozenset()
    return spinning - {s.tid for s in stacks} - native


def runnable_shares(schedstat: Callable[[int, int], tuple[int, int] | None], pid: int,
                    prev: Mapping[int, tuple[int, int]],
                    shares: Mapping[int, float], elapsed: float,
                    ) -> tuple[dict[int, float], dict[int, tuple[int, int]]]:  # fmt: skip
    """Each working thread's share of the window it was runnable (on a CPU or waiting for one),
    and the schedstat readings to keep for the next look: a thread that never slept is spinning
    whatever share of a CPU other load left it (measured: a hash loop got 50-80 % of a core on
    the loaded 2-core VM, runnable 100 %). Read only for the threads that used CPU since the last
    look (a few per rank); a thread's first such look keeps its CPU share. ``schedstat``:
    (pid, tid) -> that task's (run ns, wait ns), the looker's read (sources/stall_looks.py)."""
    sched = {}
    for tid, share in shares.items():
        if share >= WORK_SHARE:
            now_v = schedstat(pid, tid)
            if now_v is not None:
                sched[tid] = now_v
    out = dict(shares)
    for tid, (run, wait) in sched.items():
        old = prev.get(tid)
        if old is not None and elapsed > 0:
            out[tid] = max(out[tid], min(1.0, (run - old[0] + wait - old[1]) / 1e9 / elapsed))
    return out, sched


def confirm_spin(window: GpuWindow, since: float, now: float, after: float,
                 analysis: HangAnalysis | None) -> tuple[str, str]:  # fmt: skip
    """(what confirms the stall of a rank spinning at one line since ``since``, or "" when
    nothing does; the GPU readings in words)."""
    kind, words = window.verdict(since, now, after)
    if kind == "spin":
        return "gpu_spin", words
    if kind == "idle" and analysis is not None and "gpu_wait" in analysis.kinds:
        return "gpu_idle", words
    return "", words


def log_held(pid: int, still: float, spinning: Collection[int], spin: Collection[int], gpu_words: str,
             window: GpuWindow, since: float, now: float, bound: float) -> None:  # fmt: skip
    """At DEBUG, what a rank proven still for the conclusive bound lacks to be stalled (a spin not
    seen at the last look, the GPU's readings): the trail of a conclusive page that comes late."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "stall held: pid %d still %.1f s, spinning %s (Python %s), gpu: %s",
            pid, still, sorted(spinning), sorted(spin), gpu_words or window.verdict(since, now, bound)[1],
        )  # fmt: skip


def rank_gpu_readings(now: float, named: Mapping[RankId, Collection[str]], owner: Mapping[int, RankId],
                      gpus: Iterable[GpuDevice], gpu_processes: Iterable[GpuProcess],
                      ) -> dict[RankId, GpuReading]:  # fmt: skip
    """Each rank's GPUs in this cycle's NVML reading (``model/gpus.py: is_rank_gpu``: those its tree holds
    memory on, ``owner`` being pid -> the live rank whose tree it is in, and those its rank file
    names, ``named``), with whether anybody outside its job holds memory on them. Ranks of one job
    that share a GPU share its evidence: data moving there is the job's progress (rank 0
    evaluating on the GPU that rank 1, waiting in a barrier, also holds), and no traffic holds for
    both."""
    holders: dict[int, set[tuple[str, str]]] = collections.defaultdict(set)
    held: dict[RankId, set[int]] = collections.defaultdict(set)
    for p in gpu_processes:
        rid = owner.get(p.pid)
        holders[p.gpu_index].add((rid[0], str(rid[1])) if rid else ("", f"pid {p.pid}"))
        if rid:
            held[rid].add(p.gpu_index)
    devices = tuple(gpus)
    # the jobs holding memory on each GPU, once a cycle, not once per rank and holder (64 ranks
    # on one GPU: 1.18 -> 0.59 ms a cycle on the 2-core VM)
    jobs_on = {i: frozenset(job for job, _ in h) for i, h in holders.items()}
    out: dict[RankId, GpuReading] = {}
    for rid, names in named.items():
        mine = frozenset((rid[0],))
        rows = [
            (g.utilization_ratio, g.memory_utilization_ratio, jobs_on.get(g.index, mine) <= mine)
            for g in devices
            if is_rank_gpu(g, names, held.get(rid, ()))
        ]
        reading = readings_for(now, rows)
        if reading is not None:
            out[rid] = reading
    return out


def confirm_by_peers(verdicts: Mapping[RankId, StallVerdict]) -> dict[RankId, StallVerdict]:
    """An ambiguous rank whose job has a rank stalled without ambiguity (on this node) is stalled:
    that peer holds the job's collectives, so the spinning rank waits for it."""
    out = dict(verdicts)
    sure: dict[str, list[int]] = collections.defaultdict(list)
    for v in verdicts.values():
        if v.alive and v.stalled and not v.ambiguous:
            sure[v.job_id].append(v.rank)
    for key, v in verdicts.items():
        if v.ambiguous and sure.get(v.job_id):
            peers = ", ".join(str(r) for r in sorted(sure[v.job_id])[:6])
            out[key] = replace(
                v,
                stalled=True,
                ambiguous=False,
                confirmed_by="peer",
                gpu_evidence=f"{v.gpu_evidence}; peer rank(s) {peers} of the job stalled without ambiguity".lstrip(
                    "; "
                ),
            )
    return out
