"""Per-process evidence for the fork_after_cuda finding: NVIDIA device fds, executable, argv digest.

Reads ``/proc/PID/fd/*`` link targets (only those under ``<devfs>/nvidia``: ``/dev/nvidiactl``,
``/dev/nvidia-uvm``, ``/dev/nvidiaN``, ``/dev/nvidia-caps/...``), ``/proc/PID/exe`` and
``/proc/PID/cmdline``. The command line is reduced to a digest at once: it is compared, never
kept or exported (it can hold secrets). The digest is Python's ``hash`` of the bytes (SipHash,
keyed per process), enough for an equality test inside one daemon and, unlike ``hashlib``, it
does not load libcrypto into the daemon (bench/rss.py).

Cost: one readlink per open fd of each process in a rank tree (a rank holds ~100 fds), or, through
``EvidenceReader``, only when the process's identity (start time, exe, cmdline) or its number of
open fds changed, or every ``EVIDENCE_TTL`` seconds; otherwise one ``/proc/PID/stat`` read (the
process image's addresses there change at an exec: exe and cmdline are read again only then, or
where the kernel hides the addresses) and the fd count the cycle read already.
Privilege: other users' ``fd``/``exe`` need CAP_SYS_PTRACE (granted in the systemd unit); without it
the evidence is None and nothing is flagged.
Shell equivalent: ``ls -l /proc/PID/fd | grep nvidia; readlink /proc/PID/exe; tr '\\0' ' ' <
/proc/PID/cmdline``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from gpuwatchd.model import ProcEvidence
from gpuwatchd.paths import HostPaths

# A cached fd scan is redone at least this often. What changes the fork_after_cuda evidence
# changes what the reader checks every cycle: a new process (a fork, a reused PID) and an exec
# change the identity, a CUDA context opened or closed changes the fd count by dozens; the scan
# is redone then, the same cycle. The TTL catches only fds closed and as many others opened
# between two cycles (a device fd swapped for another file), at most EVIDENCE_TTL seconds late;
# fork_after_cuda is a warning (model/kinds.py), not a critical finding.
# At 30 s every steady process's fds were read again every sixth cycle. 64 ranks of 300 fds, each
# with 3 workers (a tree with children is in the rule's reach; the workers, whose parent holds no
# device there, are not read), on the 2-core VM: 3,250 readlinks and nvml.track 27.0 ms a cycle;
# at 300 s 325 readlinks and 6.6 ms, side by side in one run (bench/cycle_fast.py --children 3,
# bench/results/cycle_cost_hb_64ranks_a7db82e_vs_d0979f8_2cpu_vm.txt). A GPU rank's workers
# inherit its device fds and are read too: four times the fds.
EVIDENCE_TTL = 300.0


def read_evidence(paths: HostPaths, pid: int) -> ProcEvidence | None:
    """None when the process is gone or unreadable (not an error)."""
    head = _identity(paths, pid)
    if head is None:
        return None
    _start, ppid, exe, digest = head
    try:
        names = os.listdir(paths.proc(pid, "fd"))
    except OSError:
        return None
    return ProcEvidence(pid, ppid, exe, digest, _scan(paths, pid, names))


def _identity(paths: HostPaths, pid: int) -> tuple[int, int, str, str] | None:
    """(start ticks, ppid, exe, cmdline digest) of one process; None when gone."""
    try:
        with open(paths.proc(pid, "stat"), "rb") as f:
            stat = f.read().decode("utf-8", "replace")
        fields = stat[stat.rfind(")") + 2 :].split()
        exe = os.readlink(paths.proc(pid, "exe"))
        with open(paths.proc(pid, "cmdline"), "rb") as f:
            digest = f"{hash(f.read(1 << 20)) & 0xFFFF_FFFF_FFFF_FFFF:016x}"
        return int(fields[19]), int(fields[1]), exe, digest
    except (OSError, ValueError, IndexError):
        return None


def _exec_identity(paths: HostPaths, pid: int) -> tuple[int, ...] | None:
    """(start ticks, ppid, start and end of the text segment, start of the stack) from one
    ``/proc/PID/stat`` read: an exec maps a new text and a new stack, so these change where
    exe and cmdline would, without the readlink and the cmdline read. The kernel shows the
    addresses only to a process that may ptrace the target (zeros otherwise). None when gone."""
    try:
        fd = os.open(paths.proc(pid, "stat"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        f = raw[raw.rfind(b")") + 2 :].split()
        return int(f[19]), int(f[1]), int(f[23]), int(f[24]), int(f[25])
    except (OSError, ValueError, IndexError):
        return None


def _scan(paths: HostPaths, pid: int, names: list[str]) -> tuple[tuple[int, str], ...]:
    """The fds of ``names`` that point at an NVIDIA device node (one readlink each, relative to
    the ``fd`` directory opened once: a path walk of one name instead of four per fd, about 40 %
    less CPU than readlink of the full path, and most of the cycle at 64 ranks when the scans
    are due, bench/results/cycle_profile_hb_cut_2cpu_vm.txt)."""
    prefix = paths.dev("nvidia")
    try:
        dir_fd = os.open(paths.proc(pid, "fd"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return ()  # gone since the listing: every readlink would have failed
    fds: list[tuple[int, str]] = []
    readlink = os.readlink
    try:
        for name in names:
            try:
                target = readlink(name, dir_fd=dir_fd)
            except OSError:
                continue  # closed while we listed
            if target.startswith(prefix):
                fds.append((int(name), target))
    finally:
        os.close(dir_fd)
    return tuple(sorted(fds))


class EvidenceReader:
    """``read_evidence`` for the daemon's cycle, remembering each process's fd scan.

    The readlink of every fd (a torch rank and each forked DataLoader worker hold hundreds) is
    redone only when the process is another one (start time, exe or cmdline changed: a PID reused,
    an exec) or its number of open fds changed (a CUDA context opens dozens of device fds; closing
    them shows too), and at least every ``ttl`` seconds. The number is ``stat(/proc/PID/fd)``'s
    size where the kernel gives it (Linux >= 6.2, see sources/procfs.py), else the listing.
    ``forget`` drops what is not in a live tree any more, so the memory is bounded by the watched
    processes. ``scans`` counts full fd scans (tests, benchmarks)."""

    def __init__(
        self, paths: HostPaths, ttl: float = EVIDENCE_TTL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.paths = paths
        self.ttl = ttl
        self.clock = clock
        self.scans = 0
        self.identity_reads = 0  # exe + cmdline reads (tests, benchmarks)
        self._count_o1 = _fd_stat_counts(paths)
        # pid -> (identity, fd count, scanned at, evidence, exec identity)
        self._seen: dict[int, tuple[tuple[int, int, str, str], int, float, ProcEvidence, tuple[int, ...]]] = {}

    def _fd_count(self, pid: int) -> tuple[int, list[str] | None]:
        fd_dir = self.paths.proc(pid, "fd")
        if self._count_o1:
            size = os.stat(fd_dir).st_size
            if size > 0:
                return size, None
        names = os.listdir(fd_dir)
        return len(names), names

    def read(self, pid: int, open_fds: int | None = None) -> ProcEvidence | None:
        """``open_fds``: the fd count the cycle read already (``ProcessInfo.open_fds``)."""
        quick = _exec_identity(self.paths, pid)
        now = self.clock()
        cached = self._seen.get(pid)
        try:
            if quick is None:
                raise FileNotFoundError(pid)
            count, names = (open_fds, None) if open_fds is not None else self._fd_count(pid)
            if (
                cached is not None
                and quick[2:] != (0, 0, 0)
                and cached[4] == quick
                and cached[1] == count
                and now - cached[2] < self.ttl
            ):
                return cached[3]  # the same process image, the same fds: nothing to read
            self.identity_reads += 1
            ident = _identity(self.paths, pid)
            if ident is None:
                raise FileNotFoundError(pid)
        except OSError:
            self._seen.pop(pid, None)
            return None
        if cached is not None and cached[0] == ident and cached[1] == count and now - cached[2] < self.ttl:
            self._seen[pid] = (*cached[:4], quick)
            return cached[3]
        try:
            names = names if names is not None else os.listdir(self.paths.proc(pid, "fd"))
        except OSError:
            self._seen.pop(pid, None)
            return None
        self.scans += 1
        _start, ppid, exe, digest = ident
        ev = ProcEvidence(pid, ppid, exe, digest, _scan(self.paths, pid, names))
        self._seen[pid] = (ident, count, now, ev, quick)
        return ev

    def forget(self, live: Iterable[int]) -> None:
        keep = set(live)
        for pid in [p for p in self._seen if p not in keep]:
            del self._seen[pid]


def _fd_stat_counts(paths: HostPaths) -> bool:
    """Does ``stat(/proc/PID/fd).st_size`` count the fds here (procfs, Linux >= 6.2)?"""
    fd_dir = paths.proc("self", "fd")
    try:
        size = os.stat(fd_dir).st_size
        return size > 0 and abs(size - len(os.listdir(fd_dir))) <= 1
    except OSError:
        return False
