"""One rank's place in the GIL schedule (daemon/gil.py): the target, its schedule record, and
why it is suspect. Pure values; the sampler holds its lock around every use of a record.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpuwatchd.daemon.gil_convoy import ConvoyHint
from gpuwatchd.daemon.gil_signals import RankSignals
from gpuwatchd.model import GilReading, RankId
from gpuwatchd.model.threads import ThreadInfo

HISTORY = 4  # readings kept per rank (the finding looks at the last two)
HOT_RATIO = 0.5  # a last sample at least this GIL-bound puts the rank ahead of the queue
QUIET_CYCLES = 3  # a signal that lapses for a cycle or two on a loaded node is no recovery


@dataclass(frozen=True)
class GilTarget:
    job_id: str
    rank: int
    pid: int

    @property
    def key(self) -> RankId:
        return RankId(self.job_id, self.rank)


@dataclass(frozen=True)
class GilPlan:
    """Where one rank stands in the schedule (``GilSampler.plan``): why it is suspect (empty:
    healthy), whether its next sample is a full one, and when it is due (sampler clock)."""

    key: RankId
    reasons: tuple[str, ...]
    full: bool
    next_due: float


@dataclass
class RankSchedule:
    target: GilTarget
    next_due: float
    last_sample: float | None = None
    in_flight: bool = False
    probe: tuple[float, tuple[ThreadInfo, ...]] | None = None
    history: deque[GilReading] = field(default_factory=lambda: deque(maxlen=HISTORY))
    convoy: ConvoyHint | None = None
    cpu_at: tuple[float, int] | None = None  # (probe time, process CPU ticks) of the last probe
    signals: RankSignals | None = None  # the last cycle's (daemon/gil_signals.py)
    last_full: float | None = None
    signalled: bool = False  # had a signal at the last turn (a turn pulls the next sample in)
    quiet: int = 0  # cycles in a row without a signal (a recovery needs QUIET_CYCLES of them)


def hot(sched: RankSchedule) -> bool:
    last = sched.history[-1] if sched.history else None
    return last is not None and last.samples > 0 and last.held / last.samples >= HOT_RATIO


def confirmed(sched: RankSchedule, ratio: float) -> bool:
    """Its last two readings held the GIL >= ``ratio``: what gil_saturated needs to be up."""
    last = list(sched.history)[-2:]
    return len(last) == 2 and all(r.samples > 0 and r.held / r.samples >= ratio for r in last)


def reasons(sched: RankSchedule) -> tuple[str, ...]:
    """Why ``sched`` is suspect; empty when it looks healthy."""
    out = list(sched.signals.reasons) if sched.signals is not None else []
    if sched.convoy is not None and sched.convoy.convoy:
        out.append("convoy")
    if sched.convoy is not None and sched.convoy.busy_thread:
        out.append("busy_thread")
    if hot(sched):
        out.append("gil_bound")
    return tuple(out)
