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
  start. The source's resume position (kmsg seq + boot id, journal cursor) keeps re-reading small.
- Nothing silently lost: ``/proc/vmstat oom_kill`` counts every kernel OOM kill since boot; kills
  it counts that no parsed line explains (ring overrun, source down) become ``unattributed``
  events after a grace period. Kills before the daemon's first start in a boot are history: the
  baseline is taken then and the cross-check counts only beyond it (oom_history.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuwatchd.counters import CounterStore, rank_label_positions
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import EVENTS_FILE, Event, read_events
from gpuwatchd.join.bus_lost import BusLostDedup
from gpuwatchd.join.oom_history import HistoryKill, OomBaseline
from gpuwatchd.join.oom_kills import Kill, KillGrouper
from gpuwatchd.join.rank_trees import RankTreeRecord, TreeMember, members_from
from gpuwatchd.model import INFO, PAGE, WARNING, ProcessInfo, RankState, frozen_map
from gpuwatchd.sources.kernel_log import (
    KILLER_EARLYOOM,
    KILLER_KERNEL,
    KILLER_OOMD,
    LogRecord,
    Parsed,
    parse_message,
)
from gpuwatchd.statefile import StateFiles
from gpuwatchd.units import fmt_bytes

log = logging.getLogger(__name__)
__all__ = ["CRITICAL_XIDS", "KernelEventProcessor", "KillGrouper", "RankTreeRecord", "TreeMember",
           "scope_phrase"]

# Xids that page: the same set as the GPUXidCritical rule (deploy/prometheus/gpuwatchd.rules.yml,
# after the NVIDIA Xid catalog and shared/research/gil-hang-oom.md §4.5): broken GPU, memory or
# links. App-level faults (13, 31, 43) and informational ones (45) are counted but do not page.
CRITICAL_XIDS = frozenset(
    {48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 94, 95, 119, 120}
)

RECORD_FILE = "rank_trees.json"


def fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def scope_phrase(scope: str, constraint: str, oom_memcg: str, memcg: str = "") -> str:
    """Why the kernel killed: a memory cgroup's limit (a container / job limit) or the whole node
    out of memory; "" when the log does not say (a summary whose kill line was lost)."""
    if constraint == "CONSTRAINT_MEMCG" or scope == "Memory cgroup out of memory":
        if oom_memcg and oom_memcg != memcg:
            return f" (limit of memory cgroup {oom_memcg} reached)"
        return " (the cgroup's memory limit was reached)" if memcg else \
            " (its memory cgroup's limit was reached)"
    if constraint == "CONSTRAINT_NONE" or scope.startswith("Out of memory"):
        return " (the node ran out of memory)"
    return ""


# ---------------------------------------------------------------------------------------------
# The processor: records in, events and counters out
# ---------------------------------------------------------------------------------------------

BASE_KIND = "counter_base"


Increment = tuple[str, tuple[str, ...], float, dict[str, int], float]


def _finite(v: Any) -> float | None:
    """``v`` as a finite float >= 0, or None (a stored line is untrusted input: 1e400, -1, "x")."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if 0.0 <= f < float("inf") else None


def _increments(ev: Event) -> list[Increment]:
    """(counter, labels, value, {boot id: kernel OOM kills}, when) that one stored event stands
    for. Items of a ``counter_base`` record that cannot be used are skipped."""
    if ev.kind == BASE_KIND:
        out: list[Increment] = []
        items = ev.fields.get("counters", [])
        for item in items if isinstance(items, list) else []:
            # [name, labels, value] or, since series retention, [name, labels, value, last time]
            if not isinstance(item, list) or len(item) not in (3, 4) \
                    or not isinstance(item[1], list):
                continue
            value = _finite(item[2])
            at = _finite(item[3]) if len(item) == 4 else ev.time
            if value is None or at is None:
                continue
            out.append((str(item[0]), tuple(str(x) for x in item[1]), value, {}, at))
        boots = ev.fields.get("boot_kernel_kills", {})
        if isinstance(boots, dict):
            clean = {str(b): int(n) for b, n in boots.items()
                     if isinstance(n, int) and not isinstance(n, bool) and n >= 0}
            out.append(("", (), 0.0, clean, ev.time))
        return out
    kernel_kill = ev.kind in ("oom_kill", "oom_kill_unexplained") and ev.killer == KILLER_KERNEL
    boot = {ev.boot_id: ev.count} if kernel_kill else {}
    return [(ev.counter, tuple(ev.labels), float(ev.count), boot, ev.time)]


KERNEL_KEYS = 50_000  # keys of kernel events kept for exactly-once counting (an OOM storm)
OTHER_KEYS = 5_000  # keys of finding transitions (churn makes many; a duplicate is harmless)
RECENT_KINDS = frozenset({"oom_kill", "oom_kill_unexplained", "xid"})  # what the findings read


class BoundedKeys:
    """A set of the last ``limit`` keys added (insertion order; the oldest go first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: dict[str, None] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        self._keys[key] = None
        while len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]


@dataclass
class _RankView:
    alive: bool
    world_size: int | None


class KernelEventProcessor:
    """Thread-safe: ``handle`` runs in the kernel-log thread, ``observe``/``cross_check``/``tick``
    in the daemon's cycle, ``recent`` in outputs."""

    def __init__(
        self,
        counters: CounterStore,
        state_dir: str,
        bus: EventBus | None = None,
        boot_id: str = "",
        record: RankTreeRecord | None = None,
        xid_dedup: Any = None,  # gpuwatchd.join.xid_dedup.XidDeduper (shared with the NVML watcher)
        group_timeout: float = 2.0,
        unexplained_grace: float = 10.0,
        recent_seconds: float = 3600.0,
        clock: Callable[[], float] = time.time,
        max_log_bytes: int = 16 << 20,
        keep_events: int = 10000,
        retention_seconds: float = 1800.0,
        files: StateFiles | None = None,
        ended_grace_seconds: float | None = None,
    ) -> None:
        """``retention_seconds``: how long a compaction keeps the folded counter of a rank that
        is no longer registered (``retention.oom_kill_seconds``, retention.py)."""
        self.max_log_bytes = max_log_bytes
        self.keep_events = keep_events
        self.retention_seconds = retention_seconds
        self.files = files or StateFiles()  # the daemon passes its own, which counts
        self.counters = counters
        self.state_dir = state_dir
        self.bus = bus
        self.boot_id = boot_id
        self.record = record or RankTreeRecord(os.path.join(state_dir, RECORD_FILE), files=self.files,
                                               ended_grace_seconds=ended_grace_seconds)
        self.xid_dedup = xid_dedup
        self.unexplained_grace = unexplained_grace
        self.recent_seconds = recent_seconds
        self.clock = clock
        self._lock = threading.RLock()
        self._grouper = KillGrouper(group_timeout)
        # Keys of stored events, for exactly-once counting: kernel events (a re-read after a
        # restart or a lost cursor) and the rest (finding transitions), each bounded.
        self._keys = BoundedKeys(KERNEL_KEYS)
        self._other_keys = BoundedKeys(OTHER_KEYS)
        # kernel events (kills, Xids) of the last recent_seconds, for the findings
        self._recent: deque[Event] = deque(maxlen=10000)
        self._boot_kernel_kills = 0  # kernel OOM kills (parsed + unexplained) stored this boot
        self._deficit_since: float | None = None
        self._ranks: dict[tuple[str, int], _RankView] = {}
        self._pci_uuid: dict[str, str] = {}
        self._bus_lost = BusLostDedup()
        self._snapshots: dict[tuple[str, str, int], Event] = {}  # (job_id, rank, rank pid) -> last
        self.oom_baseline = OomBaseline(state_dir, boot_id)  # kills before the first start
        self.events_path = os.path.join(state_dir, EVENTS_FILE)
        with contextlib.suppress(OSError):  # unwritable: kills are still counted, writes counted
            os.makedirs(state_dir, exist_ok=True)
        self._log_bytes = 0
        self._compact_at = max_log_bytes
        self._rebuild()

    # -- start-up ----------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Counters continue across restarts: re-add every stored event's increment."""
        horizon = self.clock() - self.recent_seconds
        path = self.events_path
        stored = 0
        for ev in read_events(path, on_reject=lambda why: self.files.rejected(path, why)):
            if self._seen(ev):
                continue
            self._account(ev)
            stored += 1
            if ev.time >= horizon and ev.kind in RECENT_KINDS:
                self._recent.append(ev)
        try:
            self._log_bytes = os.path.getsize(path)
        except OSError:
            self._log_bytes = 0
        if self._log_bytes > self.max_log_bytes and stored > self.keep_events:
            self._compact()
        self.files.track(path)

    def _maybe_compact(self) -> None:
        """While running (the log grows with finding transitions under job churn): compact when
        the log passes ``max_log_bytes``, folding the counters of ranks long gone away."""
        if self._log_bytes <= self._compact_at:
            return
        self._compact(prune=True)
        try:
            size = os.path.getsize(self.events_path)
        except OSError:
            size = self._log_bytes
        # the kept events alone may exceed the limit: then wait for another quarter of it
        self._log_bytes = size
        self._compact_at = max(self.max_log_bytes, size + self.max_log_bytes // 4)

    def _compact(self, prune: bool = False) -> None:
        """Fold all but the newest ``keep_events`` events into one ``counter_base`` record that
        carries their increments (and when each last changed), so the log stays bounded and the
        counters stay exact. ``prune``: leave out the counters of ranks not registered now whose
        last increment is older than ``retention_seconds`` (retention.py dropped them already).
        One streaming pass: only the kept events' lines are held, never the whole log."""
        kept: deque[tuple[str, list[Increment], str, float]] = deque()
        keys: set[str] = set()
        totals: dict[tuple[str, tuple[str, ...]], tuple[float, float]] = {}
        boots: dict[str, int] = {}
        dropped, last_key, last_time = 0, "", 0.0
        for ev in read_events(self.events_path):  # lines that cannot be used are left out
            if ev.key in keys:
                continue
            keys.add(ev.key)
            kept.append((ev.to_json(), _increments(ev), ev.key, ev.time))
            if len(kept) <= self.keep_events:
                continue
            _, increments, last_key, last_time = kept.popleft()
            dropped += 1
            for name, labels, value, boot_kills, at in increments:
                if name:
                    v, last = totals.get((name, labels), (0.0, at))
                    totals[(name, labels)] = (v + value, max(last, at))
                for b, n in boot_kills.items():
                    boots[b] = boots.get(b, 0) + n
        if not dropped:
            return
        if prune:
            totals = self._retained(totals)
        base = Event(
            key=f"base:{last_key}",
            kind=BASE_KIND,
            time=last_time,
            severity=INFO,
            summary=f"{dropped} older events folded into counters",
            fields=frozen_map(
                {
                    "counters": [[n, list(ls), v, t] for (n, ls), (v, t) in sorted(totals.items())],
                    "boot_kernel_kills": boots,
                }
            ),
        )
        text = base.to_json() + "\n" + "".join(line + "\n" for line, _, _, _ in kept)
        if self.files.write(self.events_path, text, fsync=True):
            log.info("event log compacted: %d events folded, %d kept", dropped, len(kept))

    def _retained(self, totals: Mapping[tuple[str, tuple[str, ...]], tuple[float, float]]
                  ) -> dict[tuple[str, tuple[str, ...]], tuple[float, float]]:
        positions = rank_label_positions()
        horizon = self.clock() - self.retention_seconds
        live = {(j, str(r)) for j, r in self._ranks}
        out = {}
        for (name, labels), (v, last) in totals.items():
            pos = positions.get(name)
            if pos is not None and labels[pos[0]] and last < horizon \
                    and (labels[pos[0]], labels[pos[1]]) not in live:
                continue
            out[(name, labels)] = (v, last)
        return out

    def _seen(self, ev: Event) -> bool:
        return ev.key in (self._keys if ev.boot_id or ev.counter else self._other_keys)

    def _account(self, ev: Event) -> None:
        (self._keys if ev.boot_id or ev.counter else self._other_keys).add(ev.key)
        if ev.kind == "memory_snapshot" and ev.pid is not None:
            self._note_snapshot(ev)
        for name, labels, value, boot_kills, at in _increments(ev):
            if name:
                try:
                    self.counters.inc(name, labels, value, at=at)
                except (KeyError, ValueError) as e:
                    log.warning("event %s: cannot count %s%s: %s", ev.key, name, labels, e)
            self._boot_kernel_kills += boot_kills.get(self.boot_id, 0)

    def _store(self, ev: Event) -> bool:
        """Persist, count, fan out. False when the event was already stored (a duplicate)."""
        with self._lock:
            if self._seen(ev):
                return False
            if self.bus is not None:
                self.bus.emit(ev)  # JSONL first: durable before it is counted
                self._log_bytes += len(ev.to_json()) + 1
            self._account(ev)
            if ev.kind in RECENT_KINDS:
                self._recent.append(ev)
            self._maybe_compact()
        return True

    def _note_snapshot(self, ev: Event) -> None:
        """The last memory snapshot per rank process (memory_evidence.py), for the kill that may
        follow; older than ``recent_seconds`` is dropped, so this stays as small as the live jobs."""
        horizon = ev.time - self.recent_seconds
        for k in [k for k, e in self._snapshots.items() if e.time < horizon]:
            del self._snapshots[k]
        self._snapshots[(ev.job_id, ev.rank, ev.pid or 0)] = ev

    def record_event(self, ev: Event) -> bool:
        """Store an event from elsewhere in the daemon (finding transitions: rank deaths, stalls)
        in the same durable log, so `gpuwatchd events` shows one timeline. False if a duplicate."""
        return self._store(ev)

    def take_baseline(self, vmstat_oom_kill: int | None, now: float) -> bool:
        """Before the source starts: load this boot's baseline, or take it (first start in this
        boot; True): kills the source replays from before ``now`` are history (oom_history.py)."""
        with self._lock:
            return self.oom_baseline.take(vmstat_oom_kill, self._boot_kernel_kills, now)

    def history_event(self, source: str) -> Event | None:
        """Once, after the first start's replay (``source``: kmsg | journal, "" when the log could
        not be read): one info event that says what the kernel counted and the buffer held."""
        with self._lock:
            ev = self.oom_baseline.history_event(source, fmt_time)
        if ev is not None:
            log.info("%s", ev.summary)
        return self._emit(ev) if ev is not None else None

    def _is_history(self, k: Kill) -> bool:
        return self.oom_baseline.is_history(
            HistoryKill(k.pid, k.comm, k.killer, k.time, k.rss_bytes, k.memcg))

    # -- the kernel-log thread --------------------------------------------------------------

    def handle(self, rec: LogRecord) -> list[Event]:
        p = parse_message(rec.message, rec.identifier)
        if p is None:
            return []
        with self._lock:
            if p.kind == "xid":
                return [e for e in [self._xid(rec, p)] if e is not None]
            if p.kind == "gpu_at":
                self._pci_uuid[p.fields["pci"]] = p.fields["uuid"]
                return []
            if p.kind == "gpu_named":
                self._bus_lost.named(p.fields["pci"], rec.realtime)
                return []
            if p.kind == "bus_lost":
                return [e for e in [self._lost(rec, p)] if e is not None]
            if p.kind == "oomd":
                return self._oomd(rec, p)
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

    def _peers_alive(self, job_id: str, rank: int) -> tuple[int, int | None]:
        alive = sum(1 for (j, r), v in self._ranks.items() if j == job_id and r != rank and v.alive)
        view = self._ranks.get((job_id, rank))
        return alive, view.world_size if view else None

    def _kill_event(self, k: Kill) -> Event | None:
        if self._is_history(k):
            return None
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
            peers, world = self._peers_alive(m.job_id, m.rank)
            fields.update(peers_alive=peers, rank_pid=m.rank_pid)
            if world:
                fields["world_size"] = world
            subject = f"rank {m.rank} of job {m.job_id} (pid {k.pid}, {k.comm})"
            if m.worker:
                subject = (
                    f"worker pid {k.pid} ({k.comm}) of rank {m.rank} of job {m.job_id} "
                    f"(rank pid {m.rank_pid})"
                )
            summary = f"{subject} was killed by {by} at {fmt_time(k.time)}{holding}{where}"
            if peers:
                summary += f"; {peers} peers alive: they will wait in their next collective"
            snap = self._snapshots.get((m.job_id, str(m.rank), m.rank_pid))
            if snap is not None and snap.time <= k.time + 1.0:
                fields.update(memory_snapshot=snap.key, memory_snapshot_summary=snap.summary)
                summary += f"; last memory snapshot (event {snap.key}): {snap.summary}"
            severity, alert = PAGE, True
        return self._emit(
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

    def _emit(self, ev: Event) -> Event | None:
        return ev if self._store(ev) else None

    def _oomd(self, rec: LogRecord, p: Parsed) -> list[Event]:
        """systemd-oomd kills a whole cgroup: one event per rank process that lived in it."""
        cgroup = p.fields.get("cgroup", "")
        if self._is_history(Kill(0, "", KILLER_OOMD, rec.boot_id, rec.realtime, None, memcg=cgroup)):
            return []
        victims = self.record.ranks_in_cgroup(cgroup, rec.realtime)
        stamp = int(rec.realtime * 1e6)
        out: list[Event] = []
        if not victims:
            k = Kill(0, "", KILLER_OOMD, rec.boot_id, rec.realtime, None, memcg=cgroup)
            ev = Event(
                key=f"{rec.boot_id}:{KILLER_OOMD}:{cgroup}:{stamp}",
                kind="oom_kill",
                time=k.time,
                severity=WARNING,
                summary=f"systemd-oomd killed cgroup {cgroup} at {fmt_time(k.time)} "
                f"({p.fields.get('reason', '')}); no known rank lived in it",
                killer=KILLER_OOMD,
                boot_id=rec.boot_id,
                counter="oom_kills",
                labels=("", "", "", KILLER_OOMD),
                fields=frozen_map({"memcg": cgroup, "source": rec.source}),
            )
            return [e for e in [self._emit(ev)] if e is not None]
        for m in victims:
            peers, _ = self._peers_alive(m.job_id, m.rank)
            summary = (
                f"rank {m.rank} of job {m.job_id} (pid {m.pid}, {m.comm}) was killed by "
                f"systemd-oomd at {fmt_time(rec.realtime)} with its cgroup {cgroup} "
                f"({p.fields.get('reason', '')})"
            )
            if peers:
                summary += f"; {peers} peers alive: they will wait in their next collective"
            ev = Event(
                key=f"{rec.boot_id}:{KILLER_OOMD}:{m.pid}:{stamp}",
                kind="oom_kill",
                time=rec.realtime,
                severity=PAGE,
                summary=summary,
                job_id=m.job_id,
                rank=str(m.rank),
                pid=m.pid,
                comm=m.comm,
                killer=KILLER_OOMD,
                boot_id=rec.boot_id,
                counter="oom_kills",
                labels=(m.job_id, str(m.rank), m.comm, KILLER_OOMD),
                fields=frozen_map({"memcg": cgroup, "peers_alive": peers, "source": rec.source}),
                alert=True,
            )
            out += [e for e in [self._emit(ev)] if e is not None]
        return out

    def _lost(self, rec: LogRecord, p: Parsed) -> Event | None:
        """A GPU fell off the bus, said without an Xid number: an Xid 79 event (bus_lost.py)."""
        pci = self._bus_lost.pci_for(p.fields.get("pci", ""), rec.realtime)
        f = {**p.fields, "pci": pci, "xid": "79"}
        return self._xid(rec, replace(p, fields=f))

    def _xid(self, rec: LogRecord, p: Parsed) -> Event | None:
        f = p.fields
        pci = f.get("pci", "")
        try:
            xid = int(f.get("xid", ""))
        except ValueError:
            return None
        stamp = rec.monotonic_usec if rec.monotonic_usec is not None else int(rec.realtime * 1e6)
        no_xid = p.kind == "bus_lost"
        key = f"{rec.boot_id}:{'bus_lost' if no_xid else 'xid'}:{pci}:{xid}:{stamp}"
        if key in self._keys:
            return None
        gpu, uuid = "", self._pci_uuid.get(pci, "")
        count = xid != 79 or self._bus_lost.count(pci, rec.realtime, no_xid)
        if self.xid_dedup is not None:
            if count:
                count = bool(self.xid_dedup.record(pci, xid, rec.realtime, "kernel"))
            g, u = self.xid_dedup.labels_for(pci)
            gpu, uuid = g or gpu, u or uuid
        m = self.record.lookup(p.pid, rec.realtime) if p.pid is not None else None
        critical = xid in CRITICAL_XIDS
        who = ""
        if m is not None:
            who = f", process of rank {m.rank} of job {m.job_id} (pid {p.pid})"
        elif p.pid is not None:
            who = f", pid {p.pid} ({p.comm})"
        gpu_txt = f"GPU {gpu}" if gpu else "GPU"
        summary = (
            f"{gpu_txt} at PCI {pci}{' ' + uuid if uuid else ''} reported Xid {xid} at "
            f"{fmt_time(rec.realtime)}{who}: {f.get('rest', '')[:200]}"
        )
        if no_xid:
            rest = " ".join(x.strip() for x in f.get("rest", "").replace("\\x0a", "\n").split("\n"))
            summary = (
                f"{gpu_txt} at PCI {pci or 'unknown'}{' ' + uuid if uuid else ''} fell off the bus "
                f"at {fmt_time(rec.realtime)} (driver message without an Xid number, counted as "
                f"Xid 79): {rest[:200]}"
            )
        fields = {"xid": xid, "gpu": gpu, "uuid": uuid, "pci": pci, "source": rec.source}
        for k in ("gi", "ci"):
            if k in f:
                fields["mig_" + k] = f[k]
        if no_xid:
            fields.update(detail="fallen off the bus, no Xid number", pci_id=f.get("pci_id", ""))
        return self._emit(
            Event(
                key=key,
                kind="xid",
                time=rec.realtime,
                severity=PAGE if critical else INFO,
                summary=summary,
                job_id=m.job_id if m else "",
                rank=str(m.rank) if m else "",
                pid=p.pid,
                comm=p.comm,
                boot_id=rec.boot_id,
                # counted by the NVML watcher already: stored (once), not counted again
                counter="gpu_xid_errors" if count else "",
                labels=(gpu, uuid, str(xid)) if count else (),
                fields=frozen_map(fields),
                alert=critical,
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
            self._ranks = {(r.job_id, r.rank): _RankView(r.alive, r.world_size) for r in ranks}
        for r in ranks:
            if r.alive and r.process is not None:
                self.counters.ensure(
                    "oom_kills", (r.job_id, str(r.rank), r.process.comm, KILLER_KERNEL)
                )

    def cross_check(self, vmstat_oom_kill: int | None, now: float) -> list[Event]:
        """Kernel kills counted by /proc/vmstat that no parsed line explains, after a grace period
        (the line may still be on its way), become one unattributed event."""
        if vmstat_oom_kill is None:
            return []
        with self._lock:
            missing = vmstat_oom_kill - self.oom_baseline.kernel_kills() - self._boot_kernel_kills
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
            return [e for e in [self._emit(ev)] if e is not None]

    def recent(self, since: float | None = None) -> list[Event]:
        with self._lock:
            return [e for e in self._recent if since is None or e.time >= since]

    def with_peers(self, ev: Event) -> Event:
        """``ev`` with the peers-alive count of now (for findings shown long after the kill)."""
        if not ev.job_id:
            return ev
        peers, _ = self._peers_alive(ev.job_id, int(ev.rank))
        return replace(ev, fields=frozen_map({**ev.fields, "peers_alive_now": peers}))

