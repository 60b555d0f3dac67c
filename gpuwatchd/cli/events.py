"""``gpuwatchd events [--since WHEN] [--json]``: recent OOM kills and Xids, mapped to ranks.

Reads ``state_dir/events.jsonl`` (what the daemon stored, gpuwatchd/events/log.py); needs read access
to the state directory only, not a running daemon. Shell equivalent:
``dmesg -T | grep -iE 'killed process|NVRM: Xid'`` plus matching PIDs to ranks by hand.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import time
from typing import Any

from gpuwatchd.cli.common import EXIT_USAGE, CliError, resolve_config, unreadable
from gpuwatchd.escape import printable
from gpuwatchd.events.log import EVENTS_FILE, read_events
from gpuwatchd.model.events import Event
from gpuwatchd.units import fmt_rfc3339, fmt_time_local

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float) -> float:
    """``10m`` / ``2h`` / ``7d`` ago, ``all``, a Unix timestamp or an ISO 8601 time -> Unix seconds."""
    t = text.strip()
    if t == "all":
        return 0.0
    m = _DURATION.match(t)
    if m:
        return now - float(m[1]) * _UNIT[m[2]]
    try:
        return float(t)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--since: {text!r} is not a duration (10m, 2h, 7d), 'all', a Unix time or ISO 8601"
        ) from e
    if when.tzinfo is None:
        when = when.astimezone()  # local time, like journalctl --since
    return when.timestamp()


def load(state_dir: str, since: float) -> list[Event]:
    path = os.path.join(state_dir, EVENTS_FILE)
    # "counter_base" records are older events folded into counters (kernel_events compaction)
    return [e for e in read_events(path) if e.time >= since and e.kind != "counter_base"]


def to_dict(e: Event) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(e.to_json())
    d["time_iso"] = fmt_rfc3339(e.time)
    return d


def render(events: list[Event]) -> str:
    if not events:
        return "no events"
    rows: list[tuple[str, ...]] = [("TIME", "KIND", "BY", "JOB_ID", "RANK", "PID", "COMM", "WHAT")]
    for e in events:
        kind = e.kind + (" (worker)" if e.worker else "")
        by = e.killer or (f"xid {e.fields.get('xid')}" if e.kind == "xid" else "")
        rows.append(
            tuple(
                printable(cell)
                for cell in (  # a rank's strings, escaped
                    fmt_time_local(e.time),
                    kind,
                    by,
                    e.job_id or "-",
                    e.rank or "-",
                    str(e.pid) if e.pid is not None else "-",
                    e.comm or "-",
                    e.summary,
                )
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, r[-1]]))
    return "\n".join(lines)


def cmd_events(args: argparse.Namespace) -> int:

    state_dir = args.state_dir or resolve_config(args).state_dir
    try:
        since = parse_since(args.since, time.time())
    except argparse.ArgumentTypeError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    if not os.path.isdir(state_dir):
        raise CliError(f"no state directory {state_dir} (is this the daemon's state_dir?)", EXIT_USAGE)
    path = os.path.join(state_dir, EVENTS_FILE)
    try:
        events = load(state_dir, since)
    except OSError as e:
        raise unreadable(path, e) from None
    if args.json:
        json.dump([to_dict(e) for e in events], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render(events))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "events", help="recent OOM kills, Xid errors, rank deaths and other findings, mapped to jobs and ranks"
    )
    p.add_argument("--config.file", dest="config_file", default=None, help="YAML config")
    p.add_argument("--state-dir", default=None, help="read this state_dir instead of the config's")
    p.add_argument("--since", default="24h", help="10m, 2h, 7d, 'all', a Unix time or ISO 8601 (default 24h)")
    p.add_argument("--json", action="store_true", help="one JSON list of events")
    p.set_defaults(func=cmd_events)
