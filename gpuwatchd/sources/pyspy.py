"""py-spy source: the GIL-held fraction and the Python stacks of one process, never stopping it.

Reads: the target's memory through py-spy (``process_vm_readv``), and ``/proc/PID/task/*/{stat,
status,wchan}`` for the cheap thread view that py-spy results are checked and mapped against
(sources/threads.py; the output parsers are in sources/pyspy_output.py).

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
  daemon, a child subreaper, and killed and reaped after the run (gpuwatchd/sources/reaper.py);
- at most ``max_concurrent`` runs at once (a semaphore);
- stdout/stderr/output files are read up to a size cap;
- after each run the target's state is compared with its state before: a target found in ``T``
  that was running before is counted and logged, never continued (``--nonblocking`` never stops
  it, so someone else did: the daemon does not undo a debugger's or Slurm's stop);
- thread ids of a target in a nested PID namespace are namespace-local in py-spy's output
  (``PyThreadState.native_thread_id``); they are mapped to host ids through ``NSpid``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from gpuwatchd.model.threads import ThreadInfo, ThreadStack
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.pyspy_output import (
    ABSENT,
    BUSY,
    FAILED,
    OUTPUT_CAP_BYTES,
    OUTPUT_TOO_LARGE,
    TARGET_GONE,
    TIMEOUT,
    GilSample,
    PySpyError,
    RunResult,
    classify_failure,
    parse_dump_json,
    parse_record_raw,
    parse_record_summary,
)
from gpuwatchd.sources.pyspy_spawn import spawn
from gpuwatchd.sources.reaper import CHILDREN, ChildReaper
from gpuwatchd.sources.threads import (
    in_nested_pid_namespace,
    nspid_map,
    process_state,
    read_capped,
    read_threads,
    stop_pending,
    task_ids,
)

log = logging.getLogger(__name__)
__all__ = ["PySpy", "PySpyStats", "resolve_pyspy"]

# ----------------------------------------------------------------------------- the binary


def _on_path(name: str) -> str | None:
    """``shutil.which(name)``, without importing shutil (which imports bz2 and lzma)."""
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(d, name)
        if d and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


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
    candidates = (
        list(search)
        if search is not None
        else [
            os.path.join(os.path.dirname(sys.executable), "py-spy"),
            _on_path("py-spy") or "",
        ]
    )
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
    left_stopped: int = 0  # targets found in T after a run that found them running (left so)
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
        self.available = binary is not None  # decided once: absent, every run fails with ABSENT
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
    def from_config(cls, pyspy_path: str | None, *, paths: HostPaths | None = None, **kw: Any) -> PySpy:
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
        import tempfile  # here: with shutil it imports bz2 and lzma (bench/rss.py)

        with tempfile.TemporaryDirectory(prefix="gpuwatchd-pyspy-", dir=self._tmp_root) as tmp:
            out = os.path.join(tmp, "gil.raw")
            self._prepare_output(tmp, out)
            args = [
                "record",
                "--gil",
                "--nonblocking",
                "--format",
                "raw",
                "--threads",
                "--hideprogress",
                "-r",
                str(rate),
                "-d",
                str(duration),
                "-o",
                out,
                "-p",
                str(pid),
            ]
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
        res = self._run(pid, ["dump", "--json", "--nonblocking", "-p", str(pid)], self.dump_timeout_seconds, slot_wait)
        if res.returncode != 0:
            self._fail(pid, res.stderr or res.stdout)
        try:
            stacks = parse_dump_json(
                res.stdout.decode("utf-8", "replace"), self._tid_map(pid, threads_before) if nested else {}
            )
        except (ValueError, json.JSONDecodeError) as e:
            raise PySpyError(FAILED, f"unreadable dump output: {e}") from e
        if nested:
            # py-spy could not match namespace-local ids to /proc and calls every thread active
            # (research §1.6); use the host task state instead.
            state = {t.tid: t.state for t in read_threads(self.paths, pid)}
            stacks = tuple(dataclasses.replace(s, active=state.get(s.tid or -1) == "R") for s in stacks)
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
        return read_capped(path, self.output_cap_bytes)

    def _fail(self, pid: int, output: bytes) -> NoReturn:
        alive = process_state(self.paths, pid) not in (None, "Z", "X")
        reason, detail = classify_failure(output, alive)
        raise PySpyError(reason, detail)

    def _run(self, pid: int, args: list[str], timeout: float, slot_wait: float | None = None) -> RunResult:
        if self.binary is None:
            raise self._count(PySpyError(ABSENT, self.unavailable_reason))
        wait = timeout if slot_wait is None else slot_wait
        if not (self._slots.acquire(timeout=wait) if wait > 0 else self._slots.acquire(False)):
            raise self._count(PySpyError(BUSY, "all py-spy slots busy"))
        try:
            state_before = process_state(self.paths, pid)
            if state_before is None:
                raise self._count(PySpyError(TARGET_GONE, "no such process"))
            try:
                res = spawn(
                    [self.binary, *args],
                    timeout,
                    reaper=self.reaper,
                    output_cap_bytes=self.output_cap_bytes,
                    run_as=self.run_as,
                    on_strays=self._count_strays,
                )
            except PySpyError as e:
                self._count(e)
                raise
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

    def _count_strays(self, n: int) -> None:
        with self._stats_lock:
            self.stats.strays_killed += n

    def _check_not_left_stopped(self, pid: int, state_before: str) -> None:
        """A target found stopped after a run that found it running is counted and logged, and
        left as it is: ``--nonblocking`` never stops a process, so whoever stopped it (its owner,
        a debugger, Slurm's suspend, or a ``gil.pyspy_path`` binary that does not honour
        ``--nonblocking``) is not the daemon, and resuming what the daemon did not stop would
        undo their decision. (It could not anyway: the unit has no CAP_KILL, so SIGCONT to
        another user's process fails with EPERM.)"""
        if state_before in ("T", "t"):
            return  # stopped by its owner before the run: left as it was
        after = process_state(self.paths, pid)
        if after not in ("T", "t") and stop_pending(self.paths, pid):
            after = "T (SIGSTOP pending)"
        if after is not None and after[0] in ("T", "t"):
            log.warning("pid %d was stopped (%s) during a py-spy run that never stops it; left as it is", pid, after)
            with self._stats_lock:
                self.stats.left_stopped += 1
