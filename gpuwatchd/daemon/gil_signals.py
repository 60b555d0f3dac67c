"""What the last cycle says about each rank, for the adaptive GIL schedule (daemon/gil.py).

Reads only the cycle's ``NodeState`` (the join's typed output: ``RankState.process.cpu_seconds``,
``progress_timestamp``, ``step``, ``stalled``, the rank's GPUs and their NVML utilisation), so it
costs no I/O at all: a few float operations per rank and cycle, and one small record per live
rank (forgotten when the rank goes).

A rank is *suspect* when a signal says its Python may be the bottleneck:
- ``gpu_idle_on_cpu``: the process used at least ``CPU_SUSPECT_CORES`` of a core over the last
  cycle while none of its GPUs is known busy (utilisation below the finding's ``GPU_BUSY_RATIO``,
  or unknown). A GIL-saturated rank is on CPU most of the time (py-spy counts a held tick only
  while the holder runs), so this is the signal that catches it in practice;
- ``heartbeat_slowing``: its step rate fell below half its running average, or its heartbeat is
  older than three times its usual age plus one cycle;
- ``stalled``: the stall tracker says so.
The last two count only while the process uses at least ``BEAT_CPU_CORES``: a rank that slows
down off CPU waits on something else (the stall detector's case), and on a loaded node every
rank's heartbeat jitters, which would pull in a full sample of each.
The sampler adds its own: a convoy hint, a thread at ~100 % of a core, a GIL-bound last sample.
A rank with a GPU known busy (>= ``GPU_BUSY_RATIO``) is healthy whatever else: ``gil_saturated``
cannot fire for it (findings/gil_saturated.py), and its threads are not read by the convoy probe either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwatchd.config.schema import GilConfig
from gpuwatchd.findings.gil_saturated import GPU_BUSY_RATIO, rank_gpu_utilization
from gpuwatchd.model import NodeState, RankId
from gpuwatchd.model.gpus import held_by_rank

CPU_SUSPECT_CORES = 0.3  # the lower end of the convoy band (daemon/gil.py CONVOY_CORES)
BEAT_CPU_CORES = 0.1  # a slowing heartbeat or a stall counts only with this much CPU
RATE_DROP = 0.5  # step rate below this share of its running average: slowing
AGE_FACTOR = 3.0  # heartbeat older than this many times its usual age (+ one cycle): slowing
EWMA = 0.2
GPU_IDLE_ON_CPU = "gpu_idle_on_cpu"
HEARTBEAT_SLOWING = "heartbeat_slowing"
STALLED = "stalled"


@dataclass(frozen=True)
class RankSignals:
    """One rank's signals from one cycle. ``reasons`` empty: healthy."""

    pid: int
    cpu_cores: float | None  # process CPU over the last cycle, in cores; None: not yet known
    gpu_busy: bool  # a GPU of the rank is known >= GPU_BUSY_RATIO busy (the finding cannot fire)
    reasons: tuple[str, ...] = ()


@dataclass
class _Track:
    pid: int
    at: float
    cpu_seconds: float
    step: int | None
    step_rate: float | None = None  # running average, steps per second
    beat_age: float | None = None  # running average of (now - last heartbeat)


class SignalTracker:
    """Turns consecutive ``NodeState``s into ``RankSignals`` per (job_id, rank)."""

    def __init__(self, cycle_seconds: float) -> None:
        self.cycle_seconds = cycle_seconds
        self._tracks: dict[RankId, _Track] = {}

    def observe(self, state: NodeState) -> dict[RankId, RankSignals]:
        now = state.timestamp
        out: dict[RankId, RankSignals] = {}
        live: set[RankId] = set()
        held = held_by_rank(state.gpu_processes)  # once: every rank below asks for its GPUs
        for r in state.ranks:
            if not r.alive or r.process is None:
                continue
            key = r.rank_id
            live.add(key)
            prev = self._tracks.get(key)
            if prev is not None and prev.pid != r.pid:
                prev = None
            reasons: list[str] = []
            cpu = None
            if prev is not None and now > prev.at:
                cpu = max(0.0, (r.process.cpu_seconds - prev.cpu_seconds) / (now - prev.at))
            utils = rank_gpu_utilization(r, state.gpus, state.gpu_processes, held)
            gpu_busy = bool(utils) and max(u for _, u in utils) >= GPU_BUSY_RATIO
            if cpu is not None and cpu >= CPU_SUSPECT_CORES and not gpu_busy:
                reasons.append(GPU_IDLE_ON_CPU)
            track = _Track(r.pid, now, r.process.cpu_seconds, r.step)
            on_cpu = cpu is not None and cpu >= BEAT_CPU_CORES
            if prev is not None:
                track.step_rate, track.beat_age = prev.step_rate, prev.beat_age
                if self._slowing(prev, track, now, r.progress_timestamp) and on_cpu:
                    reasons.append(HEARTBEAT_SLOWING)
            if r.stalled and on_cpu:
                reasons.append(STALLED)
            self._tracks[key] = track
            out[key] = RankSignals(r.pid, cpu, gpu_busy, tuple(reasons))
        for gone in set(self._tracks) - live:
            del self._tracks[gone]
        return out

    def _slowing(self, prev: _Track, track: _Track, now: float, beat: float | None) -> bool:
        """Update the running averages in ``track``; True when this cycle is well below them."""
        slowing = False
        if track.step is not None and prev.step is not None and track.step >= prev.step:
            rate = (track.step - prev.step) / (now - prev.at) if now > prev.at else 0.0
            avg = prev.step_rate
            slowing = avg is not None and avg > 0 and rate < RATE_DROP * avg
            if not slowing:  # a slow spell does not lower the average it is judged by
                track.step_rate = rate if avg is None else (1 - EWMA) * avg + EWMA * rate
        if beat is not None and math.isfinite(beat):
            age = max(0.0, now - beat)
            usual = prev.beat_age
            late = usual is not None and age > AGE_FACTOR * usual + self.cycle_seconds
            slowing = slowing or late
            if not late:
                track.beat_age = age if usual is None else (1 - EWMA) * usual + EWMA * age
        return slowing


def saturation_bound(gil: GilConfig, cycle_seconds: float, ranks: int, *, signals: bool,
                     suspects: int = 1, screen_seconds: float = 1.0,
                     max_duty: float = 0.2) -> float:  # fmt: skip
    """Worst-case seconds from "a rank becomes GIL-saturated" to ``gil_saturated`` raised.

    ``signals``: the rank shows a suspicious signal (CPU on while its GPU waits, ...); else it
    looks healthy until its screening sample. ``suspects``: ranks with suspicious signals at the
    time, this one included (1 <= suspects <= ranks); each one ahead of it in the queue costs a
    full sample of the budget. docs/architecture.md ("GIL sampling") derives it; tests/
    test_gil_adaptive.py measures it on real processes.
    """
    t, i, d, h, u, s = (cycle_seconds, gil.interval_seconds, gil.duration_seconds,
                        gil.healthy_interval_seconds, max_duty, screen_seconds)  # fmt: skip
    k = max(1, min(suspects, ranks))
    first_wait = (k * d + s) / u  # the queue ahead of it: the other suspects, one screening
    confirm_wait = 2 * d / u  # GIL-bound ranks go first: one other sample, then its own tokens
    if signals:
        # its next full sample is due within interval +20 % of its last one (a rank that turns
        # suspect: two cycles to see the signal, a CPU rate needs two readings, then a quarter
        # interval at most since its last full sample), the queue, the sample; the next one
        # interval +20 % later goes first; then one cycle for the finding
        return 3 * t + 2.4 * i + first_wait + d + confirm_wait + d
    # no signal: its screening is due within healthy_interval +20 % (the first one within
    # healthy_interval of registration), waits behind every other rank's screening and the
    # suspects; a GIL-bound screening asks for a full sample at once; one cycle for the finding
    screens_wait = (k * d + ranks * s) / u
    return 1.2 * h + screens_wait + s + confirm_wait + d + t
