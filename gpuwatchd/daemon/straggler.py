"""The straggler subsystem of the daemon: each cycle, the step rates of the heartbeat ranks
(join/straggler.py, from the heartbeat steps and cgroup cpu.stat that sources/step_cpu.py reads)
as ``steps`` (exported as ``gpuwatch_rank_step``) and ``StragglerOutput.rates``
(findings/rank_straggler.py). The track stage hands it the heartbeats as an argument; the step and
cpu.stat reads each run under ``guarded``.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatchd.config.schema import Config
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.isolation import guarded
from gpuwatchd.join.straggler import StragglerTracker
from gpuwatchd.model import CpuStat, RankId
from gpuwatchd.model.parts import StragglerOutput
from gpuwatchd.sources.step_cpu import StepCpuReader


class StragglerSubsystem(Subsystem):
    name = "straggler"

    def __init__(self, config: Config, services: Services) -> None:
        self.cfg = config.straggler
        self.tracker = StragglerTracker(self.cfg)
        self.reader = StepCpuReader(services.paths, services.heartbeat_roots.step)

    def track(self, daemon: DaemonContext, ranks: Ranks,
              heartbeats: Mapping[RankId, float]) -> StragglerOutput:  # fmt: skip
        """``heartbeats``: each accepted rank's heartbeat mtime (the daemon's reading)."""
        reader = self.reader
        entries = [e for e in ranks.entries if e.pid in ranks.processes]
        due = self.tracker.due(entries, heartbeats)  # read: sources, judged: the tracker
        # each read isolated: an unreadable step file or cpu.stat is "unknown" this cycle
        no_steps: dict[RankId, int | None] = {}
        no_cpu: dict[RankId, CpuStat | None] = {}
        steps = guarded("straggler: heartbeat steps", lambda: reader.steps(due), no_steps)
        cpu = guarded("straggler: cpu.stat", lambda: reader.cpu_stats(entries, ranks.cgroups), no_cpu)
        return StragglerOutput(*self.tracker.observe(ranks.now, entries, heartbeats, steps, cpu))
