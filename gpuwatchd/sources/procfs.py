"""/proc reader for the watched processes (rank PIDs and their descendants) only.

Reads per process: ``/proc/PID/stat`` (state, ppid, CPU, threads, start time, RSS), the owner of
``/proc/PID``, ``/proc/PID/limits`` (RLIMIT_NOFILE) and the fd count. The fd count is O(1) where the
kernel allows: since Linux 6.2 ``stat("/proc/PID/fd").st_size`` is the number of open fds (commit
f1f1f2569901 "fs/proc: add the st_size of /proc/PID/fd"); older kernels report 0 and we fall back to
listing the directory. Descendants come from ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN),
so a cycle never lists every PID on the host; only discovery (slower cadence) does.

Cost: per watched process per cycle one ``stat`` read (shared, within a cycle, by everything
that asks: ``begin_cycle``), two ``stat(2)`` calls (owner, fd count) and the main thread's
``children``; ``limits`` every ``LIMITS_TTL`` s, every thread's ``children`` every
``THREAD_CHILDREN_TTL`` s. ``nspid``, ``pid_ns`` and ``cgroup`` (one read
each) serve the PID-namespace resolution of containerised ranks (sources/pidns.py). Privilege:
other users' ``fd``, ``limits`` and ``environ`` need CAP_DAC_READ_SEARCH / CAP_SYS_PTRACE (the
systemd unit grants them); without them those fields are None and the rest still works.
Shell equivalent: ``ps -o pid,ppid,stat,user,comm,time,rss,nlwp -p PID; ls /proc/PID/fd | wc -l;
grep 'open files' /proc/PID/limits; cat /proc/PID/task/*/children``.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Iterable, Mapping

from gpuwatchd.model import ProcessInfo
from gpuwatchd.paths import HostPaths, read_bounded

MAX_ENVIRON_BYTES = 1 << 20
LIMITS_TTL = 30.0
# Every thread's children file (a torch rank has dozens of threads) is read this often; between
# two such scans only the main thread's and those of the threads that had forked before.
THREAD_CHILDREN_TTL = 120.0


def environ_pick(raw: bytes, keys: Iterable[str] | None = None) -> dict[str, str]:
    """The variables ``keys`` (None: all) of an environment block, the last one of a name
    winning as in the kernel's view of a duplicated variable."""
    env: dict[str, str] = {}
    if keys is not None:  # a handful of names (discovery: every process, each pass): find them
        raw = b"\x00" + raw
        for key in keys:
            name = key.encode()
            at = raw.rfind(b"\x00" + name + b"=")  # the last one wins, as below
            if at >= 0:
                start = at + len(name) + 2
                end = raw.find(b"\x00", start)
                env[key] = raw[start : end if end >= 0 else len(raw)].decode("utf-8", "replace")
        return env
    for item in raw.split(b"\x00"):
        name, sep, value = item.partition(b"=")
        if not sep:
            continue
        env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def read_proc_cgroup(paths: HostPaths, pid: int) -> str | None:
    """``/proc/PID/cgroup`` as text (one line per hierarchy, at most 64 KiB), or None when the
    process is gone: the one reader of that file. Its parsers are beside their users: memcg.py
    (the memory controller), cgroup_cpu.py (cpu.stat) and kernel_log.py (an OOM kill's cgroup)."""
    try:
        return read_bounded(paths.proc(pid, "cgroup"), 1 << 16).decode("utf-8", "replace")
    except OSError:
        return None


class ProcessGone(Exception):
    """The process exited (or was never there) while we were reading it."""


def _read_line(path: str) -> bytes:
    """A one-line procfs file such as ``/proc/PID/stat`` (a seq_file: one read(2) returns all of
    it, well under 4 KiB): one read instead of ``_read``'s second one that only finds EOF (a
    cycle reads one per watched process)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = os.read(fd, 4096)
        if len(raw) < 4096:
            return raw
        return raw + read_bounded(path)[4096:]  # never for stat; kept exact for anything longer
    finally:
        os.close(fd)


def thread_children(task_dir: str, limit: int = 1 << 16) -> list[int]:
    """The children listed by every thread of a process (``task_dir`` is its /proc/PID/task):
    a child is listed in the ``children`` file of the thread that forked it."""
    out: list[int] = []
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            out.extend(int(x) for x in read_bounded(os.path.join(task_dir, tid, "children"), limit).split())
        except (OSError, ValueError):
            continue
    return out


class ProcfsReader:
    def __init__(self, paths: HostPaths | None = None) -> None:
        self.paths = paths or HostPaths()
        self.clk_tck = os.sysconf("SC_CLK_TCK")
        self.page_size = os.sysconf("SC_PAGE_SIZE")
        self.boot_time = self._boot_time()
        self._users: dict[int, str] = {}
        self.fd_count_o1 = self._probe_fd_stat()
        # (pid, start ticks) -> (read at, soft, hard): limits change only through prlimit(2), so
        # they are re-read every LIMITS_TTL seconds rather than every cycle
        self._limits: dict[tuple[int, int], tuple[float, int | None, int | None]] = {}
        # pid -> (last full scan at, the threads that had children then); see children()
        self._thread_children: dict[int, tuple[float, tuple[int, ...]]] = {}
        self.thread_scans = 0  # full scans of every thread's children file (tests, benchmarks)
        # pid -> its stat line, between begin_cycle() and end_cycle() only (see there)
        self._stats: dict[int, tuple[str, list[str]]] | None = None
        self.stat_reads = 0  # /proc/PID/stat files read (tests, benchmarks)

    def begin_cycle(self) -> None:
        """From now until ``end_cycle``, read each process's ``/proc/PID/stat`` once: the
        daemon's cycle asks for a rank's start time first (rank files, PID namespaces), then for
        its whole stat line (``read_process``); both see the same reading. Outside a cycle every
        call reads the file again (the CLI, tests)."""
        self._stats = {}

    def end_cycle(self) -> None:
        self._stats = None

    def _probe_fd_stat(self) -> bool:
        """Does ``stat(/proc/PID/fd).st_size`` count fds here (procfs on Linux >= 6.2)? A recorded
        tree on a normal filesystem reports the directory's block size instead."""
        fd_dir = self.paths.proc("self", "fd")
        try:
            size = os.stat(fd_dir).st_size
            return size > 0 and abs(size - len(os.listdir(fd_dir))) <= 1
        except OSError:
            return False

    def _boot_time(self) -> float:
        try:
            for line in read_bounded(self.paths.proc("stat"), 1 << 20).splitlines():
                if line.startswith(b"btime "):
                    return float(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0.0

    def user_name(self, uid: int) -> str:
        name = self._users.get(uid)
        if name is None:
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                name = str(uid)
            self._users[uid] = name
        return name

    def read_stat(self, pid: int) -> tuple[str, list[str]]:
        """(comm, fields after the comm) of /proc/PID/stat; raises ProcessGone."""
        stats = self._stats
        if stats is not None:
            hit = stats.get(pid)
            if hit is not None:
                return hit
        self.stat_reads += 1
        try:
            raw = _read_line(self.paths.proc(pid, "stat")).decode("utf-8", "replace")
        except OSError as e:  # ENOENT, ESRCH: gone (or never there)
            raise ProcessGone(pid) from e
        # comm may contain spaces and parentheses: it ends at the *last* ')'.
        open_i, close_i = raw.find("("), raw.rfind(")")
        if open_i < 0 or close_i < open_i:
            raise ProcessGone(pid)
        got = raw[open_i + 1 : close_i], raw[close_i + 2 :].split()
        if stats is not None:
            stats[pid] = got
        return got

    def start_ticks(self, pid: int) -> int | None:
        try:
            return int(self.read_stat(pid)[1][19])
        except (ProcessGone, IndexError, ValueError):
            return None

    def fd_count(self, pid: int) -> int | None:
        fd_dir = self.paths.proc(pid, "fd")
        try:
            if self.fd_count_o1:
                size = os.stat(fd_dir).st_size
                if size > 0:
                    return size
            return len(os.listdir(fd_dir))
        except OSError:
            return None

    def fd_limits(self, pid: int) -> tuple[int | None, int | None]:
        try:
            text = read_bounded(self.paths.proc(pid, "limits")).decode("ascii", "replace")
        except OSError:
            return None, None
        for line in text.splitlines():
            if line.startswith("Max open files"):
                parts = line[len("Max open files") :].split()
                return _limit(parts[0] if parts else ""), _limit(parts[1] if len(parts) > 1 else "")
        return None, None

    def read_process(self, pid: int) -> ProcessInfo | None:
        """One process, or None when it has gone (that is not an error)."""
        try:
            comm, f = self.read_stat(pid)
            # the directory's owner, not an fstat of the stat file read above: the files of a
            # non-dumpable process (one that dropped from root to a user) belong to root, only
            # /proc/PID always shows the euid (task_dump_owner; tests/test_rank_claims.py)
            owner = os.stat(self.paths.proc(pid)).st_uid
            start_ticks = int(f[19])
            ppid, cpu = int(f[1]), (int(f[11]) + int(f[12])) / self.clk_tck
            rss, threads = int(f[21]) * self.page_size, int(f[17])
        except (ProcessGone, OSError, IndexError, ValueError):
            return None
        now = time.monotonic()
        cached = self._limits.get((pid, start_ticks))
        if cached is not None and now - cached[0] < LIMITS_TTL:
            soft, hard = cached[1], cached[2]
        else:
            soft, hard = self.fd_limits(pid)
            self._limits[(pid, start_ticks)] = (now, soft, hard)
        return ProcessInfo(
            pid=pid,
            ppid=ppid,
            comm=comm,
            state=f[0],
            uid=owner,
            user=self.user_name(owner),
            start_ticks=start_ticks,
            start_time=self.boot_time + start_ticks / self.clk_tck,
            cpu_seconds=cpu,
            rss_bytes=rss,
            threads=threads,
            open_fds=self.fd_count(pid),
            max_fds_soft=soft,
            max_fds_hard=hard,
        )

    def forget(self, live: set[tuple[int, int]]) -> None:
        """Drop cached limits of processes not in ``live`` ((pid, start ticks) pairs)."""
        for key in set(self._limits) - live:
            del self._limits[key]
        pids = {pid for pid, _ in live}
        for pid in set(self._thread_children) - pids:
            del self._thread_children[pid]

    def children(self, pid: int) -> list[int]:
        """Direct children. A child is listed in the ``children`` file of the *thread* that forked
        it. Read every time: the main thread's file (DataLoader workers, subprocesses of the main
        loop) and the files of the threads that had children at the last full scan (a thread that
        forks once forks again: a pool's feeder, a launcher's watcher); every thread's file (a
        torch process has a hundred) every THREAD_CHILDREN_TTL seconds, which finds a thread's
        first child."""
        out = self._read_children(self.paths.proc(pid, "task", pid, "children"))
        if out is None:  # the process is gone
            self._thread_children.pop(pid, None)
            return []
        now = time.monotonic()
        cached = self._thread_children.get(pid)
        if cached is None or now - cached[0] >= THREAD_CHILDREN_TTL:
            by_thread = self._all_thread_children(pid)
            cached = (now, tuple(t for t, kids in by_thread.items() if kids and t != pid))
            self._thread_children[pid] = cached
            extra = [c for kids in by_thread.values() for c in kids]
        else:
            extra = []
            for tid in cached[1]:
                extra += self._read_children(self.paths.proc(pid, "task", tid, "children")) or []
        seen = set(out)
        for c in extra:
            if c not in seen:
                seen.add(c)
                out.append(c)
        return out

    def _read_children(self, path: str) -> list[int] | None:
        try:
            return [int(x) for x in read_bounded(path).split()]
        except OSError:
            return None
        except ValueError:
            return []

    def _all_thread_children(self, pid: int) -> dict[int, list[int]]:
        """tid -> the children listed in that thread's file, for every thread of ``pid``."""
        self.thread_scans += 1
        task_dir = self.paths.proc(pid, "task")
        try:
            tids = [int(t) for t in os.listdir(task_dir) if t.isdigit()]
        except OSError:
            return {}
        out: dict[int, list[int]] = {}
        for tid in tids:
            kids = self._read_children(os.path.join(task_dir, str(tid), "children"))
            if kids is not None:
                out[tid] = kids
        return out

    def descendants(self, pid: int, limit: int = 4096) -> list[int]:
        """All live descendants of ``pid`` (breadth first), bounded by ``limit``."""
        seen: list[int] = []
        queue = self.children(pid)
        while queue and len(seen) < limit:
            child = queue.pop(0)
            if child in seen or child == pid:
                continue
            seen.append(child)
            queue.extend(self.children(child))
        return seen

    def environ(self, pid: int, keys: Iterable[str] | None = None) -> dict[str, str]:
        """Selected variables of the process's initial environment. Values stay inside the
        daemon: callers reduce them to decisions (rank numbers, flag names)."""
        raw = self.environ_block(pid)
        return {} if raw is None else environ_pick(raw, keys)

    def environ_block(self, pid: int, limit: int = MAX_ENVIRON_BYTES) -> bytes | None:
        """The first ``limit`` bytes of the process's initial environment (NUL-separated), or None
        when it cannot be read (gone, not permitted)."""
        try:
            return read_bounded(self.paths.proc(pid, "environ"), limit)
        except OSError:
            return None

    def environ_values(self, pid: int, names: Iterable[str]) -> dict[str, str] | None:
        """``environ`` of just ``names`` (the caller says which: findings/nccl_env.py's
        ``WATCHED_VARS`` for the daemon), or None when the environment cannot be read (yet): right
        after fork/exec ``environ`` reads empty for a moment, and a caller must not remember that
        as "none of them set"."""
        try:
            if not read_bounded(self.paths.proc(pid, "environ"), 1):
                return None
        except OSError:
            return None
        return self.environ(pid, names)

    def nspid(self, pid: int) -> tuple[int, ...] | None:
        """The ``NSpid`` line of /proc/PID/status: the PID in each PID namespace, outermost (the
        host's) first, innermost (the container's own) last. None when the process is gone."""
        try:
            raw = read_bounded(self.paths.proc(pid, "status"), 1 << 14)
        except OSError:
            return None
        for line in raw.splitlines():
            if line.startswith(b"NSpid:"):
                try:
                    return tuple(int(x) for x in line.split()[1:])
                except ValueError:
                    return None
        return (pid,)  # kernels before 4.1 have no NSpid: no nested namespaces to report

    def pid_ns(self, pid: int | str) -> int | None:
        """Inode of the process's PID namespace (``/proc/PID/ns/pid`` -> ``pid:[INODE]``); needs
        PTRACE_MODE_READ on the process (CAP_SYS_PTRACE for other users')."""
        try:
            return os.stat(self.paths.proc(pid, "ns", "pid")).st_ino
        except OSError:
            return None

    def cgroup(self, pid: int) -> str | None:
        """/proc/PID/cgroup as text (one line per hierarchy), or None when gone."""
        return read_proc_cgroup(self.paths, pid)

    def pids(self) -> list[int]:
        """Every PID on the host (discovery only: not on the per-cycle path)."""
        try:
            return [int(n) for n in os.listdir(self.paths.procfs) if n.isdigit()]
        except OSError:
            return []

    def read_many(self, pids: Iterable[int]) -> Mapping[int, ProcessInfo]:
        out: dict[int, ProcessInfo] = {}
        for pid in pids:
            if pid in out:
                continue
            info = self.read_process(pid)
            if info is not None:
                out[pid] = info
        return out


def _limit(s: str) -> int | None:
    if s == "unlimited":
        return None
    try:
        return int(s)
    except ValueError:
        return None
