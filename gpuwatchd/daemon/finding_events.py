"""Finding transitions -> events: a rank that dies, stalls, leaks fds or starts holding the GIL
becomes one line in the event log (``state_dir/events.jsonl``, the journal), next to the OOM kills
and Xids of the kernel log, so that ``gpuwatchd events`` is the node's timeline.

Only transitions are written (raised, cleared), never the steady state. OOM kills and Xids are
events of the kernel log already and are not repeated here. Costs one set difference per cycle.
"""

from __future__ import annotations

from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.model import INFO, Finding, NodeState
from gpuwatchd.model.events import Event
from gpuwatchd.model.kinds import EVENT_KINDS
from gpuwatchd.units import fmt_clock

# Already events of their own (kernel_events.py): the rows of model/kinds.py with an ``event``.
SKIP_KINDS = EVENT_KINDS


def finding_event(f: Finding, now: float, cleared: bool = False) -> Event:
    pid = int(f.pid) if f.pid.isdigit() else None
    when = fmt_clock(f.since or now)
    return Event(
        key=f"finding:{'cleared' if cleared else 'raised'}:{f.kind}:{f.job_id}:{f.rank}:{f.pid}:"
        f"{f.since:.3f}:{hash(f.explanation) if f.kind == 'bad_rank_file' else ''}",
        kind=f"{f.kind} cleared" if cleared else f.kind,
        time=now if cleared else (f.since or now),
        severity=INFO if cleared else f.severity,
        summary=(f"no longer: {f.explanation} (active since {when})" if cleared else f.explanation),
        job_id=f.job_id,
        rank=f.rank,
        pid=pid,
    )


class FindingEventsSubsystem(Subsystem):
    name = "finding_events"

    def __init__(self, services: Services) -> None:
        self.events = services.events  # one writer (and its compaction): daemon/services.py
        # After a (re)start every active finding is logged once: the timeline then says what
        # the daemon found when it started.
        self._active: dict[tuple[str, str, str, str], Finding] = {}

    def after_join(self, daemon: DaemonContext, ranks: Ranks, state: NodeState) -> None:
        events = self.events
        now = daemon.clock()
        current = {f.key: f for f in state.findings if f.kind not in SKIP_KINDS}
        for key, f in current.items():
            if key not in self._active:
                events.add(finding_event(f, now))
        for key, f in self._active.items():
            if key not in current:
                events.add(finding_event(f, now, cleared=True))
        self._active = current
