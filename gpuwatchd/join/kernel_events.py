"""Kernel log records -> OOM-kill and Xid events, attributed to ranks, counted exactly once.

Pure logic plus the event log; the I/O (kmsg, journal, /proc/vmstat) is in sources/kernel_log.py.

- Grouping: one kill prints a header, a memory dump, the ``oom-kill:`` summary (4.19+) and the
  ``Killed process`` line (plus later ``oom_reaper``). They become ONE event, emitted the moment the
  decisive ``Killed process`` line arrives (no waiting); a summary whose kill line was lost (ring
  overrun) becomes an event on its own after ``group_timeout``.
- Attribution: the victim is dead when its line arrives, so its PID is looked up in a short-lived
  record of the rank process trees the daemon saw in recent cycles (``RankTreeRecord``). PID reuse
  is guarded by start time: a process that started after the kill cannot be its victim. Children
  of a rank (DataLoader workers) are attributed to that rank and marked ``worker``.
- Exactly once: every event has a key (boot id + kernel timestamp + PID), is appended to
  ``state_dir/events.jsonl`` before it is counted, and the counters are rebuilt from that file at
  start (``EventStore``, events/store.py: the processor's ``store``). The source's resume
  position (kmsg seq + boot id, journal cursor) keeps re-reading small.
- Nothing silently lost: ``/proc/vmstat oom_kill`` counts every kernel OOM kill since boot; kills
  it counts that no parsed line explains (ring overrun, source down) become ``unattributed``
  events after a grace period. Kills before the daemon's first start in a boot are history: the
  baseline is taken then and the cross-check counts only beyond it (oom_history.py).

The processor is composed of those parts, each given what it reads: the ``EventStore``, the
``RankTreeRecord``, the ``RankPeers`` of this cycle, the ``OomBaseline``, and ``KernelNotices``
(kernel_notices.py: systemd-oomd, Xid and fallen-off-the-bus lines), which takes the others.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpuwatchd.counters import CounterStore
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import EventFile
from gpuwatchd.events.store import HELPER_OOM_KILL, EventStore
from gpuwatchd.join.kernel_faults import KernelFault, KernelFaults
from gpuwatchd.join.kernel_notices import KernelNotices, is_history
from gpuwatchd.join.oom_history import OomBaseline
from gpuwatchd.join.oom_kills import Kill, KillGrouper
from gpuwatchd.join.rank_peers import RankPeers
from gpuwatchd.join.rank_trees import RankTreeRecord, members_from
from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.model import PAGE, WARNING, ProcessInfo, RankState, frozen_map
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import KILLER_EARLYOOM, KILLER_KERNEL, KILLER_OOMD, LogRecord, Parsed, scope_phrase
from gpuwatchd.statefile import StateFiles, make_state_dir
from gpuwatchd.units import fmt_bytes, fmt_time

log = logging.getLogger(__name__)
__all__ = ["KernelEventProcessor"]

RECORD_FILE = "rank_trees.json"


# ---------------------------------------------------------------------------------------------
# The processor: records in, events and counters out
# ---------------------------------------------------------------------------------------------


class KernelEventProcessor:
    """Thread-safe: ``handle`` runs in the kernel-log thread, ``observe``/``cross_check``/``tick``
    in the daemon's cycle, ``recent`` in outputs."""

    def __init__(
        self,
        counters: CounterStore,
        state_dir: str,
        *,
        parse: Callable[[str, str], Parsed | None],
        bus: EventBus | None = None,
        boot_id: str = "",
        record: RankTreeRecord | None = None,
        xid_dedup: XidDeduper | None = None,  # shared with the NVML watcher
        group_timeout: float = 2.0,
        unexplained_grace: float = 10.0,
        recent_seconds: float = 3600.0,
        clock: Callable[[], float] = time.time,
        max_log_bytes: int = 16 << 20,
        keep_events: int = 10000,
        retention_seconds: float = 1800.0,
        files: StateFiles | None = None,
        ended_grace_seconds: float | None = None,
        helper_of: Callable[[int, float], str | None] | None = None,
        faults: KernelFaults | None = None,
        store: EventStore | None = None,
    ) -> None:
        """``parse``: a log message and its identifier -> what it says (the source's parser,
        sources/kernel_lines.py ``parse_message``).
        ``retention_seconds``: how long a compaction keeps the folded counter of a rank that
        is no longer registered (``retention.oom_kill_seconds``, retention.py; at run time it is
        ``store.retention_seconds``).
        ``store``: the event log to record into (the daemon's one, ``Services.events``); None
        (tests, a processor on its own): one over ``state_dir/events.jsonl`` with ``bus``."""
        files = files or StateFiles()  # the daemon passes its own, which counts
        # (pid, time) -> the name of the daemon's own helper that pid was then (its py-spy runs)
        self.helper_of = helper_of
        self.faults = faults  # segfault / trap lines by PID, for the exits part (join/exits.py)
        self.parse = parse
        self.counters = counters
        self.state_dir = state_dir
        self.boot_id = boot_id
        self.record = record or RankTreeRecord(
            os.path.join(state_dir, RECORD_FILE), files=files, ended_grace_seconds=ended_grace_seconds
        )
        self.unexplained_grace = unexplained_grace
        self.clock = clock
        self._lock = threading.RLock()
        self._grouper = KillGrouper(group_timeout)
        self._deficit_since: float | None = None
        self.peers = RankPeers()
        self.oom_baseline = OomBaseline(state_dir, boot_id)  # kills before the first start
        if store is None:
            make_state_dir(state_dir)  # unwritable: kills are still counted, writes counted
            store = EventStore(
                EventFile(state_dir, files),
                counters,
                bus=bus,
                boot_id=boot_id,
                clock=clock,
                max_log_bytes=max_log_bytes,
                keep_events=keep_events,
                retention_seconds=retention_seconds,
                recent_seconds=recent_seconds,
            )
        # the ranks registered now, whose counters a compaction keeps: this processor's view
        store.live_ranks = self.peers.live
        self.store = store
        self.notices = KernelNotices(self.store, self.record, self.peers, self.oom_baseline, xid_dedup)

    def take_baseline(self, vmstat_oom_kill: int | None, now: float) -> bool:
        """Before the source starts: load this boot's baseline, or take it (first start in this
        boot; True): kills the source replays from before ``now`` are history (oom_history.py)."""
        with self._lock:
            return self.oom_baseline.take(vmstat_oom_kill, self.store.boot_kernel_kills(), now)

    def history_event(self, source: str) -> Event | None:
        """Once, after the first start's replay (``source``: kmsg | journal, "" when the log could
        not be read): one info event that says what the kernel counted and the buffer held."""
        with self._lock:
            ev = self.oom_baseline.history_event(source, fmt_time)
        if ev is not None:
            log.info("%s", ev.summary)
        return self.store.emit(ev) if ev is not None else None

    # -- the kernel-log thread --------------------------------------------------------------

    def handle(self, rec: LogRecord) -> list[Event]:
        p = self.parse(rec.message, rec.identifier)
        if p is None:
            return []
        with self._lock:
            if p.kind == "xid":
                return [e for e in [self.notices.xid(rec, p)] if e is not None]
            if p.kind == "gpu_at":
                self.notices.gpu_at(p.fields["pci"], p.fields["uuid"])
                return []
            if p.kind == "gpu_named":
                self.notices.gpu_named(p.fields["pci"], rec.realtime)
                return []
            if p.kind == "bus_lost":
                return [e for e in [self.notices.bus_lost(rec, p)] if e is not None]
            if p.kind == "oomd":
                return self.notices.oomd(rec, p)
            if p.kind == "fault":
                if self.faults is not None and p.pid is not None:
                    f = p.fields
                    words = f"{f['what']} ip {f['ip']} error {f['error']}" + (
                        f" in {f['where']}" if f.get("where") else ""
                    )
                    self.faults.record(KernelFault(p.pid, p.comm, rec.realtime, words))
                return []
            kills = self._grouper.feed(rec, p)
            return [e for k in kills for e in [self._kill_event(k)] if e is not None]

    def tick(self, now: float | None = None) -> list[Event]:
        """Each cycle: emit kills whose decisive line never arrived."""
        with self._lock:
            kills = self._grouper.flush(self.clock() if now is None else now)
            return [e for k in kills for e in [self._kill_event(k)] if e is not None]

    def oldest_pending_seq(self) -> int | None:
        with self._lock:
            return self._grouper.oldest_pending_seq()

    def _kill_event(self, k: Kill) -> Event | None:
        if is_history(self.oom_baseline, k):
            return None
        helper = self.helper_of(k.pid, k.time) if self.helper_of is not None else None
        if helper is not None:
            return self._helper_kill_event(k, helper)
        m = self.record.lookup(k.pid, k.time)
        job_id, rank_s = (m.job_id, str(m.rank)) if m else ("", "")
        fields: dict[str, Any] = {
            "rss_bytes": k.rss_bytes,
            "memcg": k.memcg,
            "oom_memcg": k.oom_memcg,
            "constraint": k.constraint,
            "scope": k.scope,
            "source": k.source,
            "monotonic_usec": k.monotonic_usec,
        }
        if k.detail:
            fields["detail"] = k.detail
        by = {
            KILLER_KERNEL: "the kernel OOM killer",
            KILLER_EARLYOOM: "earlyoom",
            KILLER_OOMD: "systemd-oomd",
        }[k.killer]
        where = f" in memory cgroup {k.memcg}" if k.memcg else ""
        if k.killer == KILLER_KERNEL:
            where += scope_phrase(k.scope, k.constraint, k.oom_memcg, k.memcg)
        holding = f" holding {fmt_bytes(k.rss_bytes)} RSS" if k.rss_bytes is not None else ""
        if m is None:
            summary = (
                f"pid {k.pid} ({k.comm}) was killed by {by} at {fmt_time(k.time)}{holding}{where}"
                "; it belonged to no known rank"
            )
            severity, alert = WARNING, False
        else:
            peers, world = self.peers.peers_alive(m.job_id, m.rank)
            fields.update(peers_alive=peers, rank_pid=m.rank_pid)
            if world:
                fields["world_size"] = world
            subject = f"rank {m.rank} of job {m.job_id} (pid {k.pid}, {k.comm})"
            if m.worker:
                subject = f"worker pid {k.pid} ({k.comm}) of rank {m.rank} of job {m.job_id} (rank pid {m.rank_pid})"
            summary = f"{subject} was killed by {by} at {fmt_time(k.time)}{holding}{where}"
            if peers:
                summary += f"; {peers} peers alive: they will wait in their next collective"
            snap = self.store.snapshot(m.job_id, str(m.rank), m.rank_pid)
            if snap is not None and snap.time <= k.time + 1.0:
                fields.update(memory_snapshot=snap.key, memory_snapshot_summary=snap.summary)
                summary += f"; last memory snapshot (event {snap.key}): {snap.summary}"
            severity, alert = PAGE, True
        return self.store.emit(
            Event(
                key=k.key,
                kind="oom_kill",
                time=k.time,
                severity=severity,
                summary=summary,
                job_id=job_id,
                rank=rank_s,
                pid=k.pid,
                comm=k.comm,
                killer=k.killer,
                worker=bool(m and m.worker),
                boot_id=k.boot_id,
                counter="oom_kills",
                labels=(job_id, rank_s, k.comm, k.killer),
                fields=frozen_map(fields),
                alert=alert,
            )
        )

    def _helper_kill_event(self, k: Kill, helper: str) -> Event | None:
        """A kill of the daemon's own helper: named as such, never a node OOM kill."""
        holding = f" holding {fmt_bytes(k.rss_bytes)} RSS" if k.rss_bytes is not None else ""
        where = f" in memory cgroup {k.memcg}" if k.memcg else ""
        return self.store.emit(
            Event(
                key=k.key,
                kind=HELPER_OOM_KILL,
                time=k.time,
                severity=WARNING,
                summary=(
                    f"gpuwatchd's own {helper} helper (pid {k.pid}, {k.comm}) was killed by "
                    f"{k.killer} at {fmt_time(k.time)}{holding}{where}: the monitor's helper, "
                    "not a training process (counted in gpuwatch_helper_oom_kills_total)"
                ),
                pid=k.pid,
                comm=k.comm,
                killer=k.killer,
                boot_id=k.boot_id,
                counter="helper_oom_kills",
                labels=(helper, k.killer),
                fields=frozen_map({"rss_bytes": k.rss_bytes, "memcg": k.memcg, "helper": helper}),
            )
        )

    # -- the daemon's cycle ------------------------------------------------------------------

    def observe(
        self,
        ranks: Sequence[RankState],
        processes: Mapping[int, ProcessInfo],
        now: float,
        cgroups: Mapping[int, str] | None = None,
    ) -> None:
        """Give the record this cycle's rank trees; create every live rank's counter at 0."""
        members = members_from(ranks, processes, now, cgroups)
        self.record.update(members, now)
        with self._lock:
            self.peers.update(ranks)
        for r in ranks:
            if r.alive and r.process is not None:
                self.counters.ensure("oom_kills", (r.job_id, str(r.rank), r.process.comm, KILLER_KERNEL))

    def cross_check(self, vmstat_oom_kill: int | None, now: float) -> list[Event]:
        """Kernel kills counted by /proc/vmstat that no parsed line explains, after a grace period
        (the line may still be on its way), become one unattributed event."""
        if vmstat_oom_kill is None:
            return []
        with self._lock:
            missing = vmstat_oom_kill - self.oom_baseline.kernel_kills() - self.store.boot_kernel_kills()
            if missing <= 0:
                self._deficit_since = None
                return []
            if self._deficit_since is None:
                self._deficit_since = now
            if now - self._deficit_since < self.unexplained_grace:
                return []
            self._deficit_since = None
            ev = Event(
                key=f"{self.boot_id}:unexplained:{vmstat_oom_kill}",
                kind="oom_kill_unexplained",
                time=now,
                severity=WARNING,
                summary=f"the kernel counted {missing} OOM kill(s) that no kernel log line "
                "explains (log overrun or source down); counted as unattributed",
                killer=KILLER_KERNEL,
                boot_id=self.boot_id,
                counter="oom_kills",
                labels=("", "", "", KILLER_KERNEL),
                count=missing,
                fields=frozen_map({"vmstat_oom_kill": vmstat_oom_kill}),
            )
            return [e for e in [self.store.emit(ev)] if e is not None]

    def recent(self, since: float | None = None) -> list[Event]:
        return self.store.recent(since)

    def record_event(self, ev: Event) -> bool:
        """Store an event from elsewhere in the daemon (finding transitions: rank deaths, stalls)
        in the same durable log, so `gpuwatchd events` shows one timeline. False if a duplicate."""
        return self.store.add(ev)

    def with_peers(self, ev: Event) -> Event:
        """``ev`` with the peers-alive count of now (for findings shown long after the kill)."""
        if not ev.job_id:
            return ev
        peers, _ = self.peers.peers_alive(ev.job_id, int(ev.rank))
        return replace(ev, fields=frozen_map({**ev.fields, "peers_alive_now": peers}))
