"""The daemon: scheduling, isolation, the notify protocol, signals.

Every ``interval_seconds`` one cycle runs the polled sources (rank files, /proc, and whatever the
subsystems poll, e.g. NVML), each through its own isolation wrapper (``isolation.Collector``), then
the pure join, then swaps ``self.state`` (an immutable ``NodeState``) in one assignment: the
exporter and the CLI only ever read that reference. Streaming sources (kernel log, udev, py-spy
sampling) are *subsystems* with their own threads; they feed the shared ``CounterStore``, and the
track stage (daemon/wiring.py) calls each by name with what it needs, each returning its own
typed output (``Tracked``, daemon/subsystem.py).

Signals: SIGTERM/SIGINT stop cleanly (STOPPING=1), SIGHUP reloads the config file; an invalid new
config keeps the old one running and logs every problem.

The systemd watchdog means liveness: a thread of its own sends WATCHDOG=1 every half
WATCHDOG_USEC *while cycles keep finishing*, i.e. while the last cycle ended (or, before the first,
the daemon started) less than ``liveness_seconds`` ago (default: two intervals plus
``CYCLE_TIME_LIMIT``). One slow cycle therefore never restarts the daemon, and cycles that stopped
for good (a wedged source, a deadlock) stop the pings, so systemd restarts it ``WatchdogSec``
later; STATUS= says which.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwatchd.config.schema import Config, ConfigError
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon import allocator
from gpuwatchd.daemon.notify import notify, watchdog_interval
from gpuwatchd.daemon.proc_view import ProcReading, ProcView
from gpuwatchd.daemon.reload import ConfigSource, reload_config
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.state_json import state_json_text
from gpuwatchd.daemon.subsystem import Ranks, Subsystem
from gpuwatchd.daemon.wake import LinkedEvent
from gpuwatchd.daemon.wiring import Parts, build_parts, down_statuses, track
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.isolation import Collector, PartialReading, attempt, guarded
from gpuwatchd.join import rank_claims
from gpuwatchd.join.orphans import trees_from_entries
from gpuwatchd.join.state import JoinMemory, build_state
from gpuwatchd.model import BadRankFile, CollectorStatus, NodeState, RankEntry, RankId, RankProcess
from gpuwatchd.model.parts import Tracked
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.discovery import Discoverer
from gpuwatchd.sources.job_owners import JobOwnerFile
from gpuwatchd.sources.memcg import MemcgReader
from gpuwatchd.sources.pidns import PidNamespaces
from gpuwatchd.sources.rankfiles import RankDirMissing, RankFileReader, guard_entries
from gpuwatchd.statefile import remove_temporaries
from gpuwatchd.web.web_config import WebConfigError

if TYPE_CHECKING:  # imported when the daemon starts serving (start), not before
    from gpuwatchd.web.server import WebServer

log = logging.getLogger(__name__)
STATE_FILE = "state.json"
# A cycle is bounded to seconds by its collectors' time-outs and the stall probe budget; one that
# has not finished after this long is wedged, and the watchdog stops being fed.
CYCLE_TIME_LIMIT = 30.0
GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (run(); CPython's default: 700)


@dataclass(frozen=True)
class Reading:
    """What the daemon's own sources read in one cycle (``Daemon.read``, the only producer)."""

    now: float  # the cycle's clock reading
    entries: tuple[RankEntry, ...]  # rank files + discovery (collector ``rankfiles``)
    bad_files: tuple[BadRankFile, ...]  # rank files refused while reading them
    proc: ProcReading  # /proc of each rank tree, heartbeats (``procfs``)
    statuses: tuple[CollectorStatus, ...]  # the two collectors' status


def accepted(
    reading: Reading, claims: rank_claims.Claims, known_ticks: Mapping[RankProcess, int]
) -> tuple[Ranks, Mapping[RankId, float]]:
    """The reading narrowed to the accepted claims: what the track stage's parts read (with each
    rank's liveness and tree, computed once here: ``known_ticks``, the start time the join first
    saw of a claim without one), and each accepted rank's heartbeat mtime (a refused claim on the
    same rank has another pid)."""
    proc = reading.proc
    beats = {RankId(j, r): t for (j, r, pid), t in proc.progress.items() if claims.accepts(j, r, pid)}
    trees = trees_from_entries(claims.accepted, proc.processes, proc.descendants, known_ticks)
    return Ranks(reading.now, claims.accepted, proc.processes, proc.descendants, proc.cgroups, trees), beats


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        listen_override: str | None = None,
        web_config_override: str | None = None,
        paths: HostPaths | None = None,
        clock: Callable[[], float] = time.time,
        counters: CounterStore | None = None,
        parts: Callable[[Config, Services], Parts] = build_parts,
        services: Services | None = None,
        write_state: bool = True,
        liveness_seconds: float | None = None,
        reap_strays: bool = False,
    ) -> None:
        """``liveness_seconds``: how long without a finished cycle the daemon still counts as
        alive for the watchdog (default: ``2 * interval_seconds + CYCLE_TIME_LIMIT``).
        ``reap_strays``: make this process a child subreaper that kills and reaps every child
        which is not a running py-spy (gpuwatchd/sources/reaper.py); only for a process that is the
        daemon and nothing else (``gpuwatchd run``), never one that starts children of its own.
        ``services``: the shared services (default: built from ``config``, ``paths``, ``clock``
        and ``counters``, which a given one already holds); ``parts``: builds the parts from
        the config and the services (default: as configured, ``build_parts``)."""
        self.config = config
        self.reap_strays = reap_strays
        self.liveness_seconds = liveness_seconds
        self._last_cycle_end = time.monotonic()
        self.config_source = ConfigSource(config_path, listen_override, web_config_override)
        # built once, handed to every part (daemon/services.py): py-spy, Xid de-dup, event log
        self.services = services or Services.build(
            config, paths, clock=clock, counters=counters, write_state=write_state
        )
        svc = self.services
        self.paths = svc.paths
        self.clock = svc.clock
        self.counters = svc.counters
        # every write to state_dir goes through this: failures counted, no temporaries left
        self.state_files = svc.state_files
        self.procfs = svc.procfs
        self.rankfiles = RankFileReader(config.rank_dir)
        self.pidns = PidNamespaces(self.procfs)  # rank files written inside containers
        self.heartbeat_roots = svc.heartbeat_roots
        self._wake = threading.Event()  # the main loop's sleep ends when either is set
        self.stop_event: threading.Event = LinkedEvent(self._wake)
        self.reload_requested: threading.Event = LinkedEvent(self._wake)
        self.state: NodeState | None = None
        # a job's owner is decided once and kept across restarts (trust rule 2); a read-only
        # user (gpuwatchd ps without a fresh state.json) decides from this one cycle
        self.job_owner_file = JobOwnerFile(config.state_dir, self.state_files)
        self.memory = JoinMemory(job_owners=self.job_owner_file.load() if write_state else {})
        self.write_state = write_state  # False for read-only users (gpuwatchd ps)
        self.parts = parts(config, svc)  # every part built whole, by name
        self.subsystems: list[Subsystem] = self.parts.all()  # in the order of their hooks
        # (last load of the config succeeded, Unix time of the last success): the constructor's
        # config is the first load; every SIGHUP sets it (gpuwatch_config_last_reload_*)
        self.config_reload: tuple[bool, float] = (True, self.clock())
        self.registry = make_registry(
            lambda: self.state, self.counters, liveness=self.liveness_problem, config_reload=lambda: self.config_reload
        )
        self.web: WebServer | None = None
        self._discovered: list[RankEntry] = []
        self.discoverer = Discoverer()  # each process's environment read once in its lifetime
        self._last_discovery = float("-inf")
        self.view = ProcView(self.procfs)  # each rank tree, its cgroup and NCCL flags, per cycle
        self._state_key: object = None  # what the last state.json said (``_state_due``)
        self._state_written = float("-inf")
        self._cycle_lock = threading.Lock()
        # the daemon's own memory cgroup, as this process sees it (not the watched host's paths):
        # its limit is read each cycle, /proc/self/cgroup and one limit file per level (0.56 ms
        # on the shared test VM, where any /proc or cgroup read costs 50-70 us; /proc/self/
        # oom_score_adj beside it, 0.05 ms)
        self._own_memcg = MemcgReader(cgroup_root="/sys/fs/cgroup")
        self.exit_status = 0  # what `gpuwatchd run` exits with (request_exit)
        # subsystem name -> why it did not start: exported as collector_success{collector=name} 0
        self.failed_subsystems: dict[str, str] = {}
        self._make_collectors()

    # --- sources --------------------------------------------------------------------------------

    def _make_collectors(self) -> None:
        self.rank_collector: Collector[tuple[list[RankEntry], list[BadRankFile]]] = Collector(
            "rankfiles", self._read_rank_files, 0.0, 0.0, self.clock
        )
        self.proc_collector: Collector[ProcReading] = Collector("procfs", self._read_procfs, 0.0, 0.0, self.clock)
        self._entries: list[RankEntry] = []
        self._bound_collectors()

    def _bound_collectors(self) -> None:
        """The collectors' time-out and how long their last good reading is used, from the
        interval (again after a reload that changed it)."""
        interval = self.config.interval_seconds
        for c in (self.rank_collector, self.proc_collector):
            c.timeout = max(2.0, interval)
            c.max_age = 3 * interval + c.timeout

    def _read_rank_files(self) -> tuple[list[RankEntry], list[BadRankFile]]:
        missing: RankDirMissing | None = None
        try:
            entries, bad = self.rankfiles.scan()
        except RankDirMissing as e:  # down, but discovery below still counts
            entries, bad, missing = [], [], e
        d = self.config.discovery
        now = time.monotonic()
        if d.enabled and now - self._last_discovery >= d.interval_seconds:
            self._last_discovery = now
            self._discovered = self.discoverer.scan(self.procfs, d.launchers)
        elif not d.enabled:
            self._discovered = []
        reading = guard_entries([*entries, *self._discovered], bad, self.paths.procfs, self.pidns, self.heartbeat_roots)
        if missing is not None:
            raise PartialReading(reading, str(missing))
        if self.rankfiles.incomplete:  # the per-owner shares did not all fit in MAX_FILES
            raise PartialReading(
                reading,
                f"rank_dir {self.config.rank_dir}: more rank files than "
                f"can be read; owners {sorted(self.rankfiles.unread_owners)} "
                f"not read in full",
            )
        return reading

    def _read_procfs(self) -> ProcReading:
        entries = self._entries
        proc = self.view.read(e.pid for e in entries)
        progress: dict[RankProcess, float] = {}
        for e in entries:
            mtime = self.heartbeat_roots.mtime(e)
            if mtime is not None:
                progress[e.rank_process] = mtime
        self.heartbeat_roots.end_reads()
        return dataclasses.replace(proc, progress=progress)

    # --- one cycle ------------------------------------------------------------------------------

    def cycle(self) -> NodeState:
        """read -> decide the claims -> track -> join (and judge) -> publish: each stage a
        function of the previous stages' typed outputs (``Reading``, ``Tracked``)."""
        with self._cycle_lock:
            t0 = time.monotonic()
            reading = self.read()  # rank files, /proc, heartbeats (Collectors)
            claims = rank_claims.decide(
                reading.entries,
                reading.proc.processes,
                self.memory.job_owners,
                self.memory.claimant_uids,
                self.memory.start_ticks,
                reading.proc.cgroups,
            )
            ranks, beats = accepted(reading, claims, self.memory.start_ticks)  # the accepted claims only
            tracked = track(self.parts, self, ranks, beats, self.state, dict(self.failed_subsystems))
            proc = reading.proc
            state, self.memory = build_state(
                reading.now,
                self.config,
                claims,
                ranks.trees,
                tracked,
                self.memory,
                processes=proc.processes,
                descendants=proc.descendants,
                env_flags=proc.env_flags,
                bad_files=reading.bad_files,
                heartbeats=beats,
                collectors=self.statuses(reading, tracked),
                counters=self.counters.snapshot(),
            )
            state = dataclasses.replace(
                state,
                cycle_seconds=time.monotonic() - t0,
                oom_score_adj=self._oom_score_adj(),
                memory_limit_bytes=self._own_memcg.own_limit_bytes(),
            )
            self.state = state  # what the exporter and the CLI read: one swap
            self.publish(ranks, state)  # after_join hooks, state.json
            self._last_cycle_end = time.monotonic()
            return state

    def read(self) -> Reading:
        """The daemon's own sources, each under its isolation wrapper (``Collector``); one
        /proc/PID/stat per process across both (``ProcfsReader.begin_cycle``)."""
        self.procfs.begin_cycle()
        try:
            rank_reading = self.rank_collector.run()
            entries, bad = rank_reading if rank_reading is not None else ([], [])
            self._entries = entries
            proc = self.proc_collector.run() or ProcReading({}, {}, {})
        finally:
            self.procfs.end_cycle()
        return Reading(
            self.clock(), tuple(entries), tuple(bad), proc, (self.rank_collector.status, self.proc_collector.status)
        )

    def statuses(self, reading: Reading, tracked: Tracked) -> tuple[CollectorStatus, ...]:
        """Every collector's status: the daemon's own two, each part's, and a part that failed
        to start or whose track raised as a collector that is down."""
        own = [
            *reading.statuses,
            *(
                p.status
                for p in (tracked.stall, tracked.kernel, tracked.gpu, tracked.memory, tracked.exits)
                if p.status is not None
            ),
        ]
        return (*own, *down_statuses(own, tracked.down))

    def publish(self, ranks: Ranks, state: NodeState) -> None:
        """What the new state drives: the subsystems' after-join hooks (event log, rank trees,
        the GIL sampler's signals) and state.json, each isolated."""
        for sub in self.subsystems:
            guarded(f"subsystem {sub.name} after_join", functools.partial(sub.after_join, self, ranks, state), None)
        if self.write_state and self._state_due(state):
            guarded("writing state file", lambda: self._write_state(state), None)
        if self.write_state:
            guarded("writing job owners", lambda: self.job_owner_file.save(self.memory.job_owners), None)

    def _state_due(self, state: NodeState) -> bool:
        """Is state.json to be written after this cycle? When what its readers act on changed
        since the last write (the findings, the ranks and whether each is alive or stalled, the
        counters), and otherwise every other cycle: ``load_state`` takes a file up to three
        intervals old, so ``gpuwatchd ps`` shows numbers at most two intervals old, for half the
        writes (an 86 kB encode and rename at 64 ranks: 2-3 ms of the cycle)."""
        key = (
            frozenset((f.kind, f.severity, *f.key[1:]) for f in state.findings),
            tuple((r.job_id, r.rank, r.pid, r.alive, r.stalled) for r in state.ranks),
            state.counters,
        )
        now = time.monotonic()
        if key == self._state_key and now - self._state_written < 1.5 * self.config.interval_seconds:
            return False
        self._state_key, self._state_written = key, now
        return True

    def liveness_bound(self) -> float:
        if self.liveness_seconds is not None:
            return self.liveness_seconds
        return 2 * self.config.interval_seconds + CYCLE_TIME_LIMIT

    def alive(self) -> bool:
        """Do cycles keep finishing? (What WATCHDOG=1 asserts.)"""
        return time.monotonic() - self._last_cycle_end <= self.liveness_bound()

    def liveness_problem(self) -> str:
        """ "" while cycles keep finishing, else why not: what /-/healthy answers 503 with, so a
        pod's liveness probe restarts a daemon whose cycles stopped, as the unit's watchdog does."""
        since = time.monotonic() - self._last_cycle_end
        if since <= self.liveness_bound():
            return ""
        return f"no cycle finished for {since:.0f} s (bound {self.liveness_bound():.0f} s)"

    def _watchdog(self, every: float) -> None:
        """Feed the systemd watchdog while cycles keep finishing; stop (and say why) when not."""
        starving = False
        while not self.stop_event.wait(every):
            if self.alive():
                notify("WATCHDOG=1")
                starving = False
            elif not starving:
                starving = True
                since = time.monotonic() - self._last_cycle_end
                log.error(
                    "no cycle finished for %.0f s (bound %.0f s): no longer feeding the systemd watchdog",
                    since,
                    self.liveness_bound(),
                )
                notify(f"STATUS=no cycle finished for {since:.0f} s; watchdog not fed")

    def _oom_score_adj(self) -> int | None:
        """The daemon's own oom_score_adj (one small read: it can change at run time, choom)."""
        try:
            with open("/proc/self/oom_score_adj", "rb") as f:  # our own, not the watched procfs
                return int(f.read(32))
        except (OSError, ValueError):
            return None

    def _write_state(self, state: NodeState) -> None:
        path = os.path.join(self.config.state_dir, STATE_FILE)
        text = state_json_text(state)  # the C encoder walks the state (state_json.py)
        self.state_files.write(path, text)  # counted in gpuwatch_state_write_errors_total

    def reload(self) -> bool:
        """SIGHUP: re-read the config file and apply what can change at run time (the rank
        directory, the interval, the web server); on any problem keep the running config."""
        done = reload_config(self.config, self.config_source, self.web, started=self.state is not None)
        if done is None:
            if self.config_source.path is not None:  # refused (without a file nothing was read)
                self.config_reload = (False, self.config_reload[1])
            return False
        self.config_reload = (True, self.clock())
        old, self.config, self.web = self.config, done.config, done.web
        if done.config.rank_dir != old.rank_dir:
            self.rankfiles = RankFileReader(done.config.rank_dir)
        if done.config.interval_seconds != old.interval_seconds:
            self._bound_collectors()
        return True

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the web server and the subsystems (``run`` calls this)."""
        from gpuwatchd.web import server as web

        try:
            self.web = web.serve(
                self.registry, self.config.web.listen_address, self.config.web.config_file, counters=self.counters
            )
        except WebConfigError as e:  # exit 2 naming every bad key, like the config file
            raise ConfigError([f"web.config_file: {p}" for p in e.problems], e.path) from None
        if self.write_state:
            remove_temporaries(self.config.state_dir)  # of a daemon killed mid-write
        for sub in self.subsystems:
            _, error = attempt(f"starting subsystem {sub.name}", functools.partial(sub.start, self), None)
            if error is not None:
                self.failed_subsystems[sub.name] = f"failed to start: {error}"[:300]

    def shutdown(self) -> None:
        self.stop_event.set()
        for sub in self.subsystems:
            guarded(f"stopping subsystem {sub.name}", sub.stop, None)
        self.rank_collector.close()
        self.proc_collector.close()
        self.services.close()
        if self.web is not None:
            self.web.close()
            self.web = None

    def request_exit(self, status: int, why: str) -> None:
        """End ``run()`` after this cycle and exit with ``status`` (for systemd's Restart=)."""
        log.error("%s", why)
        notify(f"STATUS={why[:200]}")
        self.exit_status = status
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGHUP, lambda *_: self.reload_requested.set())

    def run(self) -> None:
        if self.reap_strays:
            from gpuwatchd.sources import reaper

            # every child of the daemon is a py-spy run: orphans they leave are ours to kill
            reaper.CHILDREN.enable()
        self.install_signal_handlers()
        self.start()  # logs the URL it serves, https:// with TLS
        # What start-up built (modules, config, the web server) lives as long as the daemon: out
        # of the cyclic collector's sight, so its full collections walk only what cycles make.
        gc.freeze()
        # A cycle allocates and frees about a thousand containers at 64 ranks: at the default
        # threshold (700) a young collection ran in the middle of 1.4 cycles in 1 (0.65 ms a
        # cycle, the state being built walked again each time). At 10,000 the young generation
        # rarely fills within a cycle; what cyclic garbage there is still goes within about a
        # hundred cycles, so memory stays bounded.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        log.info("oom_score_adj of the daemon: %s", self._oom_score_adj())
        wd = watchdog_interval()
        self._last_cycle_end = time.monotonic()  # the first cycle gets the whole bound
        if wd is not None:
            threading.Thread(target=self._watchdog, args=(wd,), name="watchdog", daemon=True).start()
        first = True
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            state = self.cycle()
            allocator.trim()  # the cycle's freed temporaries back to the kernel
            if first:
                notify("READY=1")
                first = False
            alive = sum(1 for r in state.ranks if r.alive)
            notify(f"STATUS={alive}/{len(state.ranks)} ranks alive, {len(state.findings)} finding(s)")
            next_at += self.config.interval_seconds
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind: skip missed ticks rather than bursting
                next_at = time.monotonic()
                delay = 0
            # wake for a reload or a stop even between cycles (daemon/wake.py), not every second
            while delay > 0 and not self.stop_event.is_set() and not self.reload_requested.is_set():
                self._wake.wait(delay)
                self._wake.clear()  # the flags are looked at again before the next wait
                delay = next_at - time.monotonic()
        notify("STOPPING=1")
        self.shutdown()
