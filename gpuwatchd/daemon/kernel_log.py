"""The kernel-log subsystem of the daemon: the source thread and the processor, wired to the cycle.

Reads /dev/kmsg or the journal (sources/kernel_log.py) in its own thread, event-driven; each cycle
it reads ``/proc/vmstat`` (one small file) for the OOM-kill cross-check and ``/proc/PID/cgroup``
of each live rank, from the daemon's process view (``Ranks.cgroups``), for systemd-oomd
attribution. Privilege and shell equivalents: see
sources/kernel_log.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.subsystem import DaemonContext, KernelOutput, Ranks, Subsystem
from gpuwatchd.events.alertmanager import derive_instance
from gpuwatchd.events.bus import EventBus, build_bus
from gpuwatchd.isolation import guarded, run_forever
from gpuwatchd.join.kernel_events import KernelEventProcessor
from gpuwatchd.model import CgroupPaths, CollectorStatus, NodeState, ProcessInfo
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import LogRecord
from gpuwatchd.sources import reaper
from gpuwatchd.sources.kernel_lines import parse_message
from gpuwatchd.sources.kernel_log import KernelLogUnavailable, open_kernel_log, read_vmstat_oom_kill
from gpuwatchd.sources.kmsg import read_boot_id

log = logging.getLogger(__name__)


class KernelLogSubsystem(Subsystem):
    """Runs the kernel-log source in its own thread (``kernel_log`` config key) and connects the
    processor to the daemon's cycle (duck-typed ``daemon.Subsystem``):

    - ``track``: flush incomplete kills, cross-check /proc/vmstat (read under ``guarded``: an
      unreadable file skips the cross-check this cycle), hand the recent events to the findings
      (``KernelOutput.events``) and report the ``kernel_log`` collector status;
    - ``after_join``: give the attribution record this cycle's rank trees.
    """

    name = "kernel_log"
    RETRY_SECONDS = 30.0
    HISTORY_WAIT_SECONDS = 60.0  # a replay not finished by then is reported as unknown

    def __init__(self, journal_path: str | None = None, bus: EventBus | None = None) -> None:
        self.journal_path = journal_path
        self.processor: KernelEventProcessor | None = None
        self.source: Any = None
        self.bus = bus
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error = ""
        self._running = False
        self._last_ok: float | None = None
        self._processes: Mapping[int, ProcessInfo] = {}
        self._cgroups: Mapping[int, CgroupPaths] = {}
        self._history_due = 0.0

    def start(self, daemon: DaemonContext) -> None:
        cfg = daemon.config
        paths = daemon.paths
        if self.bus is None:
            am = cfg.alertmanager
            self.bus = build_bus(
                cfg.state_dir,
                alertmanager_url=am.url,
                instance=am.instance or derive_instance(cfg.web.listen_address),
                timeout_seconds=am.timeout_seconds,
                scrape_job=am.job,
                files=daemon.state_files,
            )
        self.processor = KernelEventProcessor(
            daemon.counters, cfg.state_dir, parse=parse_message, bus=self.bus, boot_id=read_boot_id(paths),
            xid_dedup=daemon.services.xid_dedup, clock=daemon.clock,  # shared with the NVML Xid watcher
            files=daemon.state_files,
            retention_seconds=cfg.retention.oom_kill_seconds,
            ended_grace_seconds=cfg.retention.ended_rank_seconds,
            helper_of=reaper.CHILDREN.helper_at,  # the py-spy runs: never node OOM kills
            faults=daemon.services.faults,  # segfault / trap lines, for the exits part
        )
        daemon.services.events.open(self.processor.store)  # the daemon's one event-log writer
        daemon.counters.ensure("kernel_log_overruns", ())
        # First start in this boot: what the kernel counted and the log replays is history.
        self._history_due = self.HISTORY_WAIT_SECONDS + time.monotonic()
        self.processor.take_baseline(read_vmstat_oom_kill(paths), daemon.clock())
        if cfg.kernel_log == "off":
            self.processor.history_event("")
            return
        self._thread = threading.Thread(
            target=self._run, args=(daemon,), name="kernel-log", daemon=True
        )
        self._thread.start()

    def _run(self, daemon: DaemonContext) -> None:
        # run_forever is the daemon's isolation for streaming sources: a crash restarts the
        # source after RETRY_SECONDS (resuming from the persisted position), never the daemon.
        run_forever("kernel_log", lambda: self._run_once(daemon), self._stop, self.RETRY_SECONDS)

    def _handle(self, rec: LogRecord) -> None:
        # One record that trips a bug is logged and skipped; the reader keeps reading.
        processor = self.processor
        if processor is not None:
            none: list[Event] = []
            guarded("kernel log record", lambda: processor.handle(rec), none)

    def _run_once(self, daemon: DaemonContext) -> None:
        counters: CounterStore = daemon.counters
        try:
            self.source = open_kernel_log(
                daemon.config.kernel_log,
                daemon.paths,
                daemon.config.state_dir,
                journal_path=self.journal_path,
                on_reject=lambda r: counters.inc("kernel_log_lines_rejected", (r,)),
                on_overrun=lambda: counters.inc("kernel_log_overruns", ()),
                files=daemon.state_files,
            )
        except KernelLogUnavailable as e:
            self._error = str(e)
            raise
        if self.source is None or self.processor is None or self._stop.is_set():
            return
        self.source.hold_cursor(self.processor.oldest_pending_seq)
        self._error = ""
        self._running = True
        try:
            self.source.run(self._handle)
        except OSError as e:
            self._error = str(e)
            raise
        finally:
            self._running = False

    def track(self, daemon: DaemonContext, ranks: Ranks) -> KernelOutput:
        if self.processor is None:
            return KernelOutput()
        t0 = time.monotonic()
        now = daemon.clock()
        retention = daemon.config.retention  # SIGHUP applies it here too
        self.processor.store.retention_seconds = retention.oom_kill_seconds
        self.processor.record.ended_grace = retention.ended_rank_seconds
        self._processes = ranks.processes
        self._cgroups = ranks.cgroups  # the daemon's process view, for after_join
        self.processor.tick(now)
        self._report_history()
        paths = daemon.paths
        self.processor.cross_check(guarded("kernel_log: /proc/vmstat", lambda: read_vmstat_oom_kill(paths), None),
                                   now)
        running = self._running
        if running:
            self._last_ok = now
        status = CollectorStatus(
            name="kernel_log",
            success=running,
            duration_seconds=time.monotonic() - t0,
            last_success_timestamp=self._last_ok,
            error=self._error if self._thread is not None else "kernel_log: off",
        )
        return KernelOutput(tuple(self.processor.recent(now - 3600.0)), status)

    def _report_history(self) -> None:
        """The first start's history event, once the source has replayed its buffer."""
        if self.processor is None or self.processor.oom_baseline.history is None:
            return
        source = self.source
        if source is not None and source.ready.is_set():
            self.processor.history_event(source.name)
        elif time.monotonic() > self._history_due:
            self.processor.history_event("")

    def after_join(self, daemon: DaemonContext, state: NodeState) -> None:
        if self.processor is None:
            return
        now = daemon.clock()
        # each live rank's cgroup path: the v1 memory controller's, else the v2 unified one
        where = self._cgroups
        cgroups = {r.pid: (where[r.pid].memory_v1 or where[r.pid].unified) if r.pid in where else ""
                   for r in state.ranks if r.alive and r.process is not None}
        self.processor.observe(state.ranks, self._processes, now, cgroups)

    def stop(self) -> None:
        self._stop.set()
        if self.source is not None:
            self.source.stop()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.bus is not None:
            self.bus.close()
