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
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import kernel_formats
from gpuwatchd.statefile import StateFiles, atomic_write

log = logging.getLogger(__name__)

# Parsing is bounded: kernel records are < 1 KiB (PRINTKRB_RECORD_MAX); anything longer is
# hostile or garbage and only its head can matter. Keeps every regex below linear-time in practice.
MAX_MESSAGE = 2048
KMSG_READ_SIZE = 16384  # a read() shorter than the record fails with EINVAL (dev-kmsg ABI doc)

KILLER_KERNEL = "kernel"
KILLER_OOMD = "systemd-oomd"
KILLER_EARLYOOM = "earlyoom"
USERSPACE_KILLERS = (KILLER_OOMD, KILLER_EARLYOOM)

# ---------------------------------------------------------------------------------------------
# Parsers (pure)
# ---------------------------------------------------------------------------------------------

KMSG = re.compile(
    r"^(?P<prio>\d{1,6}),(?P<seq>\d{1,20}),(?P<usec>\d{1,20}),(?P<flags>[^,;]*)[^;]*;(?P<msg>.*)$",
    re.DOTALL,
)
OOM_KILLED = re.compile(
    r"(?:(?P<kind>Out of memory|Memory cgroup out of memory|"
    r"Out of memory \(oom_kill_allocating_task\)): )?"
    # RHEL/CentOS 6 put ", UID U," before the comm, RHEL/CentOS 7 after it (Red Hat backports)
    r"Killed process (?P<pid>\d{1,10})(?:, UID (?P<uid_el6>\d{1,10}),)? \((?P<comm>[^\n]{0,64}?)\)"
    r"(?:, UID (?P<uid_el7>\d{1,10}),)? total-vm:(?P<total_vm_kb>\d+)kB, "
    r"anon-rss:(?P<anon_rss_kb>\d+)kB, file-rss:(?P<file_rss_kb>\d+)kB"
    r"(?:, shmem-rss:(?P<shmem_rss_kb>\d+)kB)?"
    r"(?:, UID:(?P<uid>\d+))?(?: pgtables:(?P<pgtables_kb>\d+)kB)?"
    r"(?: oom_score_adj:(?P<oom_score_adj>-?\d+))?"
)
OOM_KILL_OLD = re.compile(
    r"(?P<kind>Out of memory|Memory cgroup out of memory): Kill process (?P<pid>\d{1,10}) "
    r"\((?P<comm>[^\n]{0,64}?)\) score (?P<score>\d+) or sacrifice child"
)
OOM_SUMMARY = re.compile(r"oom-kill:(?P<kv>.*)$")
OOM_SUMMARY_SPLIT = re.compile(r",(?=[a-z_]+=)|,(?=global_oom)")
OOM_INVOKED = re.compile(
    r"^(?P<comm>.{0,64}?) invoked oom-killer: gfp_mask=(?P<gfp>[^,]+).*?order=(?P<order>-?\d+), "
    r"oom_score_adj=(?P<adj>-?\d+)"
)
OOM_REAPER = re.compile(
    r"^oom_reaper: reaped process (?P<pid>\d{1,10}) \((?P<comm>.{0,64}?)\), "
    r"now anon-rss:(?P<anon>\d+)kB"
)
OOM_TASK_IN = re.compile(
    r"^Task in (?P<task_memcg>\S+) killed as a result of limit of (?P<memcg>\S+)"
)
OOM_GROUP = re.compile(
    r"^Tasks in (?P<memcg>\S+) are going to be killed due to memory\.oom\.group set"
)
# 3.10 prints the statistics on the same line ("... for /kubepods/x: cache:32KB rss:...")
MEMCG_STATS = re.compile(r"^Memory cgroup stats for (?P<memcg>\S+?)(?::\s|:?$)")
XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\): (?P<xid>\d{1,5}), "
    r"(?:pid=(?P<pid>'<unknown>'|\d{1,10}), (?:name=(?P<name>.{0,256}?), )?)?(?P<rest>.*)$"
)
NVRM_GPU_AT = re.compile(
    r"NVRM: GPU at PCI:(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}): "
    r"(?P<uuid>GPU-[0-9a-fA-F-]{36})"
)
OOMD_KILLED = re.compile(r"^Killed (?P<cgroup>/\S*) due to (?P<reason>.*)$")
EARLYOOM_KILL = re.compile(
    r"^sending (?P<signal>SIG[A-Z]+) to process (?P<pid>\d{1,10}) uid (?P<uid>\d+) "
    r"\"(?P<comm>.{0,64}?)\": (?P<rest>.*)$"
)
EARLYOOM_RSS = re.compile(r"VmRSS (?P<mib>\d+) MiB")
# Message shapes that matter; a non-kernel record that looks like one of them is a spoof attempt.
INTERESTING = re.compile(
    r"Killed process|Kill process|oom-kill:|invoked oom-killer|NVRM: Xid|fallen off the bus"
)


@dataclass(frozen=True)
class KmsgRecord:
    priority: int  # facility << 3 | level
    seq: int
    usec: int  # microseconds since boot (printk's local_clock)
    flags: str
    message: str

    @property
    def facility(self) -> int:
        return self.priority >> 3


def parse_kmsg(raw: bytes) -> KmsgRecord | None:
    """One /dev/kmsg record (``prio,seq,usec,flags;message`` plus ``\\n KEY=value`` lines)."""
    text = raw[: MAX_MESSAGE + 128].decode("utf-8", "replace")
    head, _, _dict = text.partition("\n")  # device dictionary lines follow the first newline
    m = KMSG.match(head)
    if m is None:
        return None
    return KmsgRecord(
        priority=int(m["prio"]),
        seq=int(m["seq"]),
        usec=int(m["usec"]),
        flags=m["flags"],
        message=m["msg"][:MAX_MESSAGE],
    )


@dataclass(frozen=True)
class Parsed:
    """One recognised log message. ``kind`` selects which of the fields are meaningful."""

    kind: str  # killed | kill_old | summary | invoked | reaper | task_in | oom_group |
    #            memcg_stats | xid | gpu_at | bus_lost | gpu_named | oomd | earlyoom
    pid: int | None = None
    comm: str = ""
    fields: Mapping[str, str] = field(default_factory=dict)


def _kb(s: str | None) -> int:
    return int(s) if s else 0


def parse_message(message: str, identifier: str = KILLER_KERNEL) -> Parsed | None:
    """Recognise one kernel (or userspace killer) log message; None when it is not one we need."""
    msg = message[:MAX_MESSAGE].rstrip("\n")
    if identifier == KILLER_OOMD:
        m = OOMD_KILLED.match(msg)
        if m:
            return Parsed("oomd", fields={"cgroup": m["cgroup"], "reason": m["reason"][:256]})
        return None
    if identifier == KILLER_EARLYOOM:
        m = EARLYOOM_KILL.match(msg)
        if m:
            rss = EARLYOOM_RSS.search(m["rest"])
            f = {"signal": m["signal"], "uid": m["uid"]}
            if rss:
                f["rss_kb"] = str(int(rss["mib"]) * 1024)
            return Parsed("earlyoom", pid=int(m["pid"]), comm=m["comm"], fields=f)
        old = kernel_formats.parse_earlyoom_old(msg)
        if old is not None:
            victim, name, signal, rss_kb = old
            f = {"signal": signal} if rss_kb is None else {"signal": signal, "rss_kb": str(rss_kb)}
            return Parsed("earlyoom", pid=victim, comm=name, fields=f)
        return None
    if identifier != KILLER_KERNEL:
        return None
    if "NVRM" in msg:
        m = XID.search(msg)
        if m:
            pid = m["pid"]
            f = {k: v for k, v in m.groupdict().items() if v is not None and k != "pid"}
            f["pci"] = m["pci"].lower()
            return Parsed(
                "xid",
                pid=int(pid) if pid and pid.isdigit() else None,
                comm=(m["name"] or "").strip("'"),
                fields=f,
            )
        m = NVRM_GPU_AT.search(msg)
        if m:
            return Parsed("gpu_at", fields={"pci": m["pci"].lower(), "uuid": m["uuid"]})
        lost = kernel_formats.parse_bus_lost(msg)
        if lost is not None:
            kind, pci, pci_id = lost
            return Parsed(kind, fields={"pci": pci, "pci_id": pci_id, "rest": msg[:400]})
        return None
    if "ill" in msg:  # cheap pre-filter: Killed / Kill / oom-kill / killer
        m = OOM_KILLED.search(msg)
        if m:
            f = {k: v for k, v in m.groupdict().items() if v is not None}
            uid_el6, uid_el7 = f.pop("uid_el6", None), f.pop("uid_el7", None)
            uid = uid_el6 or uid_el7
            if uid is not None:
                f.setdefault("uid", uid)
            return Parsed("killed", pid=int(m["pid"]), comm=m["comm"], fields=f)
        m = OOM_SUMMARY.search(msg)
        if m:
            kv: dict[str, str] = {}
            for part in OOM_SUMMARY_SPLIT.split(m["kv"]):
                k, eq, v = part.partition("=")
                kv[k] = v if eq else "1"
            pid_s = kv.get("pid", "")
            if not pid_s.isdigit() or len(pid_s) > 10:
                return None
            return Parsed("summary", pid=int(pid_s), comm=kv.get("task", ""), fields=kv)
        m = OOM_KILL_OLD.search(msg)
        if m:
            return Parsed("kill_old", pid=int(m["pid"]), comm=m["comm"], fields={"kind": m["kind"]})
        m = OOM_INVOKED.match(msg)
        if m:
            return Parsed("invoked", comm=m["comm"], fields={"order": m["order"], "gfp": m["gfp"]})
        m = OOM_TASK_IN.match(msg)
        if m:
            return Parsed("task_in", fields={"task_memcg": m["task_memcg"], "memcg": m["memcg"]})
        m = OOM_GROUP.match(msg)
        if m:
            return Parsed("oom_group", fields={"memcg": m["memcg"]})
    m = OOM_REAPER.match(msg)
    if m:
        f = {"anon_rss_kb": m["anon"]}
        return Parsed("reaper", pid=int(m["pid"]), comm=m["comm"], fields=f)
    if msg.startswith("Memory cgroup stats for "):
        m = MEMCG_STATS.match(msg)
        if m:
            return Parsed("memcg_stats", fields={"memcg": m["memcg"]})
    return None


def rss_bytes(p: Parsed) -> int | None:
    """RSS at kill (anon + file + shmem) from a ``killed`` / ``earlyoom`` message."""
    f = p.fields
    if p.kind == "killed":
        kb = _kb(f.get("anon_rss_kb")) + _kb(f.get("file_rss_kb")) + _kb(f.get("shmem_rss_kb"))
        return 1024 * kb
    if p.kind == "earlyoom" and "rss_kb" in f:
        return 1024 * int(f["rss_kb"])
    return None


# ---------------------------------------------------------------------------------------------
# Records handed to the event processor
# ---------------------------------------------------------------------------------------------


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


class SourceStats:
    """What a source counts about itself (thread-safe enough: ints updated by one thread)."""

    def __init__(self) -> None:
        self.records = 0
        self.overruns = 0  # EPIPE: the ring wrapped before we read; records were lost
        self.rejected: dict[str, int] = {}
        self.last_error = ""

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


Handler = Callable[[LogRecord], None]
RejectHandler = Callable[[str], None]


def read_boot_id(paths: HostPaths) -> str:
    try:
        with open(paths.proc("sys", "kernel", "random", "boot_id")) as f:
            return f.read().strip()
    except OSError:
        return ""


class _Stopper:
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
        self._stopper = _Stopper()
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


def journal_available(paths: HostPaths | None = None) -> bool:
    """journald runs (its socket exists) and systemd-python imports."""
    p = paths or HostPaths()
    if not os.path.exists(os.path.join(p.rootfs, "run/systemd/journal/socket")):
        return False
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        log.warning("journald runs but systemd-python is not installed (pip install "
                    "'gpuwatchd[journal]', which needs libsystemd-dev and pkg-config): reading the "
                    "kernel log from /dev/kmsg instead, without systemd-oomd and earlyoom kills")
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
        self._stopper = _Stopper()
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


KernelLogSource = KmsgSource | JournalSource


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
        return JournalSource(state_dir, path=journal_path, on_reject=on_reject, paths=paths,
                             files=files)
    if mode in ("kmsg", "auto"):
        dev = paths.dev("kmsg")
        if not os.path.exists(dev):
            raise KernelLogUnavailable(f"{dev} does not exist")
        return KmsgSource(state_dir, paths=paths, on_reject=on_reject, on_overrun=on_overrun,
                          files=files)
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


def read_cgroup(paths: HostPaths, pid: int) -> str:
    """The process's cgroup path: the v2 unified path, else the v1 memory controller's
    (``cat /proc/PID/cgroup``); "" when the process is gone."""
    try:
        with open(paths.proc(pid, "cgroup")) as f:
            text = f.read(65536)
    except OSError:
        return ""
    memory = unified = ""
    for line in text.splitlines():
        _id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":
            unified = path
        elif "memory" in controllers.split(","):
            memory = path
    return memory or unified
