"""GIL sampling scheduler: suspect ranks often and in full, healthy ones rarely and briefly.

Adaptive (the daemon's mode, ``healthy_interval_seconds`` set): a *suspect* rank (a signal of
daemon/gil_signals.py: on CPU while its GPU waits, heartbeat slowing, stalled; or of this module:
a convoy hint, a thread at ~100 % of a core, a last sample that held the GIL >= ``HOT_RATIO``)
gets a full ``py-spy record --gil --nonblocking`` of ``gil.duration_seconds`` at ``gil.rate_hz``
every ``gil.interval_seconds``, ahead of the others, and is sampled at once when it turns suspect
(not sooner than a quarter interval after its last full sample). A healthy rank gets a screening
(``SCREEN_SECONDS`` at ``SCREEN_RATE_HZ``; py-spy costs ~11-16 ms a run plus ~0.17 ms a tick,
bench/gil_adaptive.py) every ``gil.healthy_interval_seconds``; a GIL-bound screening asks for a
full sample at once. A healthy rank whose process used less than ``CPU_SUSPECT_CORES`` of a core
over the last cycle is not screened until it is on CPU again: its held ratio cannot reach
``HOT_RATIO`` (``_idle``). Both readings count. A rank whose ``gil_saturated`` is up gets a full sample
every ``CONFIRMED_FACTOR`` intervals until its signals turn. Waits are jittered ±20 %; a new rank's first sample is
spread over one healthy interval (no burst when 64 ranks start). Worst-case time to
``gil_saturated``: ``gil_signals.saturation_bound`` (docs/architecture.md, "GIL sampling").
Without ``healthy_interval_seconds`` every rank gets a full sample every interval.

Between samples a cheap /proc probe (``/proc/PID/task/*/stat``, ``wchan``; a few µs per thread,
no ptrace) looks for the GIL-convoy signature (daemon/gil_convoy.py, research §2.3). It takes the
process CPU from the cycle's signals when it has them, and reads threads only while that CPU is
in the convoy band and no GPU of the rank is busy. A convoy pulls the next sample forward.

Bounds: at most ``gil.max_concurrent - 1`` records at once (one py-spy slot stays free for the
stall detector's dumps), and at most ``MAX_SAMPLING_DUTY`` sampled seconds per second over all
ranks (a token bucket: convoy hints first, then GIL-bound ranks, then suspect ones). A non-Python
rank is retried ten intervals later. On the target: no stop at all.

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
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.gil_convoy import CONVOY_CORES, ConvoyHint, convoy_hint
from gpuwatchd.daemon.gil_schedule import (
    QUIET_CYCLES,
    GilPlan,
    GilTarget,
    RankSchedule,
    confirmed,
    hot,
    reasons,
)
from gpuwatchd.daemon.gil_signals import CPU_SUSPECT_CORES, RankSignals
from gpuwatchd.join.stall import MAX_PROBE_THREADS
from gpuwatchd.model import CollectorStatus, GilReading, RankId
from gpuwatchd.model.threads import ThreadInfo
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import COLLECTOR, NOT_PYTHON, GilSample, PySpyError
from gpuwatchd.sources.threads import process_cpu, read_threads

log = logging.getLogger(__name__)

# The daemon's sampling budget in sampled seconds per second over all ranks: with the adaptive
# schedule it binds only when many ranks are suspect at once (gil_signals.saturation_bound).
MAX_SAMPLING_DUTY = 0.2
JITTER = 0.2
DEFERRED_KINDS = ("threads", "dump")
SCREEN_SECONDS = 1.0  # a healthy rank's screening sample (py-spy takes whole seconds)
SCREEN_RATE_HZ = 20  # 19 ticks: enough to tell >= HOT_RATIO from a healthy rank
# a rank whose finding is up: a full sample every 4 intervals while its signals stay the same
# (a recovery shows there first: its CPU drops or its GPU gets busy)
CONFIRMED_FACTOR = 4
__all__ = ["GilSampler"]


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
        healthy_interval_seconds: float | None = None,
        screen_seconds: float = SCREEN_SECONDS,
        screen_rate_hz: int = SCREEN_RATE_HZ,
        confirmed_ratio: float | None = None,
    ) -> None:
        """``max_duty``: at most this many sampled seconds per wall-clock second over all ranks
        (a token bucket); None: bounded by ``max_concurrent`` only. ``healthy_interval_seconds``:
        the adaptive schedule (healthy ranks screened this often); None: every rank in full every
        ``interval_seconds``. ``confirmed_ratio`` (gil.held_threshold): a rank whose last two
        samples held the GIL at least this much (gil_saturated is up) is sampled
        ``CONFIRMED_FACTOR`` times less often while its signals stay the same."""
        self.confirmed_ratio = confirmed_ratio
        self.spy = spy
        self.healthy_interval = healthy_interval_seconds
        # never longer than a full sample: the token bucket holds two full samples' worth
        self.screen_seconds = min(screen_seconds, duration_seconds)
        self.screen_rate_hz = min(screen_rate_hz, rate_hz)
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
        self._ranks: dict[RankId, RankSchedule] = {}
        self._clk_tck = os.sysconf("SC_CLK_TCK")
        self._status = CollectorStatus(COLLECTOR, True, 0.0, None, "")
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
                    # spread first samples over one (healthy) interval; a rank that turns out
                    # suspect is pulled forward by update_signals / the convoy probe
                    first = now + self.rng.uniform(0, self.healthy_interval or self.interval)
                    self._ranks[key] = RankSchedule(t, next_due=first)
                    labels = (t.job_id, str(t.rank))
                    self.counters.ensure("rank_gil_samples", labels)
                    self.counters.ensure("rank_gil_held_samples", labels)

    def update_signals(self, signals: Mapping[RankId, RankSignals]) -> None:
        """The cycle's signals per (job_id, rank) (daemon/gil_signals.py). A rank that turns
        suspect, or loses its last signal while GIL-bound (it recovers), is due at once,
        but not sooner than a quarter interval after its last full sample; a rank that turns
        healthy keeps the sample it has, the one after comes later."""
        now = self.clock()
        with self._lock:
            for key, sig in signals.items():
                sched = self._ranks.get(key)
                if sched is None or sched.target.pid != sig.pid:
                    continue
                sched.signals = sig
                self._look(sched, now, cycle=True)

    def _look(self, sched: RankSchedule, now: float, cycle: bool = False) -> None:
        # a turn (no signal -> some, or some -> none for QUIET_CYCLES cycles), not a change among
        # signals: a GIL-bound rank's heartbeat, convoy hints and, on a loaded node, its CPU
        # flicker, and each flicker would pull a full sample in
        signalled = any(r != "gil_bound" for r in reasons(sched))
        if cycle:
            sched.quiet = 0 if signalled else sched.quiet + 1
        turned = (signalled and not sched.signalled) or (
            sched.signalled and not signalled and sched.quiet >= QUIET_CYCLES
        )
        if not turned:
            return
        sched.signalled = signalled
        if (self._full(sched) and not sched.in_flight
                and self.healthy_interval is not None):  # fmt: skip
            soonest = (sched.last_full or -1e18) + self.interval / 4
            if sched.next_due > max(now, soonest):
                sched.next_due = max(now, soonest)
                log.debug("GIL sample of %s pulled forward: %s", sched.target, reasons(sched))

    def _full(self, sched: RankSchedule) -> bool:
        """Is the next sample of ``sched`` a full one (suspect, or no adaptive schedule)?"""
        return self.healthy_interval is None or bool(reasons(sched))

    def _idle(self, sched: RankSchedule) -> bool:
        """Is ``sched`` a healthy rank whose screening would say nothing? Its process used less
        than ``CPU_SUSPECT_CORES`` of a core over the last cycle: py-spy counts a held tick only
        while the holder runs, so its held ratio stays below that share, short of ``HOT_RATIO``
        (no full sample would follow) and of ``gil.held_threshold`` (no finding). Its screening
        waits, overdue, until the rank is on CPU again; a rank whose CPU is not known yet is
        screened as before."""
        sig = sched.signals
        return (not self._full(sched) and sig is not None and sig.cpu_cores is not None
                and sig.cpu_cores < CPU_SUSPECT_CORES)  # fmt: skip

    def _cost(self, sched: RankSchedule) -> float:
        return self.duration if self._full(sched) else self.screen_seconds

    def plan(self) -> list[GilPlan]:
        """Every rank's place in the schedule (tests, ``doctor``, debugging)."""
        with self._lock:
            return [GilPlan(k, reasons(s), self._full(s), s.next_due)
                    for k, s in self._ranks.items()]  # fmt: skip

    def _probe(self, now: float) -> None:
        """Cheap /proc probe of each rank; a convoy pulls its next sample forward.

        Per process and probe: one ``/proc/PID/stat`` read, none when the cycle's signals give
        the process CPU; the per-thread look (capped at ``stall.MAX_PROBE_THREADS`` tasks) only
        while the process as a whole uses CPU in the convoy band (0.3-1.4 cores), because a
        convoy outside it is impossible, and no GPU of the rank is known busy (gil_saturated
        cannot fire then). A PID listed by several ranks is read once per probe round."""
        cpu_memo: dict[int, tuple[int, int] | None] = {}
        thread_memo: dict[int, tuple[ThreadInfo, ...]] = {}
        for sched in list(self._ranks.values()):
            if sched.in_flight:
                continue
            last = sched.probe
            if sched.cpu_at is not None and now - sched.cpu_at[0] < self.probe_seconds:
                continue
            pid = sched.target.pid
            sig = sched.signals
            if sig is not None:  # the cycle read the process already
                sched.cpu_at = (now, 0)
                in_band = (not sig.gpu_busy and sig.cpu_cores is not None
                           and CONVOY_CORES[0] <= sig.cpu_cores <= CONVOY_CORES[1])  # fmt: skip
            else:
                if pid not in cpu_memo:
                    cpu_memo[pid] = process_cpu(self.paths, pid)
                cpu = cpu_memo[pid]
                prev_cpu, sched.cpu_at = sched.cpu_at, (now, cpu[0]) if cpu is not None else None
                in_band = (
                    cpu is not None and prev_cpu is not None and cpu[1] >= 2 and now > prev_cpu[0]
                    and CONVOY_CORES[0] <= (cpu[0] - prev_cpu[1]) / self._clk_tck
                    / (now - prev_cpu[0]) <= CONVOY_CORES[1]
                )  # fmt: skip
            if not in_band:
                if sig is not None:  # out of the band now: no convoy (and no longer suspect)
                    sched.convoy = None
                sched.probe = None  # the next in-band look starts a fresh thread comparison
                continue
            if pid not in thread_memo:
                thread_memo[pid] = read_threads(self.paths, pid, detail=False,
                                                      limit=MAX_PROBE_THREADS)  # fmt: skip
            threads = thread_memo[pid]
            if last is not None and threads:
                hint = convoy_hint(last[1], threads, now - last[0], self._clk_tck)
                sched.convoy = hint
                soonest = (sched.last_sample or -1e18) + self.interval / 4
                # a rank whose last sample was GIL-bound already has its answer: interval cadence
                if hint.convoy and not hot(sched) and sched.next_due > max(now, soonest):
                    sched.next_due = max(now + self.rng.uniform(0, 1.0), soonest)
                    log.debug("GIL convoy hint for %s: %s", sched.target, hint)
                self._look(sched, now)
            sched.probe = (now, threads)

    def due(self) -> list[GilTarget]:
        """Targets whose sample is due, most overdue first (convoy hints first of all, then
        GIL-bound ranks, then suspect ones), limited by the sampling budget when one is set: a
        full sample costs ``duration`` tokens, a screening ``screen_seconds``."""
        now = self.clock()
        with self._lock:
            self._probe(now)
            ready = sorted(
                (s for s in self._ranks.values()
                 if not s.in_flight and s.next_due <= now and not self._idle(s)),
                # convoy hints first, then ranks whose last sample held the GIL >= HOT_RATIO (the
                # second high sample is what raises gil_saturated), then the most overdue
                key=lambda s: (not (s.convoy and s.convoy.convoy), not hot(s), not self._full(s),
                               s.next_due),
            )  # fmt: skip
            if self.max_duty is not None:
                cap = 2 * self.duration
                self._tokens = min(cap, self._tokens + (now - self._tokens_at) * self.max_duty)
                self._tokens_at = now
                allowed = []
                for s in ready:
                    cost = self._cost(s)
                    if self._tokens < cost:
                        break
                    self._tokens -= cost
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
        self._sample(target, full=True)
        return self.latest(target.key)

    def targets(self) -> list[GilTarget]:
        with self._lock:
            return [s.target for s in self._ranks.values()]

    # -- one sample ------------------------------------------------------------------------------

    def _sample(self, target: GilTarget, full: bool | None = None) -> None:
        """One sample. Whatever it raises, the rank is not left in flight (it would never be
        sampled again: its GIL counters froze for good when an error escaped)."""
        try:
            self._sample_once(target, full)
        except BaseException:
            with self._lock:
                sched = self._ranks.get(target.key)
                if sched is not None and sched.in_flight:
                    sched.in_flight = False
                    sched.next_due = self.clock() + self.interval
            raise

    def _sample_once(self, target: GilTarget, full: bool | None) -> None:
        t0 = time.monotonic()
        sample: GilSample | None = None
        error: PySpyError | None = None
        if full is None:
            with self._lock:
                sched = self._ranks.get(target.key)
                full = sched is None or self._full(sched)
        rate, seconds = ((self.rate_hz, self.duration) if full
                         else (self.screen_rate_hz, self.screen_seconds))  # fmt: skip
        try:
            sample = self.spy.record_gil(target.pid, rate, seconds)
        except PySpyError as e:
            error = e
        now = self.clock()
        with self._lock:
            sched = self._ranks.get(target.key)
            if sched is not None:
                sched.in_flight = False
                sched.last_sample = now
                if full:
                    sched.last_full = now
            if sample is not None:
                reading = sample.reading()
                labels = (target.job_id, str(target.rank))
                self.counters.inc("rank_gil_samples", labels, reading.samples)
                self.counters.inc("rank_gil_held_samples", labels, reading.held)
                if sched is not None:
                    sched.history.append(reading)
            if sched is not None:
                self._reschedule(sched, now, full)
            if sample is not None:
                self._last_success = time.time()
                self._status = CollectorStatus(COLLECTOR, True, time.monotonic() - t0, self._last_success, "")
            elif error is not None:
                if sched is not None and error.reason == NOT_PYTHON:
                    # a shell or native rank: nothing to sample, ask again much later
                    sched.next_due = now + 10 * self.interval
                if error.collector_down:
                    self._status = CollectorStatus(
                        COLLECTOR, False, time.monotonic() - t0, self._last_success,
                        str(error)[:300],
                    )  # fmt: skip
                    log.warning("GIL sample of pid %d failed: %s", target.pid, error)
                else:
                    log.debug("GIL sample of pid %d skipped: %s", target.pid, error)

    def _reschedule(self, sched: RankSchedule, now: float, full: bool) -> None:
        if not full and hot(sched):
            sched.next_due = now  # a GIL-bound screening: the full sample at once
            return
        every = self.interval if self._full(sched) else (self.healthy_interval or self.interval)
        if (self.confirmed_ratio is not None and self.healthy_interval is not None
                and confirmed(sched, self.confirmed_ratio)):  # fmt: skip
            every = CONFIRMED_FACTOR * self.interval
        sched.next_due = now + every * self.rng.uniform(1 - JITTER, 1 + JITTER)
        log.debug(
            "GIL %s sample of %s done, next in %.0f s",
            "full" if full else "screening",
            sched.target,
            sched.next_due - now,
        )

    # -- results ---------------------------------------------------------------------------------

    def latest(self, key: RankId) -> GilReading | None:
        with self._lock:
            sched = self._ranks.get(key)
            return sched.history[-1] if sched and sched.history else None

    def readings(self) -> Mapping[RankId, tuple[GilReading, ...]]:
        """(job_id, rank) -> its recent readings, oldest first (what findings/gil_saturated.py reads)."""
        with self._lock:
            return {k: tuple(s.history) for k, s in self._ranks.items() if s.history}

    def convoys(self) -> Mapping[RankId, ConvoyHint]:
        with self._lock:
            return {k: s.convoy for k, s in self._ranks.items() if s.convoy is not None}

    def status(self) -> CollectorStatus:
        with self._lock:
            return self._status

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
