"""The durable event store: the events of ``state_dir/events.jsonl`` as the source of the event
counters, each event counted exactly once, the log compacted before it outgrows ``max_log_bytes``.

``EventStore`` is the daemon's one event log, a service built once (daemon/services.py,
``Services.events``): the kernel-event processor (join/kernel_events.py), the finding transitions,
the memory snapshots and the exits all record into it, and everything it reads is a constructor
argument. It does no I/O itself: the file is the
``EventFile`` it is handed (events/log.py, the one home of ``events.jsonl``: read back, size,
rewrite) and new events go to the bus, whose JSONL sink appends them. ``add`` stores an event
before it is counted (its key remembered in a ``BoundedKeys``), the constructor re-adds every
stored event's increment (counters continue across restarts), and a compaction (``compacted``: a
function of the stored events) folds old events into one ``counter_base`` record (counters of
ranks gone longer than ``retention_seconds`` and not in ``live_ranks()`` dropped). Thread-safe
(its own lock). Cost: one append per event; a compaction rewrites at most ``keep_events`` events
plus one record per counter series.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.counters import CounterStore, rank_label_positions
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import EventFile
from gpuwatchd.model import INFO, RankId, frozen_map
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import KILLER_KERNEL

log = logging.getLogger(__name__)

BASE_KIND = "counter_base"


Increment = tuple[str, tuple[str, ...], float, dict[str, int], float]
Totals = dict[tuple[str, tuple[str, ...]], tuple[float, float]]  # series -> (value, last change)


def _finite(v: Any) -> float | None:
    """``v`` as a finite float >= 0, or None (a stored line is untrusted input: 1e400, -1, "x")."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if 0.0 <= f < float("inf") else None


# The kernel OOM-killed one of gpuwatchd's own helpers (py-spy): counted in helper_oom_kills and
# in this boot's kernel kills (vmstat counts it too), never in oom_kills.
HELPER_OOM_KILL = "helper_oom_kill"


def _increments(ev: Event) -> list[Increment]:
    """(counter, labels, value, {boot id: kernel OOM kills}, when) that one stored event stands
    for. Items of a ``counter_base`` record that cannot be used are skipped."""
    if ev.kind == BASE_KIND:
        out: list[Increment] = []
        items = ev.fields.get("counters", [])
        for item in items if isinstance(items, list) else []:
            # [name, labels, value] or, since series retention, [name, labels, value, last time]
            if not isinstance(item, list) or len(item) not in (3, 4) or not isinstance(item[1], list):
                continue
            value = _finite(item[2])
            at = _finite(item[3]) if len(item) == 4 else ev.time
            if value is None or at is None:
                continue
            out.append((str(item[0]), tuple(str(x) for x in item[1]), value, {}, at))
        boots = ev.fields.get("boot_kernel_kills", {})
        if isinstance(boots, dict):
            clean = {
                str(b): int(n) for b, n in boots.items() if isinstance(n, int) and not isinstance(n, bool) and n >= 0
            }
            out.append(("", (), 0.0, clean, ev.time))
        return out
    kernel_kill = ev.kind in ("oom_kill", "oom_kill_unexplained", HELPER_OOM_KILL) and ev.killer == KILLER_KERNEL
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


@dataclass(frozen=True)
class Compaction:
    """What a compaction leaves: the log's new lines (the ``counter_base`` record first) and how
    many events it folded and kept."""

    lines: list[str]
    folded: int
    kept: int


def compacted(
    events: Iterable[Event], keep_events: int, retained: Callable[[Totals], Totals] | None = None
) -> Compaction | None:
    """Fold all but the newest ``keep_events`` of ``events`` (the stored ones, oldest first; a
    key seen twice counts once) into one ``counter_base`` record that carries their increments
    (and when each last changed), so the log stays bounded and the counters stay exact.
    ``retained``: the totals to keep of those folded (the store's retention). None when there is
    nothing to fold. One streaming pass: only the kept events' lines are held."""
    kept: deque[tuple[str, list[Increment], str, float]] = deque()
    keys: set[str] = set()
    totals: Totals = {}
    boots: dict[str, int] = {}
    dropped, last_key, last_time = 0, "", 0.0
    for ev in events:
        if ev.key in keys:
            continue
        keys.add(ev.key)
        kept.append((ev.to_json(), _increments(ev), ev.key, ev.time))
        if len(kept) <= keep_events:
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
        return None
    if retained is not None:
        totals = retained(totals)
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
    return Compaction([base.to_json(), *(line for line, _, _, _ in kept)], dropped, len(kept))


class EventStore:
    """``events.jsonl`` and the counters it stands for (see the module docstring)."""

    def __init__(
        self,
        file: EventFile,
        counters: CounterStore,
        *,
        bus: EventBus | None = None,
        boot_id: str = "",
        clock: Callable[[], float] = time.time,
        max_log_bytes: int = 16 << 20,
        keep_events: int = 10000,
        retention_seconds: float = 1800.0,
        recent_seconds: float = 3600.0,
        live_ranks: Callable[[], Iterable[RankId]] = tuple,
        read_back: bool = True,
    ) -> None:
        """``file``: the stored events, read back at start and rewritten by a compaction.
        ``bus``: where a new event goes (its JSONL sink appends to ``file``; None: counted only).
        ``boot_id``: this boot's, for the kernel OOM kills it counted. ``recent_seconds``: how
        long ``recent`` keeps kernel events. ``live_ranks``: the (job id, rank) registered now,
        whose counters a compaction keeps however old (``retention_seconds``: the others').
        ``read_back``: rebuild the counters from ``file`` (False: a one-cycle reader such as
        ``gpuwatchd ps``, which shows no counter and records nothing)."""
        self.file = file
        self.counters = counters
        self.bus = bus
        self.boot_id = boot_id
        self.clock = clock
        self.max_log_bytes = max_log_bytes
        self.keep_events = keep_events
        self.retention_seconds = retention_seconds  # retention.oom_kill_seconds, set at start
        self.recent_seconds = recent_seconds
        self.live_ranks = live_ranks
        self._lock = threading.RLock()
        # Keys of stored events, for exactly-once counting: kernel events (a re-read after a
        # restart or a lost cursor) and the rest (finding transitions), each bounded.
        self._keys = BoundedKeys(KERNEL_KEYS)
        self._other_keys = BoundedKeys(OTHER_KEYS)
        # kernel events (kills, Xids) of the last recent_seconds, for the findings
        self._recent: deque[Event] = deque(maxlen=10000)
        self._boot_kernel_kills = 0  # kernel OOM kills (parsed + unexplained) stored this boot
        self._snapshots: dict[tuple[str, str, int], Event] = {}  # (job_id, rank, rank pid) -> last
        self._log_bytes = 0
        self._compact_at = max_log_bytes
        # why the stored events could not be read back ("" when they were): counting new events
        # then would count them twice after the next start, so nothing is stored
        self.unreadable = ""
        if read_back:
            try:
                self._rebuild()
            except OSError as e:
                self.unreadable = f"{file.path}: {e.strerror or e}"
                log.error("the event log cannot be read back (%s): no event is stored or counted", self.unreadable)

    # -- what the processor reads ------------------------------------------------------------

    def emit(self, ev: Event) -> Event | None:
        """``ev`` when it was new and is now stored and counted; None for a duplicate."""
        return ev if self.add(ev) else None

    def has_kernel_key(self, key: str) -> bool:
        """Is a kernel event (one with a boot id or a counter) of this key stored?"""
        with self._lock:
            return key in self._keys

    def boot_kernel_kills(self) -> int:
        """Kernel OOM kills (parsed and unexplained) stored for this boot."""
        with self._lock:
            return self._boot_kernel_kills

    def recent(self, since: float | None = None) -> list[Event]:
        """Kernel events (kills, Xids) of the last ``recent_seconds``, oldest first."""
        with self._lock:
            return [e for e in self._recent if since is None or e.time >= since]

    def snapshot(self, job_id: str, rank: str, rank_pid: int) -> Event | None:
        """The last memory snapshot event of that rank process, if any."""
        with self._lock:
            return self._snapshots.get((job_id, rank, rank_pid))

    # -- start-up ----------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Counters continue across restarts: re-add every stored event's increment."""
        horizon = self.clock() - self.recent_seconds
        stored = 0
        for ev in self.file.events():  # the lines that cannot be used are counted there
            if self._seen(ev):
                continue
            self._account(ev)
            stored += 1
            if ev.time >= horizon and ev.kind in RECENT_KINDS:
                self._recent.append(ev)
        size = self.file.size()
        self._log_bytes = 0 if size is None else size
        if self._log_bytes > self.max_log_bytes and stored > self.keep_events:
            self._compact()
        self.file.track()

    def _maybe_compact(self) -> None:
        """While running (the log grows with finding transitions under job churn): compact when
        the log passes ``max_log_bytes``, folding the counters of ranks long gone away."""
        if self._log_bytes <= self._compact_at:
            return
        self._compact(prune=True)
        size = self.file.size()
        if size is None:
            size = self._log_bytes
        # the kept events alone may exceed the limit: then wait for another quarter of it
        self._log_bytes = size
        self._compact_at = max(self.max_log_bytes, size + self.max_log_bytes // 4)

    def _compact(self, prune: bool = False) -> None:
        """Rewrite the log as ``compacted`` folds it. ``prune``: leave out the counters of ranks
        not registered now whose last increment is older than ``retention_seconds``
        (retention.py dropped them already)."""
        # lines that cannot be used are left out (they were counted when read back at start)
        c = compacted(self.file.events(count_rejected=False), self.keep_events, self._retained if prune else None)
        if c is not None and self.file.rewrite(c.lines):
            log.info("event log compacted: %d events folded, %d kept", c.folded, c.kept)

    def _retained(self, totals: Mapping[tuple[str, tuple[str, ...]], tuple[float, float]]) -> Totals:
        positions = rank_label_positions()
        horizon = self.clock() - self.retention_seconds
        live = {(j, str(r)) for j, r in self.live_ranks()}
        out = {}
        for (name, labels), (v, last) in totals.items():
            pos = positions.get(name)
            if pos is not None and labels[pos[0]] and last < horizon and (labels[pos[0]], labels[pos[1]]) not in live:
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

    def add(self, ev: Event) -> bool:
        """Persist, count, fan out. False when the event was already stored (a duplicate), or
        the log could not be read back (``unreadable``)."""
        with self._lock:
            if self.unreadable or self._seen(ev):
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
