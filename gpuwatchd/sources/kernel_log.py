"""Kernel log: OOM kills and NVIDIA Xid errors, from the systemd journal or from /dev/kmsg.

Reads: the systemd journal through systemd-python (kernel transport plus the ``systemd-oomd`` and
``earlyoom`` daemons), or ``/dev/kmsg`` on nodes without journald (containers, minimal images).
Both are event-driven: the thread sleeps in ``poll()`` on the kmsg fd / the journal's inotify fd
and wakes only when the kernel writes a record, so an idle node costs nothing.
Privilege: /dev/kmsg needs root or CAP_SYSLOG (``dmesg_restrict``); the journal needs membership of
``systemd-journal`` / ``adm`` or CAP_DAC_READ_SEARCH.
Resume: the kmsg sequence number plus the boot id, or the journal cursor, are persisted in
``state_dir`` after every batch, so a restarted daemon reads exactly the records it has not seen.
Shell equivalent: ``dmesg -T | grep -iE 'killed process|oom-kill:|NVRM: Xid'`` or
``journalctl -k -o json -g 'Killed process|NVRM: Xid'``.

Line formats and regexes: shared/research/gil-hang-oom.md §4 (kernels 3.x to 6.18, drivers with
and without ``PCI:``/MIG instance ids), tested on the recorded lines in tests/fixtures/kernel/.
Formats found missing in public reports (RHEL 6/7 ``Killed process N, UID U``, pre-1.6 earlyoom,
a GPU fallen off the bus without an Xid number) are parsed in sources/kernel_formats.py.

The parsers are in sources/kernel_lines.py, the two sources in sources/kmsg.py and
sources/journal.py; this module picks one (``open_kernel_log``), reads the small /proc files the
kernel-log subsystem needs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.journal import JournalSource, journal_available
from gpuwatchd.sources.kernel_lines import RejectHandler
from gpuwatchd.sources.kmsg import KmsgSource
from gpuwatchd.statefile import StateFiles

log = logging.getLogger(__name__)

__all__ = ["KernelLogUnavailable", "open_kernel_log", "read_vmstat_oom_kill"]


class KernelLogUnavailable(Exception):
    """The configured kernel log cannot be read on this host (reason in the message)."""


def open_kernel_log(
    mode: str,
    paths: HostPaths,
    state_dir: str,
    journal_path: str | None = None,
    on_reject: RejectHandler | None = None,
    on_overrun: Callable[[], None] | None = None,
    files: StateFiles | None = None,
) -> KmsgSource | JournalSource | None:
    """``kernel_log`` config key -> a source. ``auto``: the journal when journald runs and
    systemd-python imports, else /dev/kmsg. ``off`` -> None."""
    if mode == "off":
        return None
    if mode == "journal" or (mode == "auto" and (journal_path or journal_available(paths))):
        try:
            import systemd.journal  # noqa: F401
        except ImportError as e:
            raise KernelLogUnavailable("kernel_log: journal needs systemd-python") from e
        return JournalSource(state_dir, path=journal_path, on_reject=on_reject, paths=paths, files=files)
    if mode in ("kmsg", "auto"):
        dev = paths.dev("kmsg")
        if not os.path.exists(dev):
            raise KernelLogUnavailable(f"{dev} does not exist")
        return KmsgSource(state_dir, paths=paths, on_reject=on_reject, on_overrun=on_overrun, files=files)
    raise KernelLogUnavailable(f"unknown kernel_log mode {mode!r}")


def read_vmstat_oom_kill(paths: HostPaths) -> int | None:
    """The kernel's own count of OOM kills since boot (``grep oom_kill /proc/vmstat``, 4.13+)."""
    try:
        with open(paths.proc("vmstat"), "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
