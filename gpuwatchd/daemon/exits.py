"""The exits part of the daemon: every watched rank's exit recorded with its cause as it happens.

Each cycle it hands the exit watcher (sources/exits.py) the live processes of the accepted ranks
(registered or discovered): one pidfd each, polled by the watcher's thread, which reads the wait
status the moment the process ends. ``SETTLE_SECONDS`` after an exit (time for the kernel's fault
line and for the launcher's teardown of the other ranks to be read) a thread of this part joins
the exits (join/exits.py) with the kernel's fault lines and OOM-kill / Xid events and writes one
``rank_exit`` event per exit (counted in ``gpuwatch_rank_exits_total``), without waiting for the
cycle: death to event is about SETTLE_SECONDS. The cycle hands the joined exits to the findings
(``ExitOutput``). Collector label ``exits``: down where pidfd_open(2) is refused (Linux < 5.3, a
seccomp filter); deaths are then seen only by the cycle, as before (rank_down without a cause).
"""

from __future__ import annotations

import logging
import threading
import time

from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.isolation import guarded
from gpuwatchd.join.exits import ExitLedger, exit_words
from gpuwatchd.model import INFO, PAGE, WARNING, CollectorStatus, RankProcess, frozen_map, rank_alive
from gpuwatchd.model.events import Event
from gpuwatchd.model.exits import CRASHED, KILLED, NODE, RankExit
from gpuwatchd.model.parts import ExitOutput
from gpuwatchd.rank.rankfile import MAX_RANKS_PER_NODE
from gpuwatchd.sources.exits import ExitWatcher, ProcessExit, Watch, start_clock

SETTLE_SECONDS = 0.5

log = logging.getLogger(__name__)


class ExitsSubsystem(Subsystem):
    name = "exits"

    def __init__(self, services: Services, max_watched: int = MAX_RANKS_PER_NODE) -> None:
        self.max_watched = max_watched
        self.events = services.events  # each settled exit is recorded here, its cause joined
        self.clock = services.clock
        self._boot_id = services.boot_id
        self.ledger = ExitLedger(services.faults, started=start_clock())
        self._woken = threading.Event()
        self.watcher = ExitWatcher(services.paths, max_watched, clock=services.clock, on_exit=self._woken.set)
        self._started = False  # the watcher's thread runs (pidfd_open allowed)
        self._lock = threading.Lock()  # the watcher's exits -> the ledger -> the event log
        self._first_start: dict[RankProcess, int] = {}  # a claim's process, as first watched
        self._written: set[tuple[int, int]] = set()  # exits whose event is written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok: float | None = None

    def start(self, daemon: DaemonContext) -> None:
        self.watcher.start()  # OSError: the part failed to start, its collector reads 0
        self._started = True
        self._thread = threading.Thread(target=self._settle_loop, name="gpuwatchd-exit-events", daemon=True)
        self._thread.start()

    def _settle_loop(self) -> None:
        while not self._stop.is_set():
            self._woken.wait()
            self._woken.clear()
            if self._stop.wait(SETTLE_SECONDS):
                return
            guarded("exits: events", self._collect, None)

    def _collect(self) -> list[RankExit]:
        """The watcher's new exits into the ledger, and an event for each settled one."""
        watcher, ledger = self.watcher, self.ledger
        if not self._started:
            return []
        with self._lock:
            events = self.events.recent()
            raw = [x for x in (self._identify(e) for e in watcher.drain()) if x is not None]
            if raw:
                ledger.add(raw, events)
                if log.isEnabledFor(logging.DEBUG):
                    for x in raw:
                        log.debug("exit read: rank %s of job %s, pid %d: %s", x.rank, x.job_id, x.pid, x.how)
            else:
                ledger.refresh(events, self.clock())
            now = self.clock()
            for x in ledger.recent():
                key = (x.pid, x.start_ticks)
                if key not in self._written and now - x.time >= SETTLE_SECONDS:
                    self._written.add(key)
                    self.events.add(self._event(x))
            return list(ledger.recent())

    @staticmethod
    def _identify(e: ProcessExit) -> RankExit | None:
        entry = e.entry
        if entry is None:
            return None
        return RankExit(
            job_id=entry.job_id,
            rank=entry.rank,
            pid=e.pid,
            comm=e.comm,
            time=e.time,
            status=e.status,
            registered=entry.source == "rankfile",
            local_rank=entry.local_rank,
            world_size=entry.world_size,
            start_ticks=e.start_ticks,
            unknown=e.unknown,
            read_by=e.read_by,
            seq=e.seq,
        )

    def _event(self, x: RankExit) -> Event:
        severity = {NODE: PAGE, KILLED: PAGE, CRASHED: WARNING}.get(x.verdict, INFO) if x.first else INFO
        fields = {
            "cause": x.cause,
            "status": x.status,
            "how": x.how,
            "kernel": x.kernel,
            "verdict": x.verdict,
            "first_rank": x.first_rank,
            "first_pid": x.first_pid,
            "after_seconds": x.after_seconds,
            "registered": x.registered,
            "world_size": x.world_size,
            "local_rank": x.local_rank,
            "read_by": x.read_by,
        }
        if x.unknown:
            fields["unknown"] = x.unknown
        return Event(
            key=f"rank_exit:{self._boot_id}:{x.pid}:{x.start_ticks}",
            kind="rank_exit",
            time=x.time,
            severity=severity,
            summary=exit_words(x),
            job_id=x.job_id,
            rank=str(x.rank),
            pid=x.pid,
            comm=x.comm,
            boot_id=self._boot_id,
            counter="rank_exits",
            labels=(x.job_id, str(x.rank), x.cause),
            fields=frozen_map(fields),
        )

    def track(self, daemon: DaemonContext, ranks: Ranks) -> ExitOutput:
        watcher, ledger = self.watcher, self.ledger
        if not self._started:  # failed to start: exported as down (wiring.down_statuses)
            return ExitOutput()
        t0 = time.monotonic()
        exits = self._collect()  # first: a rank found dead this cycle has its exit here
        wanted: set[tuple[int, int]] = set()
        new: dict[tuple[int, int], Watch] = {}
        first: dict[RankProcess, int] = {}
        processes, known_start, watched = ranks.processes, self._first_start, watcher.keys()
        for e in ranks.entries:
            proc, rp = processes.get(e.pid), e.rank_process
            known = e.start_ticks if e.start_ticks is not None else known_start.get(rp)
            if not rank_alive(proc, known):
                continue  # gone, a zombie, or the PID names another process now: not this rank
            start = proc.start_ticks
            first[rp] = start
            key = (e.pid, start)
            wanted.add(key)
            if key not in watched:
                new[key] = Watch(e.pid, start, proc.uid, proc.comm, e)
        if log.isEnabledFor(logging.DEBUG):
            # the trail of a death with no event: was its rank ever watched, and when did it stop
            for (pid, start), w in new.items():
                who = f"rank {w.entry.rank} of job {w.entry.job_id}" if w.entry is not None else "?"
                log.debug("exit watch: pid %d (start %d), %s", pid, start, who)
            for pid, start in watched - wanted:
                log.debug("exit watch: pid %d (start %d) no longer a live accepted rank (kept if dead)", pid, start)
        with self._lock:
            # exactly the watched: a claim no longer here loses its watch (bounded by the cap);
            # each watch carries its claim, so an exit read later is still named
            self._first_start = first
            watcher.sync(wanted, new)
            self._written &= {(x.pid, x.start_ticks) for x in exits}
        ledger.prune(ranks.now, {(e.job_id, e.rank, e.pid) for e in ranks.entries})
        if watcher.running:
            self._last_ok = daemon.clock()
        status = CollectorStatus(
            name="exits",
            success=watcher.running,
            duration_seconds=time.monotonic() - t0,
            last_success_timestamp=self._last_ok,
            error=watcher.error
            or (
                f"{watcher.skipped} rank process(es) not watched: over {self.max_watched} or no fd left"
                if watcher.skipped
                else ""
            ),
        )
        return ExitOutput(ledger.recent(), status, started=ledger.started)

    def stop(self) -> None:
        self._stop.set()
        self._woken.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._started:
            self.watcher.stop()
