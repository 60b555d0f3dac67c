"""Human-readable units for explanations and CLI tables: sizes (binary prefixes, as nvidia-smi and
CUDA's OOM message use), PCI addresses, durations and times.

The one time policy (every time gpuwatchd writes for a reader is formatted here; only the HTTP
``Date`` header, ``web/request.http_date``, follows its own RFC):

- what a program reads (Alertmanager's ``startsAt``/``endsAt``, ``time_iso`` of ``gpuwatchd events
  --json``) is RFC 3339 in UTC with a ``Z`` (``fmt_rfc3339``); the event log itself stores Unix
  seconds;
- a stamp kept in an event's summary (events.jsonl, read days later, maybe on another host) is
  UTC and says so: ``fmt_time`` -> ``2026-01-01 00:00:00 UTC``; a clock time that must be read
  beside such stamps says so too (``fmt_clock_utc``, ``fmt_clock_ms``);
- a clock time inside a finding's explanation (which lives while the finding is open and is read
  beside the node's own logs) and the ``gpuwatchd events`` table are the node's local time
  (``fmt_clock``, ``fmt_time_local``), as ``journalctl`` and ``date`` on the node print it.

Pure; costs nothing.
"""

from __future__ import annotations

import datetime as dt
import re
import time


def fmt_bytes(n: float | None, none: str = "unknown") -> str:
    """``57_982_058_496`` -> ``"54.0 GiB"``; None -> ``none``."""
    if n is None:
        return none
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# PCI addresses as NVML, the kernel log and udev print them, reduced to one key (domain:bus:device)
_PCI = re.compile(
    r"(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"(?:\.(?P<fn>[0-7]))?"
)


def normalize_pci_bus_id(text: str) -> str:
    """'00000000:3B:00.0', 'PCI:0000:3b:00', '3b:00.0' -> '0000:3b:00'; unknown text unchanged."""
    m = _PCI.search(text.strip())
    if m is None:
        return text.strip().lower()
    domain = (m.group("domain") or "0000")[-4:].lower()
    return f"{domain}:{m.group('bus').lower()}:{m.group('dev').lower()}"


def fmt_rfc3339(t: float) -> str:
    """``0.0`` -> ``"1970-01-01T00:00:00Z"``: UTC, for programs."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def fmt_time(t: float) -> str:
    """``0.0`` -> ``"1970-01-01 00:00:00 UTC"``: a stamp kept in an event's summary."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def fmt_time_local(t: float) -> str:
    """The node's local date and time, ``"1970-01-01 00:00:00"`` (the ``gpuwatchd events`` table)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_clock(t: float) -> str:
    """The node's local clock time, ``"14:21:50"``, in a finding's explanation."""
    return time.strftime("%H:%M:%S", time.localtime(t))


def fmt_clock_utc(t: float) -> str:
    """``1000.0`` -> ``"00:16:40 UTC"``."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def fmt_clock_ms(t: float) -> str:
    """``1000.25`` -> ``"00:16:40.250Z"``: UTC to the millisecond (``gpuwatchd job`` compares the
    failure times of several nodes)."""
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d}Z"


def fmt_duration(seconds: float) -> str:
    """``95`` -> ``"about 2 minutes"``; words a person reads in an alert."""
    s = max(0.0, seconds)
    if s < 90:
        return f"about {max(1, round(s / 5) * 5 if s >= 10 else round(s))} seconds"
    if s < 90 * 60:
        return f"about {round(s / 60)} minutes"
    if s < 48 * 3600:
        return f"about {s / 3600:.1f} hours"
    return f"about {round(s / 86400)} days"


def fmt_span(seconds: float) -> str:
    """``300`` -> ``"5 min"``: how long something took, in a snapshot line."""
    s = max(0.0, seconds)
    if s < 90:
        return f"{round(s)} s"
    if s < 90 * 60:
        return f"{round(s / 60)} min"
    return f"{s / 3600:.1f} h"


def fmt_age(seconds: float) -> str:
    """``4000`` -> ``"1 h 6 min"``: the age of a process, in whole units."""
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d"
