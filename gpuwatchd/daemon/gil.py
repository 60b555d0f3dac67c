"""GIL sampling scheduler: every watched rank, on a jittered schedule, sooner on a convoy hint.

Each rank gets a ``py-spy record --gil --nonblocking`` window of ``gil.duration_seconds`` every
``gil.interval_seconds`` (±20 % jitter, first sample spread over one interval so that 64 ranks do
not start together). Between samples a cheap /proc probe (``/proc/PID/task/*/stat``, ``wchan``; a
few µs per thread, no ptrace) looks for the GIL-convoy signature measured in research §2.3: several
threads each on CPU about 1/N of the time, the process at about one core in total, the waiters
parked in ``futex``. A rank that shows it is sampled soon (not sooner than a quarter interval after
its last sample), so that the counters catch contention without paying for constant sampling.

Bounds: at most ``gil.max_concurrent - 1`` records at once (one py-spy slot stays free for the
stall detector's dumps), and at most ``MAX_SAMPLING_DUTY`` sampled seconds per second over all
ranks (a token bucket: with many ranks each is sampled less often than the interval, convoy hints
first). A non-Python rank is retried ten intervals later. Cost on the daemon's side: py-spy used
0.012-0.018 CPU-s per sampled second (bench/gil_overhead.py); on the target: no stop at all.

Results are ``model.GilReading`` per (job_id, rank), kept with a short history for the
``gil_saturated`` finding, and the counters ``rank_gil_samples`` / ``rank_gil_held_samples``
(exported as ``gpuwatch_rank_gil_samples_total`` / ``..._held_samples_total``; the GIL-held ratio
is ``rate(held) / rate(samples)``). Top GIL-holding functions stay in the reading (explanations,
``doctor``), never in labels.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from gpuwatchd.counters import CounterStore
from gpuwatchd.join.stall import MAX_PROBE_THREADS
from gpuwatchd.model import CollectorStatus, GilReading
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy, PySpyError, ThreadInfo

log = logging.getLogger(__name__)

HISTORY = 4  # readings kept per rank (the finding looks at the last two)
# The daemon's sampling budget: py-spy costs ~0.012-0.018 CPU-s per sampled second
# (bench/gil_overhead.py), so sampling at most 20 % of the time keeps py-spy under ~0.25 % of a
# core however many ranks are watched (issue 14: <= 0.5 % with the daemon); with many ranks each
# is sampled less often than gil.interval_seconds, convoy hints and GIL-bound ranks first.
# Bound: a rank that becomes GIL-saturated is sampled within N * duration / MAX_SAMPLING_DUTY
# (N ranks; sooner on a convoy hint), and, being hot, again ahead of the others once its next
# sample is due (interval +- 20 %): gil_saturated is raised within
# N * duration / MAX_SAMPLING_DUTY + 1.2 * interval + 2 * duration (64 ranks, defaults: 1646 s;
# 8 ranks: 246 s).
MAX_SAMPLING_DUTY = 0.2
HOT_RATIO = 0.5  # a last sample at least this GIL-bound puts the rank ahead of the queue
JITTER = 0.2
DEFERRED_KINDS = ("threads", "dump")
CONVOY_CORES = (0.3, 1.4)  # a GIL convoy uses about one core in total (see convoy_hint)


@dataclass(frozen=True)
class GilTarget:
    job_id: str
    rank: int
    pid: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.rank)


@dataclass(frozen=True)
class ConvoyHint:
    """The /proc convoy signature of one process over one probe window."""

    busy_threads: int  # threads that got > 5 % of a core
    total_cores: float  # CPU of all threads together, in cores
    futex_parked: int  # busy threads that sat in a futex wait at the probe
    convoy: bool


@dataclass
class _RankSchedule:
    target: GilTarget
    next_due: float
    last_sample: float | None = None
    in_flight: bool = False
    probe: tuple[float, tuple[ThreadInfo, ...]] | None = None
    history: deque[GilReading] = field(default_factory=lambda: deque(maxlen=HISTORY))
    by_thread: tuple[tuple[int, str, int], ...] = ()
    convoy: ConvoyHint | None = None
    error: str = ""
    cpu_at: tuple[float, int] | None = None  # (probe time, process CPU ticks) of the last probe


def convoy_hint(
    before: tuple[ThreadInfo, ...], after: tuple[ThreadInfo, ...], seconds: float, clk_tck: int
) -> ConvoyHint:
    """Compare two thread snapshots ``seconds`` apart (research §2.3).

    Convoy: >= 2 busy threads sharing the CPU about evenly (each 0.4-2.5 times the mean share),
    together 0.3-1.4 cores (they share one GIL; real parallelism adds up to more; the lower bound is
    low because a loaded node gives the convoy less than a core), and at least half of them found
    parked in a futex. Kernel wchan names differ (``futex_wait_queue_me`` <= 5.x, ``futex_do_wait`` 6.18),
    so any wchan containing "futex" counts.
    """
    if seconds <= 0:
        return ConvoyHint(0, 0.0, 0, False)
    prev = {t.tid: t.cpu_ticks for t in before}
    shares = []
    parked = 0
    for t in after:
        if t.tid not in prev:
            continue
        share = (t.cpu_ticks - prev[t.tid]) / clk_tck / seconds
        if share > 0.05:
            shares.append(share)
            if t.state == "S" and "futex" in t.wchan:
                parked += 1
    n = len(shares)
    total = sum(shares)
    convoy = (
        n >= 2
        and CONVOY_CORES[0] <= total <= CONVOY_CORES[1]
        and all(0.4 * total / n <= s <= 2.5 * total / n for s in shares)
        and parked >= max(1, n // 2)
    )
    return ConvoyHint(n, round(total, 3), parked, convoy)


def _hot(sched: _RankSchedule) -> bool:
    last = sched.history[-1] if sched.history else None
    return last is not None and last.samples > 0 and last.held / last.samples >= HOT_RATIO


class GilSampler:
    """Schedules py-spy GIL samples over the watched ranks. Thread-safe.

    ``update_targets`` each cycle with the live ranks; ``tick`` starts what is due (the daemon's
    background thread calls it about once a second; tests call ``sample_now``).
    """

    def __init__(
        self,
        spy: PySpy,
        counters: CounterStore,
        *,
        interval_seconds: float = 30.0,
        duration_seconds: float = 5.0,
        rate_hz: int = 50,
        max_concurrent: int = 2,
        paths: HostPaths | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        probe_seconds: float = 2.0,
        max_duty: float | None = None,
    ) -> None:
        """``max_duty``: at most this many sampled seconds per wall-clock second over all ranks
        (a token bucket); None: bounded by ``max_concurrent`` only."""
        self.spy = spy
        self.max_duty = max_duty
        self._tokens = 2 * duration_seconds
        self._tokens_at = clock()
        self.counters = counters
        self.interval = interval_seconds
        self.duration = duration_seconds
        self.rate_hz = rate_hz
        self.paths = paths or spy.paths
        self.clock = clock
        self.rng = rng or random.Random()
        self.probe_seconds = probe_seconds
        # one py-spy slot stays free for the stall detector's short dumps when there are two or more
        self._pool = ThreadPoolExecutor(max(1, max_concurrent - 1), thread_name_prefix="gil-sample")
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], _RankSchedule] = {}
        self._clk_tck = os.sysconf("SC_CLK_TCK")
        self._status = CollectorStatus(pyspy.COLLECTOR, True, 0.0, None, "")
        self._ok_runs = 0
        self._closed = False
        self._last_success: float | None = None

    # -- targets and schedule ----------------------------------------------------------------

    def update_targets(self, targets: Iterable[GilTarget]) -> None:
        now = self.clock()
        with self._lock:
            wanted = {t.key: t for t in targets}
            for key in list(self._ranks):
                if key not in wanted or self._ranks[key].target.pid != wanted[key].pid:
                    del self._ranks[key]
            for key, t in wanted.items():
                if key not in self._ranks:
                    # spread first samples over one interval
                    first = now + self.rng.uniform(0, self.interval)
                    self._ranks[key] = _RankSchedule(t, next_due=first)
                    labels = (t.job_id, str(t.rank))
                    self.counters.ensure("rank_gil_samples", labels)
                    self.counters.ensure("rank_gil_held_samples", labels)

    def _probe(self, now: float) -> None:
        """Cheap /proc probe of each rank; a convoy pulls its next sample forward.

        Per process and probe: one ``/proc/PID/stat`` read; the per-thread look (capped at
        ``stall.MAX_PROBE_THREADS`` tasks) only while the process as a whole uses CPU in the
        convoy band (0.3-1.4 cores with two or more threads), because a convoy outside it is
        impossible. A PID listed by several ranks is read once per probe round."""
        cpu_memo: dict[int, tuple[int, int] | None] = {}
        thread_memo: dict[int, tuple[ThreadInfo, ...]] = {}
        for sched in list(self._ranks.values()):
            if sched.in_flight:
                continue
            last = sched.probe
            if sched.cpu_at is not None and now - sched.cpu_at[0] < self.probe_seconds:
                continue
            pid = sched.target.pid
            if pid not in cpu_memo:
                cpu_memo[pid] = pyspy.process_cpu(self.paths, pid)
            cpu = cpu_memo[pid]
            prev_cpu, sched.cpu_at = sched.cpu_at, (now, cpu[0]) if cpu is not None else None
            in_band = (
                cpu is not None and prev_cpu is not None and cpu[1] >= 2 and now > prev_cpu[0]
                and CONVOY_CORES[0] <= (cpu[0] - prev_cpu[1]) / self._clk_tck / (now - prev_cpu[0])
                <= CONVOY_CORES[1]
            )  # fmt: skip
            if not in_band:
                sched.probe = None  # the next in-band look starts a fresh thread comparison
                continue
            if pid not in thread_memo:
                thread_memo[pid] = pyspy.read_threads(self.paths, pid, detail=False,
                                                      limit=MAX_PROBE_THREADS)  # fmt: skip
            threads = thread_memo[pid]
            if last is not None and threads:
                hint = convoy_hint(last[1], threads, now - last[0], self._clk_tck)
                sched.convoy = hint
                soonest = (sched.last_sample or -1e18) + self.interval / 4
                if hint.convoy and sched.next_due > max(now, soonest):
                    sched.next_due = max(now + self.rng.uniform(0, 1.0), soonest)
                    log.debug("GIL convoy hint for %s: %s", sched.target, hint)
            sched.probe = (now, threads)

    def due(self) -> list[GilTarget]:
        """Targets whose sample is due, most overdue first (convoy hints first of all), limited
        by the sampling budget when one is set."""
        now = self.clock()
        with self._lock:
            self._probe(now)
            ready = sorted(
                (s for s in self._ranks.values() if not s.in_flight and s.next_due <= now),
                # convoy hints first, then ranks whose last sample held the GIL >= HOT_RATIO (the
                # second high sample is what raises gil_saturated), then the most overdue
                key=lambda s: (not (s.convoy and s.convoy.convoy), not _hot(s), s.next_due),
            )
            if self.max_duty is not None:
                cap = 2 * self.duration
                self._tokens = min(cap, self._tokens + (now - self._tokens_at) * self.max_duty)
                self._tokens_at = now
                allowed = []
                for s in ready:
                    if self._tokens < self.duration:
                        break
                    self._tokens -= self.duration
                    allowed.append(s)
                ready = allowed
            return [s.target for s in ready]

    def tick(self) -> list[Future[None]]:
        """Start every due sample on the pool; returns the futures (tests wait on them)."""
        futures = []
        for target in self.due():
            with self._lock:
                sched = self._ranks.get(target.key)
                if sched is None or sched.in_flight:
                    continue
                if self._closed:  # stopping: the pool takes no more work (not a crash)
                    break
                sched.in_flight = True
                futures.append(self._pool.submit(self._sample, target))
        return futures

    def sample_now(self, target: GilTarget) -> GilReading | None:
        """Sample one target synchronously (tests, ``doctor``); also schedules it."""
        if target.key not in self._ranks:
            self.update_targets([*self.targets(), target])
        with self._lock:
            self._ranks[target.key].in_flight = True
        self._sample(target)
        return self.latest(target.key)

    def targets(self) -> list[GilTarget]:
        with self._lock:
            return [s.target for s in self._ranks.values()]

    # -- one sample ------------------------------------------------------------------------------

    def _sample(self, target: GilTarget) -> None:
        t0 = time.monotonic()
        sample: pyspy.GilSample | None = None
        error: PySpyError | None = None
        try:
            sample = self.spy.record_gil(target.pid, self.rate_hz, self.duration)
        except PySpyError as e:
            error = e
        now = self.clock()
        with self._lock:
            sched = self._ranks.get(target.key)
            if sched is not None:
                sched.in_flight = False
                sched.last_sample = now
                sched.next_due = now + self.interval * self.rng.uniform(1 - JITTER, 1 + JITTER)
            if sample is not None:
                reading = sample.reading()
                labels = (target.job_id, str(target.rank))
                self.counters.inc("rank_gil_samples", labels, reading.samples)
                self.counters.inc("rank_gil_held_samples", labels, reading.held)
                if sched is not None:
                    sched.history.append(reading)
                    sched.by_thread = sample.by_thread
                    sched.error = ""
                self._last_success = time.time()
                self._status = CollectorStatus(
                    pyspy.COLLECTOR, True, time.monotonic() - t0, self._last_success, ""
                )
            elif error is not None:
                if sched is not None:
                    sched.error = str(error)
                    if error.reason == pyspy.NOT_PYTHON:
                        # a shell or native rank: nothing to sample, ask again much later
                        sched.next_due = now + 10 * self.interval
                if error.collector_down:
                    self._status = CollectorStatus(
                        pyspy.COLLECTOR, False, time.monotonic() - t0, self._last_success,
                        str(error)[:300],
                    )  # fmt: skip
                    log.warning("GIL sample of pid %d failed: %s", target.pid, error)
                else:
                    log.debug("GIL sample of pid %d skipped: %s", target.pid, error)

    # -- results ---------------------------------------------------------------------------------

    def latest(self, key: tuple[str, int]) -> GilReading | None:
        with self._lock:
            sched = self._ranks.get(key)
            return sched.history[-1] if sched and sched.history else None

    def readings(self) -> Mapping[tuple[str, int], tuple[GilReading, ...]]:
        """(job_id, rank) -> its recent readings, oldest first (what findings/gil.py reads)."""
        with self._lock:
            return {k: tuple(s.history) for k, s in self._ranks.items() if s.history}

    def convoys(self) -> Mapping[tuple[str, int], ConvoyHint]:
        with self._lock:
            return {k: s.convoy for k, s in self._ranks.items() if s.convoy is not None}

    def status(self) -> CollectorStatus:
        with self._lock:
            return self._status

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
