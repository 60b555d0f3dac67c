"""What the kernel log says, as values: the normalised record either source hands to the event
processor (``LogRecord``), one recognised message (``Parsed``), who killed (``KILLER_*``), the Xids
that page and the words for an OOM kill's scope. Produced by sources/kernel_lines.py, kmsg.py and
journal.py; attributed by join/kernel_events.py; worded by findings/rank_oom_killed.py and findings/xid_critical.py.
No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

KILLER_KERNEL = "kernel"
KILLER_OOMD = "systemd-oomd"
KILLER_EARLYOOM = "earlyoom"
USERSPACE_KILLERS = (KILLER_OOMD, KILLER_EARLYOOM)


@dataclass(frozen=True)
class Parsed:
    """One recognised log message. ``kind`` selects which of the fields are meaningful."""

    kind: str  # killed | kill_old | summary | invoked | reaper | task_in | oom_group |
    #            memcg_stats | xid | gpu_at | bus_lost | gpu_named | oomd | earlyoom | fault
    pid: int | None = None
    comm: str = ""
    fields: Mapping[str, str] = field(default_factory=dict)


def _kb(s: str | None) -> int:
    return int(s) if s else 0


def rss_bytes(p: Parsed) -> int | None:
    """RSS at kill (anon + file + shmem) from a ``killed`` / ``earlyoom`` message."""
    f = p.fields
    if p.kind == "killed":
        kb = _kb(f.get("anon_rss_kb")) + _kb(f.get("file_rss_kb")) + _kb(f.get("shmem_rss_kb"))
        return 1024 * kb
    if p.kind == "earlyoom" and "rss_kb" in f:
        return 1024 * int(f["rss_kb"])
    return None


@dataclass(frozen=True)
class LogRecord:
    """One message of either source, normalised. ``monotonic_usec`` is the kernel's timestamp (the
    same number in /dev/kmsg and in the journal's ``_SOURCE_MONOTONIC_TIMESTAMP``), so a kill read
    once through each source has one identity."""

    message: str
    identifier: str  # kernel | systemd-oomd | earlyoom
    boot_id: str
    monotonic_usec: int | None
    realtime: float  # Unix seconds
    source: str  # kmsg | journal
    seq: int | None = None
    cursor: str | None = None


# Xids that page: the same set as the GPUXidCritical rule (deploy/prometheus/gpuwatchd.rules.yml,
# after the NVIDIA Xid catalog and shared/research/gil-hang-oom.md §4.5): broken GPU, memory or
# links. App-level faults (13, 31, 43) and informational ones (45) are counted but do not page.
CRITICAL_XIDS = frozenset({48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 94, 95, 119, 120})


def scope_phrase(scope: str, constraint: str, oom_memcg: str, memcg: str = "") -> str:
    """Why the kernel killed: a memory cgroup's limit (a container / job limit) or the whole node
    out of memory; "" when the log does not say (a summary whose kill line was lost)."""
    if constraint == "CONSTRAINT_MEMCG" or scope == "Memory cgroup out of memory":
        if oom_memcg and oom_memcg != memcg:
            return f" (limit of memory cgroup {oom_memcg} reached)"
        return " (the cgroup's memory limit was reached)" if memcg else " (its memory cgroup's limit was reached)"
    if constraint == "CONSTRAINT_NONE" or scope.startswith("Out of memory"):
        return " (the node ran out of memory)"
    return ""
