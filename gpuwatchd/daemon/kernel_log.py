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
from typing import Any

from gpuwatchd.config.schema import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.isolation import guarded, run_forever
from gpuwatchd.join.kernel_events import KernelEventProcessor
from gpuwatchd.model import CollectorStatus, NodeState
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import LogRecord
from gpuwatchd.model.parts import KernelOutput
from gpuwatchd.sources import reaper
from gpuwatchd.sources.kernel_lines import parse_message
from gpuwatchd.sources.kernel_log import KernelLogUnavailable, open_kernel_log, read_vmstat_oom_kill

log = logging.getLogger(__name__)


class KernelLogSubsystem(Subsystem):
    """Runs the kernel-log source in its own thread (``kernel_log`` config key) and connects the
    processor, which records into the daemon's event log, to the daemon's cycle:

    - ``track``: flush incomplete kills, cross-check /proc/vmstat (read under ``guarded``: an
      unreadable file skips the cross-check this cycle), hand the recent events to the findings
      (``KernelOutput.events``) and report the ``kernel_log`` collector status;
    - ``after_join``: give the attribution record this cycle's rank trees (the joined ranks, and
      the processes and cgroups of the cycle's ``Ranks``, handed to it as arguments).
    """

    name = "kernel_log"
    RETRY_SECONDS = 30.0
    HISTORY_WAIT_SECONDS = 60.0  # a replay not finished by then is reported as unknown

    def __init__(self, config: Config, services: Services, *, journal_path: str | None = None) -> None:
        """The processor is built here and records into the daemon's event log
        (``services.events``); ``start`` takes the OOM baseline and starts the reader thread."""
        self.journal_path = journal_path
        self.processor = KernelEventProcessor(
            services.counters,
            config.state_dir,
            parse=parse_message,
            boot_id=services.boot_id,
            xid_dedup=services.xid_dedup,
            clock=services.clock,  # shared with the NVML Xid watcher
            files=services.state_files,
            retention_seconds=config.retention.oom_kill_seconds,
            ended_grace_seconds=config.retention.ended_rank_seconds,
            helper_of=reaper.CHILDREN.helper_at,  # the py-spy runs: never node OOM kills
            faults=services.faults,  # segfault / trap lines, for the exits part
            store=services.events,  # the daemon's one event log
        )
        self.source: Any = None  # the kernel log as the reader thread last opened it
        self._thread: threading.Thread | None = None  # None: kernel_log off
        self._stop = threading.Event()
        self._error = ""
        self._running = False
        self._last_ok: float | None = None
        self._history_owed = False  # the first start in this boot: its history event is not out
        self._history_due = 0.0

    def start(self, daemon: DaemonContext) -> None:
        """Take the OOM baseline and start the reader thread. An event log that could not be
        read back fails the start: kernel events could not be counted exactly once."""
        if self.processor.store.unreadable:
            raise OSError(f"the event log cannot be read back: {self.processor.store.unreadable}")
        cfg = daemon.config
        paths = daemon.paths
        daemon.counters.ensure("kernel_log_overruns", ())
        # First start in this boot: what the kernel counted and the log replays is history.
        self._history_due = self.HISTORY_WAIT_SECONDS + time.monotonic()
        first = self.processor.take_baseline(read_vmstat_oom_kill(paths), daemon.clock())
        if cfg.kernel_log == "off":
            self.processor.history_event("")  # no replay to wait for
            return
        self._history_owed = first
        self._thread = threading.Thread(target=self._run, args=(daemon,), name="kernel-log", daemon=True)
        self._thread.start()

    def _run(self, daemon: DaemonContext) -> None:
        # run_forever is the daemon's isolation for streaming sources: a crash restarts the
        # source after RETRY_SECONDS (resuming from the persisted position), never the daemon.
        run_forever("kernel_log", lambda: self._run_once(daemon), self._stop, self.RETRY_SECONDS)

    def _handle(self, rec: LogRecord) -> None:
        # One record that trips a bug is logged and skipped; the reader keeps reading.
        none: list[Event] = []
        guarded("kernel log record", lambda: self.processor.handle(rec), none)

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
        if self.source is None or self._stop.is_set():
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
        t0 = time.monotonic()
        now = daemon.clock()
        retention = daemon.config.retention  # SIGHUP applies it here too
        self.processor.store.retention_seconds = retention.oom_kill_seconds
        self.processor.record.ended_grace = retention.ended_rank_seconds
        self.processor.tick(now)
        self._report_history()
        paths = daemon.paths
        self.processor.cross_check(guarded("kernel_log: /proc/vmstat", lambda: read_vmstat_oom_kill(paths), None), now)
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
        if not self._history_owed:
            return
        source = self.source
        if source is not None and source.ready.is_set():
            self.processor.history_event(source.name)
        elif time.monotonic() > self._history_due:
            self.processor.history_event("")
        else:
            return
        self._history_owed = False

    def after_join(self, daemon: DaemonContext, ranks: Ranks, state: NodeState) -> None:
        """Give the attribution record this cycle's rank trees: the joined ranks (alive or not)
        with their processes and cgroups from the process view (``ranks``)."""
        now = daemon.clock()
        # each live rank's cgroup path: the v1 memory controller's, else the v2 unified one
        where = ranks.cgroups
        cgroups = {
            r.pid: (where[r.pid].memory_v1 or where[r.pid].unified) if r.pid in where else ""
            for r in state.ranks
            if r.alive and r.process is not None
        }
        self.processor.observe(state.ranks, ranks.processes, now, cgroups)

    def stop(self) -> None:
        self._stop.set()
        if self.source is not None:
            self.source.stop()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
