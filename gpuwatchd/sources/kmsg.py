"""``/dev/kmsg`` as a kernel-log source (nodes without journald: containers, minimal images).

Event-driven: the thread sleeps in ``poll()`` on the kmsg fd. Privilege: root or CAP_SYSLOG
(``dmesg_restrict``). Resume: the sequence number plus the boot id (``read_boot_id``), persisted
in ``state_dir`` after every batch. Shell equivalent: ``dmesg -T``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from gpuwatchd.model.kernel import KILLER_KERNEL, LogRecord
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.kernel_lines import INTERESTING, KMSG_READ_SIZE, Handler, RejectHandler, SourceStats, parse_kmsg
from gpuwatchd.statefile import StateFiles, atomic_write

log = logging.getLogger(__name__)


def read_boot_id(paths: HostPaths) -> str:
    try:
        with open(paths.proc("sys", "kernel", "random", "boot_id")) as f:
            return f.read().strip()
    except OSError:
        return ""


class Stopper:
    """A self-pipe: ``stop()`` wakes the reader out of ``poll()`` at once, without a timeout."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.event = threading.Event()

    @property
    def fd(self) -> int:
        return self._r

    def stop(self) -> None:
        if not self.event.is_set():
            self.event.set()
            with contextlib.suppress(OSError):
                os.write(self._w, b"x")

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


class KmsgSource:
    """Tail /dev/kmsg: kernel facility only, resume by (boot id, sequence number), EPIPE counted.

    ``run(handler)`` blocks in its own thread until ``stop()``; ``handler`` is called for every
    kernel record in order. After each batch (the moment the ring has nothing more to read) the last
    sequence number is saved to ``state_dir/kmsg.json``.
    """

    name = "kmsg"

    def __init__(
        self,
        state_dir: str,
        paths: HostPaths | None = None,
        device: str | None = None,
        on_reject: RejectHandler | None = None,
        on_overrun: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        files: StateFiles | None = None,
    ) -> None:
        self.files = files  # counts failed position writes (statefile.py)
        self.paths = paths or HostPaths()
        self.device = device or self.paths.dev("kmsg")
        self.state_path = os.path.join(state_dir, "kmsg.json")
        self.stats = SourceStats()
        self._on_reject = on_reject
        self._on_overrun = on_overrun
        self._stopper = Stopper()
        self._clock = clock
        self._monotonic = monotonic
        self.boot_id = read_boot_id(self.paths)
        self.ready = threading.Event()  # set once caught up with the ring (tests, benchmarks)
        self._hold: Callable[[], int | None] = lambda: None

    def hold_cursor(self, oldest_unfinished: Callable[[], int | None]) -> None:
        """Never persist a sequence number at or beyond ``oldest_unfinished()``: records of a kill
        still being grouped are read again after a restart instead of being half-lost."""
        self._hold = oldest_unfinished

    def load_position(self) -> int | None:
        """Last sequence number handled in this boot, or None (new boot / first start)."""
        try:
            with open(self.state_path, "rb") as f:
                st = json.loads(f.read(4096))  # a state file is untrusted input: bounded
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(st, dict) or st.get("boot_id") != self.boot_id or not self.boot_id:
            return None
        seq = st.get("seq")
        return seq if isinstance(seq, int) and seq >= 0 else None

    def save_position(self, seq: int) -> None:
        held = self._hold()
        if held is not None:
            seq = min(seq, held - 1)
        if seq < 0:
            return
        self._write(self.state_path, json.dumps({"boot_id": self.boot_id, "seq": seq}))

    def stop(self) -> None:
        self._stopper.stop()

    def _reject(self, reason: str) -> None:
        self.stats.reject(reason)
        if self._on_reject is not None:
            self._on_reject(reason)

    def run(self, handler: Handler) -> None:
        """Read until stopped. First start in a boot reads the whole ring (kills since boot that
        are still in it); a restart resumes after the persisted sequence number."""
        last = self.load_position()
        # The kmsg timestamp is printk's local_clock (monotonic since boot); wall time of a record =
        # now - monotonic_now + usec.
        fd = os.open(self.device, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.register(self._stopper.fd, select.POLLIN)
            seen = last
            dirty = False
            while not self._stopper.event.is_set():
                try:
                    raw = os.read(fd, KMSG_READ_SIZE)
                except BlockingIOError:
                    if dirty and seen is not None:
                        self._persist(seen)
                        dirty = False
                    self.ready.set()
                    poller.poll()  # blocks until the kernel logs or stop() is called
                    continue
                except OSError as e:
                    if e.errno == errno.EPIPE:  # records overwritten before we read them
                        self.stats.overruns += 1
                        log.warning("kernel log ring overrun: kernel records were lost")
                        if self._on_overrun is not None:
                            self._on_overrun()
                        continue
                    if e.errno == errno.EINVAL:  # record longer than our buffer: skip it
                        self._reject("too_long")
                        continue
                    raise
                if not raw:
                    continue
                rec = parse_kmsg(raw)
                if rec is None:
                    self._reject("malformed")
                    continue
                if last is not None and rec.seq <= last:
                    continue  # handled before the restart
                seen = rec.seq
                dirty = True
                if rec.facility != 0:
                    # Userspace writes to /dev/kmsg always get facility >= 1 (dev-kmsg ABI doc):
                    # anything that looks like an OOM kill or Xid from there is a fake.
                    if INTERESTING.search(rec.message):
                        self._reject("not_kernel")
                    continue
                self.stats.records += 1
                handler(
                    LogRecord(
                        message=rec.message,
                        identifier=KILLER_KERNEL,
                        boot_id=self.boot_id,
                        monotonic_usec=rec.usec,
                        realtime=self._clock() - self._monotonic() + rec.usec / 1e6,
                        source="kmsg",
                        seq=rec.seq,
                    )
                )
            if dirty and seen is not None:
                self._persist(seen)
        finally:
            os.close(fd)
            self._stopper.close()

    def _write(self, path: str, text: str) -> None:
        if self.files is not None:  # counted in gpuwatch_state_write_errors_total, logged once
            if not self.files.write(path, text, fsync=True):
                raise OSError(f"cannot write {path} (see gpuwatch_state_write_errors_total)")
        else:
            atomic_write(path, text, fsync=True)

    def _persist(self, seq: int) -> None:
        try:
            self.save_position(seq)
        except OSError as e:
            self.stats.last_error = f"cannot save kmsg position: {e}"
            if self.files is None:
                log.warning("%s", self.stats.last_error)
