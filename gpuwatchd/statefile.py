"""Writing and reading the files of ``state_dir`` (state.json, events.jsonl, rank_trees.json,
kmsg.json, journal.cursor, job_owners.json): atomic, with nothing left behind, and every failure exported.

A full or read-only ``state_dir`` must not be a log line per cycle that nobody reads:
``gpuwatch_state_write_errors_total{file}`` counts each failed write (``ENOSPC``, ``EROFS``,
``EACCES`` ...), the log says so once when a file starts failing and once when it recovers, and a
failed atomic write removes its temporary file (``<file>.tmp.<pid>``), so that a full disk does not
also fill up with empty temporaries. What the daemon reads back is untrusted input (a crash, a disk
error or a hand edit can leave anything): a record that cannot be used is skipped and counted in
``gpuwatch_state_records_rejected_total{file,reason}``.

Costs one ``open``/``write``/``rename`` per write (plus ``fsync`` where asked); no privilege
beyond write access to ``state_dir``. Shell equivalent: ``df -h /var/lib/gpuwatchd``,
``ls -la /var/lib/gpuwatchd``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading

from gpuwatchd.counters import CounterStore
from gpuwatchd.paths import read_bounded

log = logging.getLogger(__name__)

STATE_FILES = ("state.json", "events.jsonl", "rank_trees.json", "kmsg.json", "journal.cursor", "job_owners.json")
# The temporaries of atomic_write, of the writers before it (".tmp") and of compaction.
_TMP = re.compile(r"^(?P<file>.+?)\.(?:tmp(?:\.(?P<pid>\d+))?|compact)$")


# Every file in state_dir: read-write for the daemon's user, readable by its group. The unit makes
# state_dir 0750 gpuwatchd:gpuwatchd, so `usermod -aG gpuwatchd alice` lets alice's `gpuwatchd ps`
# and `events` read the daemon's state (none of it holds an environment value or an argument:
# tests/test_no_secrets.py), and nobody else.
FILE_MODE = 0o640


def atomic_write(path: str, data: str | bytes, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` (write a temporary beside it, then rename). On any error the
    temporary is removed and the error raised; ``path`` keeps its old content."""
    tmp = f"{path}.tmp.{os.getpid()}"
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask (the unit's UMask=0077 would make 0600)
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_capped(path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (one more than allowed, so the caller can tell an
    oversized file); FileNotFoundError / OSError as ``open`` raises them."""
    return read_bounded(path, limit + 1)


def make_state_dir(path: str) -> None:
    """Create ``state_dir`` if missing; an unwritable one is not an error here (each write is
    counted where it fails)."""
    with contextlib.suppress(OSError):
        os.makedirs(path, exist_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_temporaries(state_dir: str) -> list[str]:
    """Remove temporaries a killed daemon left in ``state_dir`` (a crash between write and rename).
    Only names of the form ``<file>.tmp``, ``<file>.tmp.<pid>`` and ``<file>.compact``."""
    removed: list[str] = []
    try:
        names = os.listdir(state_dir)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if m is None or m["file"] not in STATE_FILES:
            continue
        pid = int(m["pid"]) if m["pid"] else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue  # another live process (a second daemon on the same state_dir) writes it
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(state_dir, name))
            removed.append(name)
    return removed


class StateFiles:
    """Counts and logs the outcome of each write to a state file (thread-safe). ``counters`` None:
    log only (the CLI's read-only users)."""

    def __init__(self, counters: CounterStore | None = None) -> None:
        self.counters = counters
        self._failing: dict[str, str] = {}  # file -> the error it fails with
        self._lock = threading.Lock()

    def _name(self, path: str) -> str:
        return os.path.basename(path)

    def track(self, path: str) -> None:
        """Export the file's write-error counter at 0 from now on (so ``increase()`` sees the first
        failure)."""
        if self.counters is not None:
            self.counters.ensure("state_write_errors", (self._name(path),))

    def write(self, path: str, data: str | bytes, fsync: bool = False) -> bool:
        """``atomic_write`` with the outcome counted; False when it failed."""
        self.track(path)
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            atomic_write(path, data, fsync)
        except OSError as e:
            self.failed(path, e)
            return False
        self.succeeded(path)
        return True

    def failed(self, path: str, error: OSError) -> None:
        name = self._name(path)
        if self.counters is not None:
            self.counters.inc("state_write_errors", (name,))
        why = f"{type(error).__name__}: {error.strerror or error}"
        with self._lock:
            first = name not in self._failing
            self._failing[name] = why
        if first:
            log.warning(
                "cannot write state file %s: %s (counted in "
                "gpuwatch_state_write_errors_total; logged again when it recovers)",
                path,
                why,
            )
        else:
            log.debug("cannot write state file %s: %s", path, why)

    def succeeded(self, path: str) -> None:
        name = self._name(path)
        with self._lock:
            was = self._failing.pop(name, None)
        if was is not None:
            log.warning("state file %s is written again (it failed with %s)", path, was)

    def rejected(self, path: str, reason: str) -> None:
        """A record read back from ``path`` could not be used."""
        if self.counters is not None:
            self.counters.inc("state_records_rejected", (self._name(path), reason))
