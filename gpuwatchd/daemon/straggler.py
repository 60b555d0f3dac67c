"""The straggler subsystem of the daemon: each cycle, the step rates of the heartbeat ranks
(join/straggler.py, which reads their heartbeat steps and cgroup cpu.stat) as ``steps`` (exported as
``gpuwatch_rank_step``) and ``FindingContext.straggler`` (findings/straggler.py).
"""

from __future__ import annotations

from gpuwatchd.config import StragglerConfig
from gpuwatchd.daemon.subsystem import Contribution, DaemonContext, Subsystem
from gpuwatchd.join.state import CycleInputs
from gpuwatchd.join.straggler import StragglerTracker


class StragglerSubsystem(Subsystem):
    name = "straggler"

    def __init__(self, cfg: StragglerConfig) -> None:
        self.cfg = cfg
        self.tracker: StragglerTracker | None = None

    def before_join(self, daemon: DaemonContext, cycle: CycleInputs) -> Contribution:
        if self.tracker is None:
            self.tracker = StragglerTracker(self.cfg, daemon.paths, daemon.heartbeat_roots.step)
        entries = [e for e in cycle.entries if e.pid in cycle.processes]
        steps, rates = self.tracker.observe(cycle.now, entries, cycle.heartbeats)
        return Contribution(steps=steps, straggler=rates)
