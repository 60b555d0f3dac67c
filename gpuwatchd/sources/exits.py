"""Rank processes' exits as they happen: one pidfd per watched rank PID, all polled by one thread,
and each exit's wait status read the moment it wakes, before the launcher reaps the process.

``pidfd_open(2)`` (Linux >= 5.3) needs no privilege for any PID; its fd polls readable when the
process has exited (the kernel wakes pidfd waiters before it wakes the parent's ``wait``). The
thread then reads, in this order:

1. the zombie's ``/proc/PID/stat`` field 52 (``exit_code``, Linux >= 3.5: the wait status, i.e.
   exit code << 8, or the terminating signal with 0x80 when it dumped core). The kernel shows it
   only to a reader that may ptrace-read the process (the same uid, or CAP_SYS_PTRACE, which the
   unit has) and shows 0 to anyone else, so a process the daemon may not read is never taken for
   "exit 0". Field 22 (start time) must be the one the cycle saw: a reused PID is not the rank.
2. once the parent has reaped it: ``ioctl(pidfd, PIDFD_GET_INFO)`` with ``PIDFD_INFO_EXIT``
   (Linux >= 6.15), which keeps the exit status of a reaped process for a pidfd opened before it
   exited. Against a launcher blocked in ``waitpid`` (bench/exit_race.py, a loaded 2-core VM,
   kernel 6.18) the zombie was read in 40-66 % of the exits, the ioctl answered the rest: none
   unknown, none wrong.
3. neither: the cause is "unknown (reaped before read)", said as such.

The exit's time is the thread's wake (``clock()``), to the millisecond. Cost: one fd per watched
rank (at most ``max_watched``, the daemon's rank cap), one thread asleep in ``epoll_wait``; a
cycle's ``sync`` is one set difference and a ``pidfd_open`` + stat read per new rank. A rank that
leaves the watch list alive (no longer a rank) has its fd closed at once; one that leaves it dead
keeps its watch until its exit is read: a process whose main thread is a zombie (what the cycle's
/proc reading shows) while its other threads still exit (a CUDA rank's driver teardown) polls
readable only once the last one is gone, and closing its fd then lost the exit (two of eight
torchrun ranks on the H100). So nothing grows with job churn. Shell
equivalent: ``awk '{print $52}' /proc/PID/stat`` while the process is a zombie.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from gpuwatchd.isolation import run_forever
from gpuwatchd.model import RankEntry
from gpuwatchd.paths import HostPaths

log = logging.getLogger(__name__)

# include/uapi/linux/pidfd.h: _IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, struct pidfd_info), the 64-byte
# first version of the struct (mask, cgroupid, 11 ids, exit_code).
PIDFD_GET_INFO = 0xC040FF0B
PIDFD_INFO_EXIT = 1 << 3
PIDFD_INFO_SIZE = 64
EXIT_CODE_OFFSET = 60
CAP_SYS_PTRACE = 19

REAPED = "reaped before read"
NOT_READABLE = "exit status not readable: another user's process and no CAP_SYS_PTRACE"
GONE_BEFORE_WATCH = "gone before it could be watched"
RETRY_EVERY = 0.05  # another user's zombie: how often the pidfd is asked again
RETRY_SECONDS = 2.0  # and for how long before its cause is said to be unreadable


@dataclass(frozen=True)
class Watch:
    """What the cycle asks to watch: a live process, by PID and start time (field 22)."""

    pid: int
    start_ticks: int
    uid: int
    comm: str
    entry: RankEntry | None = None  # who the process is (the claim), handed back with its exit


@dataclass(frozen=True)
class ProcessExit:
    """One watched process that ended: when the watcher woke, and its wait status when read."""

    pid: int
    start_ticks: int
    comm: str
    time: float  # Unix seconds of the wake
    status: int | None  # the wait status (waitpid(2)); None: unknown, see ``unknown``
    unknown: str = ""  # why the status is unknown
    read_by: str = ""  # "stat" (the zombie) | "pidfd" (PIDFD_INFO_EXIT after the reap)
    seq: int = 0  # the order the kernel made them ready in (one wake reads several)
    entry: RankEntry | None = None  # the watch's


def _stat_fields(text: str) -> list[str]:
    """The fields of /proc/PID/stat from field 3 on (the comm may hold spaces and parentheses)."""
    return text.rpartition(")")[2].split()


def may_read_exit_codes(paths: HostPaths) -> bool:
    """Does this process hold CAP_SYS_PTRACE (effective)? Then field 52 shows every user's."""
    try:
        with open(os.path.join(paths.procfs, "self", "status"), "rb") as f:
            for line in f:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def pidfd_exit_status(pidfd: int) -> int | None:
    """The wait status the kernel kept for this pidfd's reaped process (Linux >= 6.15), else None."""
    buf = bytearray(struct.pack("=Q", PIDFD_INFO_EXIT) + bytes(PIDFD_INFO_SIZE - 8))
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    except OSError:  # ENOTTY/EINVAL before 6.15, ESRCH: no exit info (not reaped yet)
        return None
    if not struct.unpack_from("=Q", buf)[0] & PIDFD_INFO_EXIT:
        return None
    return int(struct.unpack_from("=i", buf, EXIT_CODE_OFFSET)[0])


def boot_instant() -> float:
    """The boot instant as a Unix time, from the two clocks now, to the microsecond (/proc/stat's
    ``btime`` is whole seconds, up to a second early: too coarse to tell a restart a second after
    a death from a teardown, or a peer started in the second before a death from a restart)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def start_clock() -> Callable[[int], float]:
    """A process's /proc start ticks (stat field 22, CLOCK_BOOTTIME) as a Unix time, on the boot
    instant read at each call (``boot_instant``: a step of the wall clock moves it)."""
    hz = os.sysconf("SC_CLK_TCK")
    return lambda ticks: boot_instant() + ticks / hz


class ExitWatcher:
    """The pidfds of the watched processes and the thread that waits on them (see the module
    docstring). ``sync`` from the cycle, ``drain`` for the exits seen since the last drain;
    ``on_exit`` (optional) is called from the thread after each exit has been read."""

    thread_name = "gpuwatchd-exits"

    def __init__(
        self,
        paths: HostPaths,
        max_watched: int,
        *,
        clock: Callable[[], float] = time.time,
        on_exit: Callable[[], None] | None = None,
        privileged: bool | None = None,
    ) -> None:
        self.paths = paths
        self.max_watched = max_watched
        self.clock = clock
        self.on_exit = on_exit
        self.privileged = may_read_exit_codes(paths) if privileged is None else privileged
        self.euid = os.geteuid()
        self.error = ""
        self.skipped = 0  # watches refused this sync (over max_watched, no fd left)
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Watch, int]] = {}  # pidfd -> (watch, pidfd)
        self._by_key: dict[tuple[int, int], int] = {}  # (pid, start ticks) -> pidfd
        # zombies of another user read again until the reap lets the pidfd answer (pidfd -> due)
        self._retry: dict[int, float] = {}  # pidfd -> next try (monotonic)
        self._waiting: dict[int, tuple[float, float]] = {}  # pidfd -> (wake time, give up at)
        self._exits: deque[ProcessExit] = deque(maxlen=4 * max_watched)
        self._seq = 0
        # (pid, start ticks) of the exits recorded lately: a cycle that works from a collector's
        # last good reading (one timed out) still shows them alive, and they are not watched again
        self._ended: dict[tuple[int, int], None] = {}
        self._epoll: select.epoll | None = None
        self._wake_r = self._wake_w = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the epoll set and start the thread. OSError (no pidfd_open: Linux < 5.3, or a
        seccomp filter that refuses it) is the caller's to report: the source is then down."""
        probe = os.pidfd_open(os.getpid())  # raises where the kernel or a filter says no
        os.close(probe)
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        self._kick()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for fd in list(self._watched):
                self._close(fd)
        if self._epoll is not None:
            self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the cycle ---------------------------------------------------------------------------------

    def sync(self, wanted: Collection[tuple[int, int]], new: Mapping[tuple[int, int], Watch]) -> None:
        """Watch exactly ``wanted`` ((pid, start ticks)): those no longer wanted lose their
        pidfd, and each of ``new`` (the wanted ones not watched yet, with their process) gets one."""
        if self._epoll is None:
            return
        with self._lock:
            for key in [k for k in self._by_key if k not in wanted]:
                if self._alive(*key):  # no longer a rank; a dead one's exit is still to read
                    self._close(self._by_key[key])
            self.skipped, self.error = 0, ""  # each sync says what it could not watch
            for key, w in new.items():
                if key in self._by_key or key in self._ended:
                    continue
                if len(self._by_key) >= self.max_watched:
                    self.skipped += 1
                    continue
                self._watch(w)

    def _watch(self, w: Watch) -> None:
        try:
            fd = os.pidfd_open(w.pid)
        except OSError as e:
            if e.errno == errno.ESRCH:  # exited and reaped since the cycle read it alive
                self._record(w, self.clock(), None, GONE_BEFORE_WATCH, "")
                self._notify()
            else:  # EMFILE and the like: this one is not watched, said in ``error``
                self.skipped += 1
                self.error = f"pidfd_open({w.pid}): {e.strerror}"
            return
        start = self._start_ticks(w.pid)
        if start is not None and start != w.start_ticks:  # the PID now names another process
            os.close(fd)
            self._record(w, self.clock(), None, GONE_BEFORE_WATCH, "")
            self._notify()
            return
        self._watched[fd] = (w, fd)
        self._by_key[(w.pid, w.start_ticks)] = fd
        assert self._epoll is not None
        self._epoll.register(fd, select.EPOLLIN)  # a zombie already is readable: read at once

    def _close(self, fd: int) -> None:
        w, _ = self._watched.pop(fd)
        self._by_key.pop((w.pid, w.start_ticks), None)
        self._retry.pop(fd, None)
        self._waiting.pop(fd, None)
        if self._epoll is not None:
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)
        os.close(fd)

    def _alive(self, pid: int, start_ticks: int) -> bool:
        """Is this process (PID and start time) running, not a zombie and not gone?"""
        text = self._stat(pid)
        fields = _stat_fields(text) if text else []
        return len(fields) > 19 and fields[19] == str(start_ticks) and fields[0] not in ("Z", "X")

    def _start_ticks(self, pid: int) -> int | None:
        text = self._stat(pid)
        fields = _stat_fields(text) if text else []
        return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None

    def _stat(self, pid: int) -> str | None:
        try:
            with open(os.path.join(self.paths.procfs, str(pid), "stat"), "rb") as f:
                return f.read(4096).decode("utf-8", "replace")
        except OSError:
            return None

    def drain(self) -> list[ProcessExit]:
        """The exits read since the last drain, oldest first. Polls the pidfds once first, so
        that a process the cycle found dead has its exit here, not at the next cycle."""
        self._poll(0)
        with self._lock:
            out = list(self._exits)
            self._exits.clear()
        return out

    def keys(self) -> frozenset[tuple[int, int]]:
        """The (pid, start ticks) watched now."""
        with self._lock:
            return frozenset(self._by_key)

    @property
    def watched(self) -> int:
        with self._lock:
            return len(self._watched)

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        # the daemon's isolation for streaming sources: a bug here restarts the loop, never the daemon
        run_forever("exits", self._loop, self._stop, 1.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                due = min(self._retry.values(), default=None)
            self._poll(-1.0 if due is None else max(0.0, due - time.monotonic()))

    def _poll(self, timeout: float) -> None:
        epoll = self._epoll
        if epoll is None:
            return
        try:
            ready = epoll.poll(timeout)
        except (OSError, ValueError):  # closed by stop()
            return
        woke = self.clock()
        read = False
        with self._lock:
            # epoll hands ready fds over in the order they became ready (ep_poll_callback appends
            # to the ready list): exits read in one wake keep the order in which they happened
            fds = [fd for fd, _ in ready if fd in self._watched]
            fds += [fd for fd, due in self._retry.items() if due <= time.monotonic() and fd not in fds]
            for fd in fds:
                read |= self._read_exit(fd, woke)
        if self._wake_r in (fd for fd, _ in ready):
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 64)
        if read:
            self._notify()

    def _read_exit(self, fd: int, woke: float) -> bool:
        """Read the exit of ``fd``'s process; True when it is recorded (and ``fd`` closed)."""
        w, _ = self._watched[fd]
        status, unknown, by = None, REAPED, ""
        text = self._stat(w.pid)
        fields = _stat_fields(text) if text else []
        same = len(fields) > 49 and fields[19] == str(w.start_ticks)
        if same and fields[0] not in ("Z", "X"):
            return False  # alive: a wake another poll of the same readiness already answered
        ours = same
        if ours and (self.privileged or w.uid == self.euid):
            status, unknown, by = int(fields[49]), "", "stat"
        else:
            code = pidfd_exit_status(fd)
            if code is not None:
                status, unknown, by = code, "", "pidfd"
            elif ours:  # another user's zombie: once reaped, the pidfd may answer (>= 6.15)
                first, give_up = self._waiting.get(fd, (woke, time.monotonic() + RETRY_SECONDS))
                if time.monotonic() < give_up:
                    if fd not in self._waiting and self._epoll is not None:
                        self._epoll.unregister(fd)  # readable until closed: retried on a timer
                    self._waiting[fd] = (first, give_up)
                    self._retry[fd] = time.monotonic() + RETRY_EVERY
                    self._kick()  # the thread's sleep was set before this timer
                    return False
                unknown = NOT_READABLE
        when = self._waiting.pop(fd, (woke, 0.0))[0]
        self._record(w, when, status, unknown, by)
        self._close(fd)
        return True

    def _record(self, w: Watch, when: float, status: int | None, unknown: str, by: str) -> None:
        self._ended[(w.pid, w.start_ticks)] = None
        while len(self._ended) > 4 * self.max_watched:
            del self._ended[next(iter(self._ended))]
        self._seq += 1
        self._exits.append(ProcessExit(w.pid, w.start_ticks, w.comm, when, status, unknown, by, self._seq, w.entry))

    def _kick(self) -> None:
        """End the thread's current sleep (the pipe is non-blocking: a full one is awake already)."""
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def _notify(self) -> None:
        if self.on_exit is not None:
            self.on_exit()
