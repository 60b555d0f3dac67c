"""The systemd journal as a kernel-log source, through systemd-python: the kernel transport plus
the ``systemd-oomd`` and ``earlyoom`` daemons.

Event-driven: the thread sleeps in ``poll()`` on the journal's inotify fd. Privilege: membership
of ``systemd-journal`` / ``adm`` or CAP_DAC_READ_SEARCH. Resume: the journal cursor, persisted in
``state_dir`` after every batch. Shell equivalent: ``journalctl -k -o json``.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpuwatchd.model.kernel import KILLER_EARLYOOM, KILLER_KERNEL, KILLER_OOMD, USERSPACE_KILLERS, LogRecord
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.kernel_lines import MAX_MESSAGE, Handler, RejectHandler, SourceStats
from gpuwatchd.sources.kmsg import Stopper
from gpuwatchd.statefile import StateFiles, atomic_write

log = logging.getLogger(__name__)


def journal_available(paths: HostPaths | None = None) -> bool:
    """journald runs (its socket exists) and systemd-python imports."""
    p = paths or HostPaths()
    if not os.path.exists(os.path.join(p.rootfs, "run/systemd/journal/socket")):
        return False
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        log.warning(
            "journald runs but systemd-python is not installed (pip install "
            "'gpuwatchd[journal]', which needs libsystemd-dev and pkg-config): reading the "
            "kernel log from /dev/kmsg instead, without systemd-oomd and earlyoom kills"
        )
        return False
    return True


def _to_text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def _usec(v: Any) -> int | None:
    """A journal timestamp field as converted by systemd-python (timedelta / datetime / str)."""
    if v is None:
        return None
    seconds = getattr(v, "total_seconds", None)
    if callable(seconds):
        return round(seconds() * 1e6)
    ts = getattr(v, "timestamp", None)
    if callable(ts):
        return round(ts() * 1e6)
    if isinstance(v, (list, tuple)) and v:  # Reader(...) may return MonotonicType(timedelta, uuid)
        return _usec(v[0])
    try:
        return int(_to_text(v))
    except ValueError:
        return None


class JournalSource:
    """Follow the systemd journal: kernel transport plus systemd-oomd and earlyoom.

    ``path``: a journal directory or one ``.journal`` file instead of the system journal (recorded
    journals in tests, a container reading the host's /var/log/journal). The cursor of the last
    entry handled is saved to ``state_dir/journal.cursor`` after each batch.
    """

    name = "journal"

    def __init__(
        self,
        state_dir: str,
        path: str | None = None,
        start: str = "boot",  # where a first start begins: "boot" (this boot) | "head" | "tail"
        on_reject: RejectHandler | None = None,
        paths: HostPaths | None = None,
        clock: Callable[[], float] = time.time,
        files: StateFiles | None = None,
    ) -> None:
        self.files = files  # counts failed cursor writes (statefile.py)
        self.path = path
        self.start = start
        self.state_path = os.path.join(state_dir, "journal.cursor")
        self.stats = SourceStats()
        self._on_reject = on_reject
        self._stopper = Stopper()
        self.paths = paths or HostPaths()
        self._clock = clock
        self.ready = threading.Event()

    def hold_cursor(self, oldest_unfinished: Callable[[], int | None]) -> None:
        """Journal cursors are not sequence numbers; a kill grouped across a restart is still
        counted once (the event key), so nothing to hold here."""

    def stop(self) -> None:
        self._stopper.stop()

    def _open(self) -> Any:
        from systemd import journal

        if self.path is None:
            reader = journal.Reader()
        elif os.path.isdir(self.path):
            reader = journal.Reader(path=self.path)
        else:
            reader = journal.Reader(files=[self.path])
        reader.add_match(_TRANSPORT="kernel")
        reader.add_disjunction()
        reader.add_match(_COMM=KILLER_OOMD)
        reader.add_disjunction()
        reader.add_match(_COMM=KILLER_EARLYOOM)
        return reader

    def _load_cursor(self) -> str | None:
        try:
            with open(self.state_path, errors="replace") as f:
                c = f.read(4096).strip()  # a cursor is < 200 bytes; a state file is untrusted
        except OSError:
            return None
        return c or None

    def _seek(self, reader: Any) -> None:
        cursor = self._load_cursor()
        if cursor:
            try:
                reader.seek_cursor(cursor)
                entry = reader.get_next()
                if entry and reader.test_cursor(cursor):
                    return  # positioned just after the last handled entry
                reader.get_previous()  # cursor entry vanished (rotated/vacuumed): resume there
                return
            except OSError as e:
                log.warning("journal cursor unusable (%s); starting from %s", e, self.start)
        if self.start == "head" or self.path is not None:
            reader.seek_head()
        elif self.start == "tail":
            reader.seek_tail()
            reader.get_previous()
        else:
            try:
                with open(self.paths.proc("uptime")) as f:
                    uptime = float(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                uptime = 0.0
            reader.seek_realtime(self._clock() - uptime)

    def entries(self, reader: Any) -> Iterator[LogRecord]:
        while True:
            entry = reader.get_next()
            if not entry:
                return
            rec = self.to_record(entry)
            if rec is not None:
                yield rec

    def to_record(self, entry: Mapping[str, Any]) -> LogRecord | None:
        transport = _to_text(entry.get("_TRANSPORT", ""))
        comm = _to_text(entry.get("_COMM", ""))
        if transport == "kernel":
            identifier = KILLER_KERNEL
        elif comm in USERSPACE_KILLERS:
            identifier = comm  # _COMM is set by journald itself: a client cannot fake it
        else:
            return None
        msg = entry.get("MESSAGE")
        if msg is None:
            self.stats.reject("malformed")
            return None
        if isinstance(msg, (list, tuple)):
            msg = msg[0] if msg else ""
        message = _to_text(msg)[:MAX_MESSAGE]
        mono = _usec(entry.get("_SOURCE_MONOTONIC_TIMESTAMP"))
        if mono is None and identifier == KILLER_KERNEL:
            mono = _usec(entry.get("__MONOTONIC_TIMESTAMP"))
        rt = _usec(entry.get("__REALTIME_TIMESTAMP"))
        boot = entry.get("_BOOT_ID", "")
        boot_id = str(boot) if boot else ""
        return LogRecord(
            message=message,
            identifier=identifier,
            boot_id=boot_id,
            monotonic_usec=mono,
            realtime=rt / 1e6 if rt is not None else self._clock(),
            source="journal",
            cursor=_to_text(entry.get("__CURSOR", "")) or None,
        )

    def run(self, handler: Handler) -> None:
        reader = self._open()
        try:
            self._seek(reader)
            poller = select.poll()
            poller.register(reader.fileno(), reader.get_events())
            poller.register(self._stopper.fd, select.POLLIN)
            while not self._stopper.event.is_set():
                cursor = None
                for rec in self.entries(reader):
                    self.stats.records += 1
                    handler(rec)
                    cursor = rec.cursor or cursor
                if cursor:
                    try:
                        if self.files is not None:
                            if not self.files.write(self.state_path, cursor, fsync=True):
                                raise OSError(f"cannot write {self.state_path}")
                        else:
                            atomic_write(self.state_path, cursor, fsync=True)
                    except OSError as e:
                        self.stats.last_error = f"cannot save journal cursor: {e}"
                self.ready.set()
                # sd_journal_get_timeout(): how long inotify alone may be trusted; -1 = forever.
                timeout_ms = reader.get_timeout_ms()
                poller.poll(None if timeout_ms < 0 else max(timeout_ms, 100))
                reader.process()  # consume the inotify events, pick up new/rotated files
        finally:
            reader.close()
            self._stopper.close()
