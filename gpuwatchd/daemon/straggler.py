"""The straggler subsystem of the daemon: each cycle, the step rates of the heartbeat ranks
(join/straggler.py, from the heartbeat steps and cgroup cpu.stat that sources/step_cpu.py reads)
as ``steps`` (exported as ``gpuwatch_rank_step``) and ``FindingContext.straggler``
(findings/straggler.py).
"""

from __future__ import annotations

from gpuwatchd.config import StragglerConfig
from gpuwatchd.daemon.subsystem import Contribution, DaemonContext, Subsystem
from gpuwatchd.join.state import CycleInputs
from gpuwatchd.join.straggler import StragglerTracker
from gpuwatchd.sources.step_cpu import StepCpuReader


class StragglerSubsystem(Subsystem):
    name = "straggler"

    def __init__(self, cfg: StragglerConfig) -> None:
        self.cfg = cfg
        self.tracker = StragglerTracker(cfg)
        self.reader: StepCpuReader | None = None

    def before_join(self, daemon: DaemonContext, cycle: CycleInputs) -> Contribution:
        if self.reader is None:
            self.reader = StepCpuReader(daemon.paths, daemon.heartbeat_roots.step)
        entries = [e for e in cycle.entries if e.pid in cycle.processes]
        due = self.tracker.due(entries, cycle.heartbeats)  # read: sources, judged: the tracker
        steps, rates = self.tracker.observe(cycle.now, entries, cycle.heartbeats, self.reader.steps(due),
                                            self.reader.cpu_stats(entries))
        return Contribution(steps=steps, straggler=rates)
