"""The daemon's stall part: the stall tracker (join/stall.py) and the GIL sampler (daemon/gil.py)
wired into the cycle (config ``stall:`` and ``gil:``), both built with the part. Each cycle it
probes every live rank (heartbeat, /proc state), hands the stall tracker this cycle's GPU readings
of each rank (the nvml part's output, which the track stage hands it: the spin rules' evidence) and
the sampler the live ranks, and returns the progress and stall verdicts, the GIL readings (for
findings/gil_saturated.py and findings/stall.py) and the ``pyspy`` collector status. After the join it hands
the sampler each rank's signals from the new ``NodeState`` (daemon/gil_signals.py: CPU while the
GPU waits, heartbeat slowing, stalled), which is what makes the schedule adaptive. The stall
tracker's py-spy looks run inside this part's isolation (its dumps with their own time-outs and
cycle budget).

One part, not a stall part and a GIL part: the ``pyspy`` collector status is the
sampler's when GIL sampling is on and the runner's availability when it is off, one producer
either way; the part's name is the label a failed start or track is exported under; and the
sampler's targets are this cycle's live probes, handed over before the stall looks take the
runner's slots. Split in two, ``pyspy`` would have two producers (or a new label) and the targets
would arrive after the looks.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping

from gpuwatchd.config.schema import Config
from gpuwatchd.daemon.gil import DEFERRED_KINDS, MAX_SAMPLING_DUTY, GilSampler
from gpuwatchd.daemon.gil_schedule import GilTarget
from gpuwatchd.daemon.gil_signals import SignalTracker
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.isolation import run_forever
from gpuwatchd.join.stall import StallTracker
from gpuwatchd.join.stall_spin import GpuReading
from gpuwatchd.model import CollectorStatus, NodeState, ProcessInfo, RankId, rank_alive
from gpuwatchd.model.parts import StallOutput
from gpuwatchd.model.stall import RankProbe
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import ABSENT, COLLECTOR
from gpuwatchd.sources.stall_looks import StallLooks

log = logging.getLogger(__name__)


class StallSubsystem(Subsystem):
    """The daemon's stall part: stall verdicts per cycle, GIL sampling in background threads.

    ``track`` returns ``progress`` / ``stalled`` per (job_id, rank) (exported as
    ``gpuwatch_rank_progress_timestamp_seconds`` / ``gpuwatch_rank_stalled``), the readings for
    findings/gil_saturated.py and findings/stall.py (``StallOutput.gil``, ``.verdicts``), and the
    ``pyspy`` collector status.
    """

    name = "pyspy"  # the collector label (a contract): the py-spy runner's and sampler's status

    def __init__(self, config: Config, services: Services, *, spy: PySpy | None = None,
                 tick_seconds: float = 1.0) -> None:  # fmt: skip
        """``spy``: the py-spy runner (default: the daemon's one, shared with memory snapshots)."""
        self.config = config
        self.spy = spy or services.spy
        if not self.spy.available:
            log.warning("py-spy unavailable (%s): no GIL sampling, stall detection from "
                        "heartbeats and /proc only", self.spy.unavailable_reason)  # fmt: skip
        g = config.gil
        self.sampler = GilSampler(
            self.spy, services.counters, interval_seconds=g.interval_seconds,
            duration_seconds=g.duration_seconds, rate_hz=g.rate_hz,
            max_concurrent=g.max_concurrent, paths=services.paths, max_duty=MAX_SAMPLING_DUTY,
            healthy_interval_seconds=g.healthy_interval_seconds,
            confirmed_ratio=g.held_threshold,
            # the /proc convoy probe reads every thread of every rank: once per cycle is enough
            probe_seconds=max(2.0, config.interval_seconds),
        ) if g.enabled else None  # fmt: skip
        self.stall = StallTracker(config.stall.after_seconds, StallLooks(self.spy, services.paths),
                                  cycle_seconds=config.interval_seconds,
                                  compile_after_seconds=config.stall.compile_after_seconds,
                                  conclusive_seconds=config.stall.conclusive_seconds)  # fmt: skip
        self.tick_seconds = tick_seconds
        self._thread: threading.Thread | None = None
        self._deferred_seen: collections.Counter[str] = collections.Counter()
        self.signals = SignalTracker(config.interval_seconds)

    def start(self, daemon: DaemonContext) -> None:
        sampler = self.sampler
        if sampler is None or not self.spy.available:
            return
        stop: threading.Event = daemon.stop_event

        def loop() -> None:
            while not stop.is_set():
                sampler.tick()
                stop.wait(self.tick_seconds)

        self._thread = threading.Thread(
            target=run_forever, args=("gil-sampler", loop, stop), name="gil-scheduler", daemon=True
        )
        self._thread.start()

    def track(self, daemon: DaemonContext, ranks: Ranks, beats: Mapping[RankId, float],
              gpus: Mapping[RankId, GpuReading]) -> StallOutput:  # fmt: skip
        """Probe every rank (``beats``: each accepted rank's heartbeat mtime; ``gpus``: this
        cycle's NVML view of each rank's GPUs, for the spin rules), judge the stalls and hand the
        sampler its targets."""
        self.stall.note_gpus(dict(gpus))
        processes: Mapping[int, ProcessInfo] = ranks.processes
        descendants: Mapping[int, tuple[int, ...]] = ranks.descendants
        seen: set[RankId] = set()
        probes: list[RankProbe] = []
        for e in ranks.entries:
            if e.rank_id in seen:
                continue
            seen.add(e.rank_id)
            proc = processes.get(e.pid)
            alive = rank_alive(proc, e.start_ticks)
            probes.append(RankProbe(
                e.job_id, e.rank, e.pid, alive, proc.state if proc else "", e.heartbeat,
                proc.start_ticks if proc else None, e.owner_uid,
                beats.get(e.rank_id), heartbeat_read=True,
                workers=tuple((k, processes[k].state, processes[k].cpu_seconds)
                              for k in descendants.get(e.pid, ()) if k in processes),
            ))  # fmt: skip
        if self.sampler is not None:
            self.sampler.update_targets(GilTarget(p.job_id, p.rank, p.pid) for p in probes
                                        if p.alive)  # fmt: skip
        verdicts = self.stall.observe(ranks.now, probes)  # its py-spy looks: budgeted, time-limited
        for kind in DEFERRED_KINDS:  # what the cycle budget pushed to the next cycle
            n = self.stall.deferred[kind] - self._deferred_seen[kind]
            self._deferred_seen[kind] = self.stall.deferred[kind]
            daemon.counters.ensure("cycle_deferred_probes", (kind,))
            if n:
                daemon.counters.inc("cycle_deferred_probes", (kind,), n)
        return StallOutput(
            progress={k: v.progress_timestamp for k, v in verdicts.items() if v.progress_timestamp is not None},
            stalled={k: v.stalled for k, v in verdicts.items()},
            verdicts=verdicts,
            gil=self.sampler.readings() if self.sampler else {},
            status=self.status(),
        )

    def status(self) -> CollectorStatus:
        if not self.spy.available:
            return CollectorStatus(COLLECTOR, False, 0.0, None,
                                   f"{ABSENT}: {self.spy.unavailable_reason}"[:300])  # fmt: skip
        if self.sampler is not None:
            return self.sampler.status()
        return CollectorStatus(COLLECTOR, True, 0.0, None, "")

    def after_join(self, daemon: DaemonContext, ranks: Ranks, state: NodeState) -> None:
        """Hand the sampler this cycle's signals per rank (its readings flow in through
        ``track``): what makes its schedule adaptive."""
        if self.sampler is not None:
            self.sampler.update_signals(self.signals.observe(state))

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
