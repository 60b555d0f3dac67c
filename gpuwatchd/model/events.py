"""``Event``: one thing that happened once (an OOM kill, an Xid ...), unlike a ``Finding``, which
is a state. Built by join/ (kernel_events.py, kernel_notices.py), worded by findings/ (oom.py,
xid.py), written by events/log.py to ``state_dir/events.jsonl`` and the other sinks. No I/O.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.model import frozen_map

MAX_COUNT = 1 << 53  # the largest count a float counter holds exactly
MAX_TIME = 253402300800.0  # year 10000: later times cannot be formatted (gpuwatchd events)


@dataclass(frozen=True)
class Event:
    """One occurrence. ``key`` identifies it across sources and restarts (for a kernel record:
    boot id + kernel timestamp + PID), so that it is stored and counted at most once."""

    key: str
    kind: str  # oom_kill | xid | oom_kill_unexplained | oom_kill_history | memory_snapshot | ...
    time: float  # Unix seconds of the occurrence (the kernel's timestamp, not when we read it)
    severity: str
    summary: str  # the one line a human reads
    job_id: str = ""
    rank: str = ""
    pid: int | None = None
    comm: str = ""
    killer: str = ""  # kernel | systemd-oomd | earlyoom (oom kills)
    worker: bool = False  # the victim was a child of the rank (DataLoader worker), not the rank
    boot_id: str = ""
    counter: str = ""  # the CounterStore counter this event incremented ("" for none)
    labels: tuple[str, ...] = ()  # its label values
    count: int = 1
    fields: Mapping[str, Any] = field(default_factory=frozen_map)  # rss_bytes, memcg, xid, gpu ...
    alert: bool = False  # worth a page (pushed to Alertmanager when configured)

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fields"] = dict(self.fields)
        d["labels"] = list(self.labels)
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Event:
        if not isinstance(d.get("key"), str) or not isinstance(d.get("kind"), str):
            raise ValueError("event without key/kind")
        labels = d.get("labels") or ()
        if not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) for x in labels):
            raise ValueError("bad labels")
        fields = d.get("fields") or {}
        if not isinstance(fields, dict):
            raise ValueError("bad fields")
        pid = d.get("pid")
        when = d.get("time", 0.0)
        if (
            isinstance(when, bool)
            or not isinstance(when, (int, float))
            or not math.isfinite(when)
            or not 0 <= when < MAX_TIME
        ):
            raise ValueError(f"bad time {when!r}"[:80])
        count = d.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
            raise ValueError(f"bad count {count!r}"[:80])
        return cls(
            key=d["key"],
            kind=d["kind"],
            time=float(when),
            severity=str(d.get("severity", "")),
            summary=str(d.get("summary", "")),
            job_id=str(d.get("job_id", "")),
            rank=str(d.get("rank", "")),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 32 else None,
            comm=str(d.get("comm", "")),
            killer=str(d.get("killer", "")),
            worker=bool(d.get("worker", False)),
            boot_id=str(d.get("boot_id", "")),
            counter=str(d.get("counter", "")),
            labels=tuple(labels),
            count=count,
            fields=frozen_map(fields),
            alert=bool(d.get("alert", False)),
        )
