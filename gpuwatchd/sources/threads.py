"""The cheap view of a process's threads: ``/proc/PID/task/*/{stat,status,wchan,schedstat}`` (no
ptrace).

Used by the py-spy source (to check and map its results), the GIL sampler's convoy probe, the stall
tracker and the hang analysis. Cost: a few µs per thread; every read bounded.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping, Sequence

from gpuwatchd.model.threads import ThreadInfo
from gpuwatchd.paths import HostPaths, read_bounded

log = logging.getLogger(__name__)


def read_capped(path: str, limit: int = 65536) -> str:
    return read_bounded(path, limit).decode("utf-8", "replace")


def parse_stat(text: str) -> tuple[str, str, int]:
    """``/proc/PID/stat`` -> (comm, state, utime+stime ticks); comm may hold spaces and ')'."""
    lpar, rpar = text.index("("), text.rindex(")")
    rest = text[rpar + 2 :].split()
    return text[lpar + 1 : rpar], rest[0], int(rest[11]) + int(rest[12])


def process_state(paths: HostPaths, pid: int) -> str | None:
    """The state letter of a process, None when it is gone (or a zombie that was reaped)."""
    try:
        return parse_stat(read_capped(paths.proc(pid, "stat")))[1]
    except (OSError, ValueError, IndexError):
        return None


def stop_pending(paths: HostPaths, pid: int) -> bool:
    """A SIGSTOP sent to the process that it has not acted on yet (``ShdPnd``/``SigPnd`` of
    /proc/PID/status, proc(5)): a stop right before a check is seen before the state turns T."""
    bit = 1 << (signal.SIGSTOP - 1)
    try:
        for line in read_capped(paths.proc(pid, "status")).splitlines():
            if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & bit:
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def process_cpu(paths: HostPaths, pid: int) -> tuple[int, int] | None:
    """(utime+stime ticks of all threads, number of threads) of a process: one read; None when
    it is gone."""
    try:
        text = read_capped(paths.proc(pid, "stat"))
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


def read_threads(
    paths: HostPaths, pid: int, detail: bool = True, limit: int | None = None, tids: Sequence[int] | None = None
) -> tuple[ThreadInfo, ...]:
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
            comm, state, ticks = parse_stat(read_capped(paths.proc(pid, "task", tid, "stat")))
            st = _status_fields(read_capped(paths.proc(pid, "task", tid, "status"))) if detail else {}
            try:
                wchan = read_capped(paths.proc(pid, "task", tid, "wchan"), 256).strip()
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


def read_threads_since(paths: HostPaths, pid: int, tids: Sequence[int],
                       prev: Mapping[int, tuple[tuple[int, int], ThreadInfo]],
                       ) -> tuple[tuple[ThreadInfo, ...], dict[int, tuple[int, int]]]:  # fmt: skip
    """``read_threads(detail=False)`` of these tasks for a caller that keeps the last view: one
    ``schedstat`` read per task, and ``stat`` + ``wchan`` only for a task that ran since ``prev``
    (tid -> ((run ns, run slices), its ThreadInfo then)). A task that never ran cannot have
    changed its state, wchan or CPU ticks, so its last ThreadInfo is reused: an idle torch rank's
    look costs one read per thread instead of two. Also returns each task's (run ns, slices)
    (none for a kernel without schedstat, where every task is read in full)."""
    out, slices = [], {}
    for tid in tids:
        try:
            run, _, count = read_capped(paths.proc(pid, "task", tid, "schedstat"), 256).split()
            now_v = int(run), int(count)
        except OSError:
            continue  # gone
        except ValueError:
            now_v = (0, 0)
        old = prev.get(tid)
        if now_v[1] and old is not None and old[0] == now_v:
            out.append(old[1])
            slices[tid] = now_v
            continue
        got = read_threads(paths, pid, detail=False, tids=(tid,))
        if got:
            out.append(got[0])
            if now_v[1]:
                slices[tid] = now_v
    return tuple(out), slices


def read_schedstat(paths: HostPaths, pid: int, tid: int) -> tuple[int, int] | None:
    """(ns run on a CPU, ns waited on a run queue) of one task, from ``/proc/PID/task/TID/schedstat``
    (None where the kernel has no schedstat or the task is gone). Their sum over a window is the
    time the task was runnable: a spin preempted by other load shows as runnable the whole time,
    where its CPU share alone says it worked half of it."""
    try:
        run, wait, _ = read_capped(paths.proc(pid, "task", tid, "schedstat"), 256).split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def read_run_slices(
    paths: HostPaths, pid: int, tids: Sequence[int] | None = None, max_tasks: int | None = None
) -> dict[int, tuple[int, int]] | None:
    """{tid: (ns run on a CPU, run slices)} of these tasks (default: every task of ``pid``), from
    ``/proc/PID/task/TID/schedstat``; None when one is unreadable (gone), reads a slice count of 0
    (a kernel without schedstat prints ``0 0 0`` for every task, and a task we see has run at
    least once otherwise), or there are none or more than ``max_tasks``. Both numbers only grow
    while the task runs: the same pair at two readings means it never ran between them (the stall
    tracker's proof that a rank's stacks are its last dump's)."""
    if tids is None:
        tids = task_ids(paths, pid)
    if not tids or (max_tasks is not None and len(tids) > max_tasks):
        return None
    out = {}
    for tid in tids:
        try:
            run, _, slices = read_capped(paths.proc(pid, "task", tid, "schedstat"), 256).split()
            out[tid] = int(run), int(slices)
        except (OSError, ValueError):
            return None
        if not out[tid][1]:
            return None
    return out


def task_ids(paths: HostPaths, pid: int) -> list[int]:
    """The thread ids of ``pid``, sorted (one directory listing; [] when it is gone)."""
    try:
        return sorted(int(t) for t in os.listdir(paths.proc(pid, "task")) if t.isdigit())
    except OSError:
        return []


def in_nested_pid_namespace(paths: HostPaths, pid: int) -> bool:
    """True when ``/proc/PID/status`` lists more than one NSpid (the target is in a child ns)."""
    try:
        return len(_status_fields(read_capped(paths.proc(pid, "status"))).get("NSpid", "").split()) > 1
    except OSError:
        return False


def nspid_map(threads: Sequence[ThreadInfo]) -> dict[int, int]:
    """Namespace-local thread id -> host thread id, from the tasks' NSpid lines."""
    return {t.ns_tid: t.tid for t in threads}
