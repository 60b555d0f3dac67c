"""The OOM-kill baseline of a boot: kills the kernel counted before gpuwatchd first ran are history.

``/proc/vmstat oom_kill`` counts every kernel OOM kill since boot, and on a first start the kernel
log source replays whatever its buffer still holds (the kmsg ring since boot, the journal since
boot). Neither is something this daemon saw happen: a node that had 79 kills before the daemon was
installed must not log 79 "unexplained" kills, nor count the replayed ones as new. So at the first
start in a boot the daemon records a baseline, ``state_dir/oom_baseline.json``:
``{"boot_id", "vmstat_oom_kill", "time"}``. Kills logged before ``time`` are *history*: collected
here and reported once, plainly, as one ``oom_kill_history`` event; the cross-check only counts
kernel kills beyond ``vmstat_oom_kill``. A restart in the same boot keeps the baseline.

Reads/writes one small JSON file (bounded read, every field type-checked: a damaged file is
reported and replaced by a fresh baseline, never trusted). Pure apart from that file.
Shell equivalent: ``grep oom_kill /proc/vmstat`` at install time, ``dmesg -T | grep -i 'killed
process'`` for what the buffer held.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.model import INFO, frozen_map
from gpuwatchd.model.events import Event
from gpuwatchd.statefile import atomic_write, read_capped
from gpuwatchd.units import fmt_bytes

log = logging.getLogger(__name__)

BASELINE_FILE = "oom_baseline.json"
MAX_BASELINE_BYTES = 4096
SHOWN_KILLS = 10  # history kills named in the event; the rest are counted


@dataclass(frozen=True)
class Baseline:
    boot_id: str
    vmstat_oom_kill: int | None  # None: this kernel does not count OOM kills (RHEL 7, < 4.13)
    time: float  # Unix seconds at which it was taken: kills logged before it are history


def load_baseline(path: str, boot_id: str) -> tuple[Baseline | None, str]:
    """The stored baseline of this boot, or (None, why not): "" when absent or of another boot,
    else the damage found (the caller says so and takes a new one)."""
    try:
        raw = read_capped(path, MAX_BASELINE_BYTES)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    if len(raw) > MAX_BASELINE_BYTES:
        return None, f"larger than {MAX_BASELINE_BYTES} bytes"
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "not JSON"
    if not isinstance(d, dict):
        return None, "not a JSON object"
    boot, count, t = d.get("boot_id"), d.get("vmstat_oom_kill"), d.get("time")
    if not isinstance(boot, str) or not boot:
        return None, "boot_id missing"
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        return None, f"vmstat_oom_kill {count!r} is not a count"
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e11:
        return None, f"time {t!r} is not a Unix time"
    if boot != boot_id:
        return None, ""  # the baseline of an earlier boot: this is the first start in this one
    return Baseline(boot, count, float(t)), ""


def save_baseline(path: str, b: Baseline) -> None:
    """Atomically, leaving no temporary behind when the disk is full or read-only."""
    atomic_write(
        path, json.dumps({"boot_id": b.boot_id, "vmstat_oom_kill": b.vmstat_oom_kill, "time": b.time}), fsync=True
    )


@dataclass(frozen=True)
class HistoryKill:
    pid: int
    comm: str
    killer: str
    time: float
    rss_bytes: int | None
    memcg: str


class History:
    """The kills the replayed log held from before the baseline (bounded: SHOWN_KILLS kept)."""

    def __init__(self) -> None:
        self.count = 0
        self.kernel = 0
        self.oldest: float | None = None
        self.newest: float | None = None
        self.shown: list[HistoryKill] = []

    def add(self, k: HistoryKill) -> None:
        self.count += 1
        self.kernel += k.killer == "kernel"
        self.oldest = k.time if self.oldest is None else min(self.oldest, k.time)
        self.newest = k.time if self.newest is None else max(self.newest, k.time)
        self.shown.append(k)
        if len(self.shown) > SHOWN_KILLS:
            self.shown.pop(0)  # keep the most recent ones: the likeliest to matter

    def summary(self, b: Baseline, source: str, fmt_time: Callable[[float], str]) -> str:
        """One plain sentence: what the kernel counted before the first start, what the buffer
        held of it, and that none of it is counted."""
        if b.vmstat_oom_kill is None:
            counted = "this kernel does not count OOM kills (/proc/vmstat has no oom_kill)"
        else:
            counted = f"the kernel had counted {b.vmstat_oom_kill} OOM kill(s) since boot"
        text = (
            f"first start of gpuwatchd in this boot (at {fmt_time(b.time)}): {counted}; "
            "kills before now are history, not counted"
        )
        if not source:
            return text + "; the kernel log was not read (off or unavailable), so what it held is unknown"
        if not self.count:
            return text + f"; the kernel log ({source}) held none of them"
        text += f"; the kernel log ({source}) still held {self.count} kill(s)"
        if b.vmstat_oom_kill is not None and self.kernel < b.vmstat_oom_kill:
            text += f" ({b.vmstat_oom_kill - self.kernel} older kernel kill(s) had left it)"
        names = []
        for k in reversed(self.shown):
            rss = f", {fmt_bytes(k.rss_bytes)} RSS" if k.rss_bytes is not None else ""
            where = f" in {k.memcg}" if k.memcg else ""
            victim = f"pid {k.pid} ({k.comm})" if k.pid else f"cgroup {k.memcg}"  # oomd: a cgroup
            if not k.pid:
                where = ""
            names.append(f"{victim} by {k.killer} at {fmt_time(k.time)}{rss}{where}")
        more = f", and {self.count - len(self.shown)} more" if self.count > len(self.shown) else ""
        return f"{text}: {'; '.join(names)}{more}"


class OomBaseline:
    """The baseline of this boot and, on the first start, the history the source replays.
    Not thread-safe: the kernel-event processor calls it under its lock."""

    def __init__(self, state_dir: str, boot_id: str) -> None:
        self.path = os.path.join(state_dir, BASELINE_FILE)
        self.boot_id = boot_id
        self.baseline: Baseline | None = None  # None: none taken (every kill is new)
        self.history: History | None = None  # set on the first start in a boot, until reported

    def take(self, vmstat_oom_kill: int | None, stored_kernel_kills: int, now: float) -> bool:
        """Load this boot's baseline, or take it now (True). Kernel kills already stored for this
        boot (a daemon that ran before baselines existed) stay accounted for."""
        b, damage = load_baseline(self.path, self.boot_id)
        if b is not None:
            self.baseline = b
            return False
        if damage:
            log.warning(
                "OOM baseline %s %s: taking a new one; kills logged before now are treated as history",
                self.path,
                damage,
            )
        base = None if vmstat_oom_kill is None else max(0, vmstat_oom_kill - stored_kernel_kills)
        self.baseline = Baseline(self.boot_id, base, now)
        self.history = History()
        try:
            save_baseline(self.path, self.baseline)
        except OSError as e:
            log.warning("cannot save OOM baseline %s: %s", self.path, e)
        return True

    def kernel_kills(self) -> int:
        """Kernel kills of this boot from before the baseline (0 without one)."""
        if self.baseline is None or self.baseline.vmstat_oom_kill is None:
            return 0
        return self.baseline.vmstat_oom_kill

    def is_history(self, k: HistoryKill) -> bool:
        """Logged before the baseline: collected for the history event, never counted."""
        b = self.baseline
        if b is None or k.time >= b.time:
            return False
        if self.history is not None:
            self.history.add(k)
        return True

    def history_event(self, source: str, fmt_time: Callable[[float], str]) -> Event | None:
        """The one ``oom_kill_history`` event of a first start (None once reported)."""
        b, h = self.baseline, self.history
        if b is None or h is None:
            return None
        self.history = None
        shown = [
            {
                "pid": k.pid,
                "comm": k.comm,
                "killer": k.killer,
                "time": k.time,
                "rss_bytes": k.rss_bytes,
                "memcg": k.memcg,
            }
            for k in h.shown
        ]
        return Event(
            key=f"{b.boot_id}:history:{b.time}",
            kind="oom_kill_history",
            time=b.time,
            severity=INFO,
            summary=h.summary(b, source, fmt_time),
            boot_id=b.boot_id,
            fields=frozen_map(
                {
                    "vmstat_oom_kill": b.vmstat_oom_kill,
                    "replayed_kills": h.count,
                    "replayed_kernel_kills": h.kernel,
                    "oldest": h.oldest,
                    "newest": h.newest,
                    "kills": shown,
                    "source": source,
                }
            ),
        )
