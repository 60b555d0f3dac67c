"""py-spy source: the GIL-held fraction and the Python stacks of one process, never stopping it.

Reads: the target's memory through py-spy (``process_vm_readv``), and ``/proc/PID/task/*/{stat,
status,wchan}`` for the cheap thread view that py-spy results are checked and mapped against.

Cost: ``record --gil --nonblocking`` at 50 Hz costs py-spy ~0.05 CPU-s per sampled second and
nothing measurable on the target (research/gil-hang-oom.md §1.4: blocking mode cut a 65-thread
target's throughput by ~80 %, so blocking mode is never used). ``dump --json --nonblocking`` ~10 ms.
The /proc thread view costs a few µs per thread.

Privilege: PTRACE_MODE_ATTACH on the target: same uid, or CAP_SYS_PTRACE (root without
CAP_SYS_PTRACE fails even on root's own processes). Missing permission or a missing binary is
reported as a ``PySpyError`` with a reason, never raised past the caller's isolation wrapper.

Shell equivalent::

    py-spy record --gil --nonblocking --format raw --threads --hideprogress -r 50 -d 5 -o F -p PID
    py-spy dump --json --nonblocking -p PID
    for t in /proc/PID/task/*; do cat $t/stat $t/wchan; grep NSpid $t/status; done

Safety rules (each one a lesson from an upstream issue, see the research notes §1.4):
- the real binary is resolved once (a pyenv shim costs ~100 ms per call and may be a different
  version); a configured path wins;
- every run is its own session (process group) and is SIGKILLed as a group at the hard time-out;
  what a run leaves outside its group (a helper that calls ``setsid``) is reparented to the
  daemon, a child subreaper, and killed and reaped after the run (gpuwatchd/reaper.py);
- at most ``max_concurrent`` runs at once (a semaphore);
- stdout/stderr/output files are read up to a size cap;
- after each run the target's state is compared with its state before: a target that we left in
  ``T`` (py-spy #390/#416) is continued with SIGCONT and counted;
- thread ids of a target in a nested PID namespace are namespace-local in py-spy's output
  (``PyThreadState.native_thread_id``); they are mapped to host ids through ``NSpid``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from gpuwatchd.model import GilReading
from gpuwatchd.paths import HostPaths
from gpuwatchd.reaper import CHILDREN, ChildReaper

log = logging.getLogger(__name__)

COLLECTOR = "pyspy"
# A raw record of 5 s at 50 Hz is a few KiB; a dump of 200 threads about 1 MiB.
OUTPUT_CAP_BYTES = 4 << 20

# Reasons (PySpyError.reason): short, stable, safe for logs and the collector error string.
ABSENT = "absent"
PERMISSION_DENIED = "permission_denied"
TIMEOUT = "timeout"
TARGET_GONE = "target_gone"
NOT_PYTHON = "not_python"
OUTPUT_TOO_LARGE = "output_too_large"
BUSY = "busy"
FAILED = "failed"

_SAMPLES_RE = re.compile(rb"Samples: (\d+) Errors: (\d+)")
_THREAD_RE = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)(?:: ?(.*))?$")
_LINE_RE = re.compile(r"^(.*) \(([^()]*?)(?::(\d+))?\)$")


class PySpyError(Exception):
    """A py-spy run that gave no usable result. ``reason`` is one of the constants above."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

    @property
    def collector_down(self) -> bool:
        """True when the collector as a whole cannot work (not just this one target)."""
        return self.reason in (ABSENT, PERMISSION_DENIED, TIMEOUT, FAILED)


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str  # short file name as py-spy prints it (``threading.py``)
    line: int | None

    def __str__(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})" if self.line else self.where

    @property
    def where(self) -> str:
        """Function and file without the line: what "the same place" means across dumps."""
        return f"{self.name} ({self.filename})" if self.filename else self.name


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a ``py-spy dump --json``; frames innermost first."""

    tid: int | None  # host thread id (mapped through NSpid); None when py-spy did not say
    ns_tid: int | None  # the id py-spy printed (namespace-local when the target is in a pid ns)
    name: str
    active: bool
    owns_gil: bool
    frames: tuple[Frame, ...] = ()


@dataclass(frozen=True)
class GilSample:
    """One ``record --gil`` run: ``held`` GIL-holding ticks out of ``ticks`` counted ticks."""

    pid: int
    ticks: int  # rate*duration - 1 - errors: the ticks that were really looked at
    held: int  # py-spy's "Samples": with --gil at most one trace per tick
    errors: int
    top_functions: tuple[tuple[str, int], ...]  # leaf function (no line) -> GIL-held ticks
    by_thread: tuple[tuple[int, str, int], ...]  # (host tid or 0 if unknown, thread name, ticks)
    wall_seconds: float
    pyspy_cpu_seconds: float  # user+sys of the py-spy process (rusage)
    timestamp: float

    @property
    def ratio(self) -> float:
        return self.held / self.ticks if self.ticks > 0 else 0.0

    def reading(self) -> GilReading:
        return GilReading(
            pid=self.pid,
            samples=self.ticks,
            held=min(self.held, self.ticks),
            top_functions=self.top_functions,
            timestamp=self.timestamp,
        )


@dataclass(frozen=True)
class ThreadInfo:
    """One task of ``/proc/PID/task``: the cheap view (no ptrace)."""

    tid: int
    ns_tid: int  # innermost NSpid (== tid when the process is not in a nested pid namespace)
    comm: str
    state: str
    wchan: str  # "" when 0 / unreadable
    cpu_ticks: int  # utime + stime, clock ticks
    voluntary_switches: int
    involuntary_switches: int


@dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    wall_seconds: float
    cpu_seconds: float
    timed_out: bool


# ----------------------------------------------------------------------------- /proc thread view


def _read(path: str, limit: int = 65536) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def parse_stat(text: str) -> tuple[str, str, int]:
    """``/proc/PID/stat`` -> (comm, state, utime+stime ticks); comm may hold spaces and ')'."""
    lpar, rpar = text.index("("), text.rindex(")")
    rest = text[rpar + 2 :].split()
    return text[lpar + 1 : rpar], rest[0], int(rest[11]) + int(rest[12])


def process_state(paths: HostPaths, pid: int) -> str | None:
    """The state letter of a process, None when it is gone (or a zombie that was reaped)."""
    try:
        return parse_stat(_read(paths.proc(pid, "stat")))[1]
    except (OSError, ValueError, IndexError):
        return None


def stop_pending(paths: HostPaths, pid: int) -> bool:
    """A SIGSTOP sent to the process that it has not acted on yet (``ShdPnd``/``SigPnd`` of
    /proc/PID/status, proc(5)): a stop right before a check is seen before the state turns T."""
    bit = 1 << (signal.SIGSTOP - 1)
    try:
        for line in _read(paths.proc(pid, "status")).splitlines():
            if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & bit:
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def process_cpu(paths: HostPaths, pid: int) -> tuple[int, int] | None:
    """(utime+stime ticks of all threads, number of threads) of a process: one read; None when
    it is gone."""
    try:
        text = _read(paths.proc(pid, "stat"))
        rest = text[text.rindex(")") + 2 :].split()
        return int(rest[11]) + int(rest[12]), int(rest[17])
    except (OSError, ValueError, IndexError):
        return None


def _status_fields(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def read_threads(paths: HostPaths, pid: int, detail: bool = True, limit: int | None = None,
                 tids: Sequence[int] | None = None) -> tuple[ThreadInfo, ...]:
    """Every task of ``pid`` as /proc shows it now; tasks that vanish meanwhile are skipped.

    ``detail=False`` skips ``status`` (NSpid, context switches): two small reads per thread instead
    of three, for the probes of processes with a hundred threads (torch). ``limit``: read at most
    that many tasks (lowest tids first: the main thread and the oldest ones), so that the cost of
    one look does not grow with a process's thread count. ``tids``: read these (already listed)."""
    if tids is None:
        tids = task_ids(paths, pid)
    if limit is not None:
        tids = tids[:limit]
    out = []
    for tid in tids:
        try:
            comm, state, ticks = parse_stat(_read(paths.proc(pid, "task", tid, "stat")))
            st = _status_fields(_read(paths.proc(pid, "task", tid, "status"))) if detail else {}
            try:
                wchan = _read(paths.proc(pid, "task", tid, "wchan"), 256).strip()
            except OSError:
                wchan = ""
        except (OSError, ValueError, IndexError):
            continue
        nspid = st.get("NSpid", str(tid)).split()
        out.append(
            ThreadInfo(
                tid=tid,
                ns_tid=int(nspid[-1]) if nspid else tid,
                comm=comm,
                state=state,
                wchan="" if wchan == "0" else wchan,
                cpu_ticks=ticks,
                voluntary_switches=int(st.get("voluntary_ctxt_switches", "0") or 0),
                involuntary_switches=int(st.get("nonvoluntary_ctxt_switches", "0") or 0),
            )
        )
    return tuple(out)


def task_ids(paths: HostPaths, pid: int) -> list[int]:
    """The thread ids of ``pid``, sorted (one directory listing; [] when it is gone)."""
    try:
        return sorted(int(t) for t in os.listdir(paths.proc(pid, "task")) if t.isdigit())
    except OSError:
        return []


def in_nested_pid_namespace(paths: HostPaths, pid: int) -> bool:
    """True when ``/proc/PID/status`` lists more than one NSpid (the target is in a child ns)."""
    try:
        return len(_status_fields(_read(paths.proc(pid, "status"))).get("NSpid", "").split()) > 1
    except OSError:
        return False


def nspid_map(threads: Sequence[ThreadInfo]) -> dict[int, int]:
    """Namespace-local thread id -> host thread id, from the tasks' NSpid lines."""
    return {t.ns_tid: t.tid for t in threads}


# ----------------------------------------------------------------------------- output parsers


def parse_frame(text: str) -> Frame:
    """``burn (cpu4.py:11)`` -> Frame; anything else is kept whole as the name."""
    m = _LINE_RE.match(text)
    if not m:
        return Frame(text, "", None)
    return Frame(m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None)


def parse_record_summary(output: bytes) -> tuple[int, int]:
    """py-spy's closing line ``Samples: N Errors: E`` -> (N, E); ValueError when absent."""
    matches = _SAMPLES_RE.findall(output)
    if not matches:
        raise ValueError("no 'Samples: N Errors: E' line in py-spy output")
    samples, errors = matches[-1]
    return int(samples), int(errors)


def parse_record_raw(
    text: str, tid_map: dict[int, int] | None = None, top: int = 5
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[int, str, int], ...]]:
    """A ``--format raw --threads`` file -> (top leaf functions, ticks per thread).

    Each line is ``thread (TID): name;root frame;...;leaf frame COUNT``. Malformed lines are
    skipped: the file comes from another program and must never crash the daemon.
    """
    leaf: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[tuple[int, str]] = collections.Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        parts = stack.split(";")
        m = _THREAD_RE.match(parts[0])
        if m:
            raw_tid = int(m.group(1), 0)
            tid = (tid_map or {}).get(raw_tid, raw_tid)
            threads[(tid, m.group(2) or "")] += count
            parts = parts[1:]
        if parts:
            leaf[parse_frame(parts[-1]).where] += count
    return (
        tuple(leaf.most_common(top)),
        tuple((tid, name, n) for (tid, name), n in threads.most_common()),
    )


def parse_dump_json(
    text: str, tid_map: dict[int, int] | None = None
) -> tuple[ThreadStack, ...]:
    """``py-spy dump --json`` -> threads; ValueError for anything that is not the expected shape."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy dump --json: expected a list of threads")
    out = []
    for t in data:
        if not isinstance(t, dict):
            raise ValueError("py-spy dump --json: thread entry is not an object")
        frames = []
        for f in t.get("frames") or ():
            if not isinstance(f, dict):
                continue
            line = f.get("line")
            frames.append(
                Frame(
                    name=str(f.get("name", "?")),
                    filename=str(f.get("short_filename") or f.get("filename") or ""),
                    line=line if isinstance(line, int) else None,
                )
            )
        ns_tid = t.get("os_thread_id")
        ns_tid = ns_tid if isinstance(ns_tid, int) else None
        tid = (tid_map or {}).get(ns_tid, ns_tid) if ns_tid is not None else None
        out.append(
            ThreadStack(
                tid=tid,
                ns_tid=ns_tid,
                name=str(t.get("thread_name") or ""),
                active=bool(t.get("active")),
                owns_gil=bool(t.get("owns_gil")),
                frames=tuple(frames),
            )
        )
    return tuple(out)


def classify_failure(stderr: bytes, target_alive: bool) -> tuple[str, str]:
    """(reason, detail) for a py-spy run that failed; detail is py-spy's own first error line."""
    text = stderr.decode("utf-8", "replace")
    first = next(
        (ln.strip() for ln in text.splitlines() if ln.strip().startswith(("Error", "Permission"))),
        text.strip().splitlines()[0] if text.strip() else "",
    )[:200]
    if not target_alive:
        return TARGET_GONE, first or "target exited"
    lowered = text.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return PERMISSION_DENIED, first
    if "python version" in lowered or "python interpreter" in lowered:
        return NOT_PYTHON, first
    return FAILED, first


# ----------------------------------------------------------------------------- the binary


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def resolve_pyspy(configured: str | None = None, search: Sequence[str] | None = None) -> str:
    """The real py-spy binary, resolved once at start.

    A configured path is taken as given (it must exist and be executable). Otherwise the binary
    next to this interpreter (the venv's ``bin/py-spy``, a static ELF from the wheel) and then
    ``$PATH`` are tried; script shims (pyenv) are skipped because each call through them costs
    ~100 ms and may pick another version. Raises PySpyError(ABSENT) with what was tried.
    """
    if configured:
        if os.path.isfile(configured) and os.access(configured, os.X_OK):
            return os.path.abspath(configured)
        raise PySpyError(ABSENT, f"gil.pyspy_path {configured} is not an executable file")
    candidates = list(search) if search is not None else [
        os.path.join(os.path.dirname(sys.executable), "py-spy"),
        shutil.which("py-spy") or "",
    ]
    shims = []
    for cand in candidates:
        if not cand or not os.path.isfile(cand) or not os.access(cand, os.X_OK):
            continue
        real = os.path.realpath(cand)
        if _is_elf(real):
            return real
        shims.append(cand)
    if shims:
        found = ", ".join(shims)
        raise PySpyError(ABSENT, f"only script shims found ({found}); set gil.pyspy_path")
    raise PySpyError(ABSENT, "py-spy binary not found (pip install py-spy, or set gil.pyspy_path)")


# ----------------------------------------------------------------------------- the runner


@dataclass
class PySpyStats:
    runs: int = 0
    timeouts: int = 0
    left_stopped: int = 0  # targets we found in T after a run and continued
    strays_killed: int = 0  # processes a run left outside its process group, killed and reaped
    cpu_seconds: float = 0.0
    last_error: str = ""
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)


class PySpy:
    """Runs the py-spy binary safely. Thread-safe; one instance per daemon."""

    def __init__(
        self,
        binary: str | None,
        *,
        paths: HostPaths | None = None,
        max_concurrent: int = 2,
        timeout_seconds: float = 30.0,
        dump_timeout_seconds: float = 5.0,
        output_cap_bytes: int = OUTPUT_CAP_BYTES,
        run_as: tuple[int, int] | None = None,
        tmp_dir: str | None = None,
        unavailable_reason: str = "",
        clock: Callable[[], float] = time.time,
        reaper: ChildReaper | None = None,
    ) -> None:
        """``binary`` None means absent (``unavailable_reason`` says why); ``run_as`` (uid, gid)
        runs py-spy as that user (needs root), e.g. an unprivileged sampling account;
        ``reaper``: the registry of this process's children (default: the process-wide one)."""
        self.binary = binary
        self.reaper = reaper if reaper is not None else CHILDREN
        self.paths = paths or HostPaths()
        self.timeout_seconds = timeout_seconds
        self.dump_timeout_seconds = dump_timeout_seconds
        self.output_cap_bytes = output_cap_bytes
        self.run_as = run_as
        self.unavailable_reason = unavailable_reason or "py-spy binary not found"
        self.stats = PySpyStats()
        self._slots = threading.BoundedSemaphore(max(1, max_concurrent))
        self._stats_lock = threading.Lock()
        self._tmp_root = tmp_dir
        self._clock = clock

    @classmethod
    def from_config(
        cls, pyspy_path: str | None, *, paths: HostPaths | None = None, **kw: Any
    ) -> PySpy:
        """Resolve the binary once; an absent binary gives an instance whose runs all fail
        with reason ABSENT (collector down, daemon fine)."""
        try:
            return cls(resolve_pyspy(pyspy_path), paths=paths, **kw)
        except PySpyError as e:
            return cls(None, paths=paths, unavailable_reason=e.detail, **kw)

    # -- public API -------------------------------------------------------------------------

    def record_gil(self, pid: int, rate_hz: int = 50, duration_seconds: float = 5.0) -> GilSample:
        """GIL-held fraction of ``pid`` over ``duration_seconds`` (py-spy takes whole seconds).

        Exact denominator (py-spy src/main.rs record_samples): the loop stops after
        ``rate*duration`` intervals, sampling on ``rate*duration - 1`` of them, and with ``--gil``
        emits at most one trace per tick; errors are ticks that were not looked at.
        """
        rate = max(1, int(rate_hz))
        duration = max(1, round(duration_seconds))
        with tempfile.TemporaryDirectory(prefix="gpuwatchd-pyspy-", dir=self._tmp_root) as tmp:
            out = os.path.join(tmp, "gil.raw")
            self._prepare_output(tmp, out)
            args = [
                "record", "--gil", "--nonblocking", "--format", "raw", "--threads",
                "--hideprogress", "-r", str(rate), "-d", str(duration), "-o", out, "-p", str(pid),
            ]  # fmt: skip
            nested = in_nested_pid_namespace(self.paths, pid)
            threads_before = read_threads(self.paths, pid) if nested else ()
            tids_before = task_ids(self.paths, pid)
            res = self._run(pid, args, max(self.timeout_seconds, duration + 1.0))
            combined = res.stdout + res.stderr
            if res.returncode != 0:
                self._fail(pid, res.stderr or res.stdout)
            try:
                held, errors = parse_record_summary(combined)
            except ValueError:
                self._fail(pid, combined)
            if b"because process exited" in combined or process_state(self.paths, pid) is None:
                # py-spy stops quietly when the target exits mid-sample; a partial window is not
                # a measurement of anything.
                raise PySpyError(TARGET_GONE, "target exited while being sampled")
            raw = self._read_capped(out)
            tid_map = self._tid_map(pid, threads_before) if nested else {}
            top, by_thread = parse_record_raw(raw, tid_map)
            # Python <= 3.10 has no native thread id: py-spy then labels threads with pthread ids
            # (py-spy #567). Those are no task of the target; say "unknown" (0), never a wrong tid.
            known = set(tids_before) | set(task_ids(self.paths, pid))
            by_thread = tuple((tid if tid in known else 0, name, n) for tid, name, n in by_thread)
            ticks = max(rate * duration - 1 - errors, 0)
            return GilSample(
                pid=pid,
                ticks=ticks,
                held=min(held, ticks),
                errors=errors,
                top_functions=top,
                by_thread=by_thread,
                wall_seconds=res.wall_seconds,
                pyspy_cpu_seconds=res.cpu_seconds,
                timestamp=self._clock(),
            )

    def dump(self, pid: int, slot_wait: float | None = None) -> tuple[ThreadStack, ...]:
        """Every Python thread's stack, innermost frame first, with the GIL owner marked.

        ``slot_wait``: how long to wait for a free slot (default: the dump time-out); the daemon's
        cycle passes 0 so that it never waits behind running GIL records (reason BUSY instead).
        """
        # the NSpid map is needed only for a target in a nested pid namespace (a container)
        nested = in_nested_pid_namespace(self.paths, pid)
        threads_before = read_threads(self.paths, pid) if nested else ()
        res = self._run(pid, ["dump", "--json", "--nonblocking", "-p", str(pid)],
                        self.dump_timeout_seconds, slot_wait)  # fmt: skip
        if res.returncode != 0:
            self._fail(pid, res.stderr or res.stdout)
        try:
            stacks = parse_dump_json(res.stdout.decode("utf-8", "replace"),
                                     self._tid_map(pid, threads_before) if nested else {})  # fmt: skip
        except (ValueError, json.JSONDecodeError) as e:
            raise PySpyError(FAILED, f"unreadable dump output: {e}") from e
        if nested:
            # py-spy could not match namespace-local ids to /proc and calls every thread active
            # (research §1.6); use the host task state instead.
            state = {t.tid: t.state for t in read_threads(self.paths, pid)}
            stacks = tuple(
                dataclasses.replace(s, active=state.get(s.tid or -1) == "R") for s in stacks
            )
        return stacks

    # -- internals --------------------------------------------------------------------------

    def _tid_map(self, pid: int, threads: Sequence[ThreadInfo]) -> dict[int, int]:
        if not in_nested_pid_namespace(self.paths, pid):
            return {}
        return nspid_map(tuple(threads) + read_threads(self.paths, pid))

    def _prepare_output(self, tmp: str, out: str) -> None:
        if self.run_as is None:
            return
        uid, gid = self.run_as
        os.chown(tmp, uid, gid)
        with open(out, "wb"):
            pass
        os.chown(out, uid, gid)

    def _read_capped(self, path: str) -> str:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return ""  # py-spy writes no file when nothing held the GIL on some versions
        if size > self.output_cap_bytes:
            raise PySpyError(OUTPUT_TOO_LARGE, f"{size} bytes > cap {self.output_cap_bytes}")
        return _read(path, self.output_cap_bytes)

    def _fail(self, pid: int, output: bytes) -> NoReturn:
        alive = process_state(self.paths, pid) not in (None, "Z", "X")
        reason, detail = classify_failure(output, alive)
        raise PySpyError(reason, detail)

    def _run(self, pid: int, args: list[str], timeout: float,
             slot_wait: float | None = None) -> RunResult:  # fmt: skip
        if self.binary is None:
            raise self._count(PySpyError(ABSENT, self.unavailable_reason))
        wait = timeout if slot_wait is None else slot_wait
        if not (self._slots.acquire(timeout=wait) if wait > 0 else self._slots.acquire(False)):
            raise self._count(PySpyError(BUSY, "all py-spy slots busy"))
        try:
            state_before = process_state(self.paths, pid)
            if state_before is None:
                raise self._count(PySpyError(TARGET_GONE, "no such process"))
            res = self._spawn([self.binary, *args], timeout)
            self._check_not_left_stopped(pid, state_before)
        finally:
            self._slots.release()
        with self._stats_lock:
            self.stats.runs += 1
            self.stats.cpu_seconds += res.cpu_seconds
            self.stats.timeouts += int(res.timed_out)
        if res.timed_out:
            raise self._count(PySpyError(TIMEOUT, f"py-spy ran past {timeout:.0f} s, killed"))
        return res

    def _count(self, err: PySpyError) -> PySpyError:
        with self._stats_lock:
            self.stats.reasons[err.reason] += 1
            self.stats.last_error = str(err)
        return err

    def _check_not_left_stopped(self, pid: int, state_before: str) -> None:
        if state_before in ("T", "t"):
            return  # stopped by its owner before the run: left as it was
        after = process_state(self.paths, pid)
        if after not in ("T", "t") and stop_pending(self.paths, pid):
            after = "T (SIGSTOP pending)"
        if after is not None and after[0] in ("T", "t"):
            log.warning("pid %d was left stopped (%s) after py-spy; sending SIGCONT", pid, after)
            with self._stats_lock:
                self.stats.left_stopped += 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _spawn(self, argv: list[str], timeout: float) -> RunResult:
        """Run ``argv`` in its own session; SIGKILL the whole group at ``timeout``.

        The child is waited for with ``waitid(WNOWAIT)`` so that it stays a zombie (its pid and
        process group cannot be reused) until the time-out timer is cancelled; then ``wait4``
        reaps it and gives its CPU usage.
        """
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "RUST_BACKTRACE": "0",
               "RUST_LIB_BACKTRACE": "0"}  # fmt: skip
        kw: dict[str, Any] = {}
        if self.run_as is not None:
            kw.update(user=self.run_as[0], group=self.run_as[1], extra_groups=[])
        with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
            t0 = time.monotonic()
            try:
                with self.reaper.spawning() as live:
                    proc = subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, env=env,
                        start_new_session=True, close_fds=True, **kw,
                    )  # fmt: skip
                    live.add(proc.pid)
            except FileNotFoundError as e:
                raise self._count(PySpyError(ABSENT, f"{argv[0]}: {e.strerror}")) from e
            except PermissionError as e:
                raise self._count(PySpyError(PERMISSION_DENIED, f"{argv[0]}: {e.strerror}")) from e
            timed_out = threading.Event()

            def kill_group() -> None:
                timed_out.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill_group)
            timer.daemon = True
            timer.start()
            try:
                while True:
                    try:
                        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                        break
                    except InterruptedError:
                        continue
            finally:
                timer.cancel()
            if timed_out.is_set():
                # the leader is dead; make sure nothing it started survives in its group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            status, rusage = self.reaper.reap(proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            # whatever the run left outside its group (a helper that called setsid) was
            # reparented to the daemon (a child subreaper): kill and reap it now
            strays = self.reaper.sweep()
            if strays:
                with self._stats_lock:
                    self.stats.strays_killed += strays
            wall = time.monotonic() - t0
            return RunResult(
                returncode=proc.returncode,
                stdout=self._read_file(out_f),
                stderr=self._read_file(err_f),
                wall_seconds=wall,
                cpu_seconds=rusage.ru_utime + rusage.ru_stime,
                timed_out=timed_out.is_set(),
            )

    def _read_file(self, f: Any) -> bytes:
        f.seek(0)
        data: bytes = f.read(self.output_cap_bytes + 1)
        if len(data) > self.output_cap_bytes:
            raise self._count(PySpyError(OUTPUT_TOO_LARGE, f"> {self.output_cap_bytes} bytes"))
        return data

