"""CUDA out-of-memory errors, reported by the rank itself and explained by the daemon.

Rank side (``install_hook``, called by ``gpuwatchd.register_rank()``): PyTorch's caching allocator
calls an out-of-memory observer (``torch._C._cuda_attach_out_of_memory_observer``) at the moment an
allocation fails, before ``torch.OutOfMemoryError`` is raised, and even where the caller catches
it. As a fall-back (allocations outside the caching allocator: cuBLAS workspaces, NCCL buffers),
``sys.excepthook``/``threading.excepthook`` catch an uncaught error whose text says "CUDA out of
memory" / "CUDA error: out of memory". Either writes one small JSON event file
``cuda_oom-<job>-<rank>-<pid>-<ns>.event`` into the rank directory (already writable by ranks; the
rank-file reader reads only ``*.json``), with a snapshot of which PIDs held memory on that GPU at
that moment (NVML, when importable; best effort).

Daemon side (``read_events`` + ``explain``): each cycle reads and removes the event files, counts
``cuda_oom_errors{job_id,rank,gpu}`` and raises a ``cuda_oom`` finding that names the co-tenants,
e.g. "rank 0 of job dflash (pid 11641) hit CUDA OOM on GPU 0 (tried to allocate 50.1 GiB); PID 11223
(python3, not in any job, its parent died and it was adopted by init) held 55.7 GiB there".

Cost: nothing until an OOM happens. Privilege: the rank writes into the rank directory; the daemon
reads it. Shell equivalent: ``grep -n 'CUDA out of memory' train.log; nvidia-smi
--query-compute-apps=pid,used_memory --format=csv`` at the moment of the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import stat as statmod
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from gpuwatchd.model import WARNING, Finding, NodeState

log = logging.getLogger(__name__)

SUFFIX = ".event"
PREFIX = "cuda_oom-"
MAX_EVENT_BYTES = 64 * 1024
MAX_EVENTS_PER_SCAN = 256
FINDING_SECONDS = 600.0  # a cuda_oom finding stays active this long after the error
_OOM_TEXT = re.compile(r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED")
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)")
_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


# --------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------

@dataclass
class _Hook:
    rank_dir: str
    job_id: str
    rank: int
    last_written: float = 0.0
    installed: list[str] = field(default_factory=list)


_hook: _Hook | None = None
_lock = threading.Lock()


def is_cuda_oom(exc: BaseException) -> bool:
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return bool(_OOM_TEXT.search(str(exc)))


def _device_uuid(device: int) -> str:
    """NVML-style UUID ("GPU-…") of a torch device index (CUDA_VISIBLE_DEVICES already applied)."""
    try:
        import torch

        return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)
    except (ImportError, RuntimeError, AssertionError, AttributeError, ValueError):
        return ""


def _co_tenants(uuid: str) -> list[dict[str, Any]] | None:
    """PIDs holding memory on the GPU right now (NVML), or None when NVML cannot say."""
    if not uuid:
        return None
    try:
        import pynvml as nv
    except ImportError:
        return None
    try:
        nv.nvmlInit()
    except nv.NVMLError:
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(uuid)
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        return [{"pid": int(p.pid), "used_memory_bytes": p.usedGpuMemory} for p in procs]
    except nv.NVMLError:
        return None
    finally:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()


def record_event(
    hook: _Hook,
    *,
    device: int | None,
    requested_bytes: int | None,
    free_bytes: int | None = None,
    message: str = "",
    source: str,
    now: float | None = None,
) -> str | None:
    """Write one event file; returns its path (None when it could not be written)."""
    now = time.time() if now is None else now
    uuid = _device_uuid(device) if device is not None else ""
    doc = {
        "version": 1,
        "kind": "cuda_oom",
        "job_id": hook.job_id,
        "rank": hook.rank,
        "pid": os.getpid(),
        "timestamp": now,
        "torch_device": device,
        "device_uuid": uuid,
        "requested_bytes": requested_bytes,
        "device_free_bytes": free_bytes,
        "message": message.splitlines()[0][:600] if message else "",
        "source": source,
        "co_tenants": _co_tenants(uuid),
    }
    name = f"{PREFIX}{hook.job_id}-{hook.rank}-{os.getpid()}-{time.time_ns()}{SUFFIX}"
    path = os.path.join(hook.rank_dir, name)
    tmp = os.path.join(hook.rank_dir, f".{name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("gpuwatchd: could not record CUDA OOM event: %s", exc)
        return None
    hook.last_written = now
    return path


def _observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    hook = _hook
    if hook is None:
        return
    with _lock:
        record_event(hook, device=int(device), requested_bytes=int(alloc),
                     free_bytes=int(device_free), source="allocator")


def _on_uncaught(exc: BaseException) -> None:
    hook = _hook
    if hook is None or not is_cuda_oom(exc):
        return
    with _lock:
        if time.time() - hook.last_written < 5.0:
            return  # the allocator observer has already recorded this one
        m = _TRIED.search(str(exc))
        requested = int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None
        device = None
        try:
            import torch

            if torch.cuda.is_initialized():
                device = int(torch.cuda.current_device())
        except (ImportError, RuntimeError):
            device = None
        record_event(hook, device=device, requested_bytes=requested, message=str(exc),
                     source="exception")


def install_hook(rank_dir: str, job_id: str, rank: int) -> list[str]:
    """Install the OOM hooks for this process; returns which ones were installed."""
    global _hook
    with _lock:
        if _hook is not None:
            _hook.rank_dir, _hook.job_id, _hook.rank = rank_dir, job_id, rank
            return list(_hook.installed)
        _hook = _Hook(rank_dir, job_id, rank)
    installed = _hook.installed
    torch_mod: Any = sys.modules.get("torch")
    if torch_mod is None:
        try:
            torch_mod = importlib.import_module("torch")
        except ImportError:
            torch_mod = None
    attach = getattr(getattr(torch_mod, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(_observer)
        installed.append("allocator")
    previous = sys.excepthook

    def excepthook(
        t: type[BaseException], v: BaseException, tb: TracebackType | None
    ) -> None:
        _on_uncaught(v)
        previous(t, v, tb)

    sys.excepthook = excepthook
    previous_thread = threading.excepthook

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            _on_uncaught(args.exc_value)
        previous_thread(args)

    threading.excepthook = thread_hook
    installed.append("excepthook")
    return list(installed)


# --------------------------------------------------------------------------------------------
# daemon side
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OomEvent:
    job_id: str
    rank: int
    pid: int
    timestamp: float
    device_uuid: str
    requested_bytes: int | None
    co_tenants: tuple[tuple[int, int | None], ...] | None  # (pid, bytes) at the moment, if known
    path: str = ""


def _parse(doc: Any, path: str) -> OomEvent:
    if not isinstance(doc, dict) or doc.get("kind") != "cuda_oom":
        raise ValueError("not a cuda_oom event")
    tenants = doc.get("co_tenants")
    co: tuple[tuple[int, int | None], ...] | None = None
    if isinstance(tenants, list):
        co = tuple(
            (int(t["pid"]), None if t.get("used_memory_bytes") is None
             else int(t["used_memory_bytes"]))
            for t in tenants
            if isinstance(t, dict) and "pid" in t
        )
    req = doc.get("requested_bytes")
    return OomEvent(
        job_id=str(doc["job_id"])[:128],
        rank=int(doc["rank"]),
        pid=int(doc["pid"]),
        timestamp=float(doc["timestamp"]),
        device_uuid=str(doc.get("device_uuid") or "")[:96],
        requested_bytes=None if req is None else int(req),
        co_tenants=co,
        path=path,
    )


def _read_one(path: str) -> OomEvent:
    """One event file; OSError (e.g. ELOOP for a symbolic link) or ValueError when refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not statmod.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        raw = os.read(fd, MAX_EVENT_BYTES + 1)
    finally:
        os.close(fd)
    if not raw or len(raw) > MAX_EVENT_BYTES:
        raise ValueError(f"empty or larger than {MAX_EVENT_BYTES} bytes")
    try:
        return _parse(json.loads(raw), path)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad event: {exc!r}") from exc


def read_events(rank_dir: str, remove: bool = True) -> tuple[list[OomEvent], list[str]]:
    """Read (and remove, bad ones too) the event files; returns (events, problems). Never raises
    for a bad file."""
    events: list[OomEvent] = []
    problems: list[str] = []
    try:
        with os.scandir(rank_dir) as it:
            names = sorted(e.name for e in it
                           if e.name.startswith(PREFIX) and e.name.endswith(SUFFIX))
    except OSError:
        return events, problems
    for name in names[:MAX_EVENTS_PER_SCAN]:
        path = os.path.join(rank_dir, name)
        try:
            events.append(_read_one(path))
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror}")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            problems.append(f"{path}: {exc}")
        if remove:
            try:
                os.unlink(path)
            except OSError as exc:
                problems.append(f"{path}: cannot remove: {exc.strerror}")
    return events, problems


def _fmt(n: float | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def explain(
    event: OomEvent,
    state: NodeState | None,
    orphan_reasons: Mapping[int, str] | None = None,
    comms: Mapping[int, str] | None = None,
) -> tuple[str, Finding]:
    """(gpu index label, finding) for one event, naming who else held memory on that GPU."""
    # A rank in a container wrote the PID it sees; NVML (co-tenants, the state) has host PIDs.
    ns_pid = None
    for r in state.ranks if state else ():
        if (r.job_id, r.rank, r.ns_pid) == (event.job_id, event.rank, event.pid):
            event, ns_pid = dataclasses.replace(event, pid=r.pid), r.ns_pid
            break
    gpus = state.gpus if state else ()
    rows = state.gpu_processes if state else ()
    gpu = next((g for g in gpus if g.uuid == event.device_uuid), None)
    gpu_label = str(gpu.index) if gpu else ""
    orphan_reasons = dict(orphan_reasons or {})
    for o in state.orphans if state else ():
        orphan_reasons.setdefault(o.pid, o.reason)
    if event.co_tenants is not None:
        tenants: Sequence[tuple[int, int | None]] = event.co_tenants
    else:  # no snapshot from the rank: the daemon's latest reading of that GPU
        tenants = [(r.pid, r.used_memory_bytes) for r in rows if r.uuid == event.device_uuid]
    row_by_pid = {r.pid: r for r in rows if r.uuid == event.device_uuid}
    others = []
    for pid, used in sorted(tenants, key=lambda t: -(t[1] or 0)):
        if pid == event.pid:
            continue
        row = row_by_pid.get(pid)
        comm = (comms or {}).get(pid) or (row.comm if row else "")
        if row is not None and row.job_id:
            whose = f"rank {row.rank} of job {row.job_id}"
        else:
            reason = orphan_reasons.get(pid)
            whose = "not in any job" + (f", {_REASON_TEXT.get(reason, reason)}" if reason else "")
        name = f"{comm}, " if comm else ""
        others.append((pid, used, f"PID {pid} ({name}{whose}) held {_fmt(used)} there"))
    where = f"GPU {gpu_label}" if gpu_label else f"GPU {event.device_uuid or '?'}"
    ask = f" (tried to allocate {_fmt(event.requested_bytes)})" if event.requested_bytes else ""
    in_ctr = f" ({ns_pid} in its container)" if ns_pid is not None else ""
    head = f"rank {event.rank} of job {event.job_id} (pid {event.pid}{in_ctr}) hit CUDA OOM on {where}{ask}"
    tail = "; ".join(o[2] for o in others) if others else "no other process held memory there"
    finding = Finding(
        kind="cuda_oom",
        severity=WARNING,
        explanation=f"{head}; {tail}",
        job_id=event.job_id,
        rank=str(event.rank),
        pid=str(event.pid),
        evidence={
            "gpu": gpu_label,
            "uuid": event.device_uuid,
            "requested_bytes": event.requested_bytes,
            "co_tenants": [{"pid": p, "used_memory_bytes": u} for p, u, _ in others],
        },
        since=event.timestamp,
    )
    return gpu_label, finding


_REASON_TEXT = {
    "reparented_to_init": "its parent died and it was adopted by init",
    "job_ended": "its job has ended",
    "unregistered": "claimed by no registered rank",
    "defunct": "gone or a zombie",
}


class OomTracker:
    """Daemon-side: turns event files into counter increments and time-limited findings."""

    def __init__(self, rank_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.rank_dir = rank_dir
        self.clock = clock
        self.active: list[Finding] = []

    def poll(
        self,
        inc: Callable[[str, tuple[str, ...]], None],
        state: NodeState | None,
        orphan_reasons: Mapping[int, str] | None = None,
        comms: Mapping[int, str] | None = None,
    ) -> list[Finding]:
        events, problems = read_events(self.rank_dir)
        for p in problems:
            log.info("CUDA OOM event skipped: %s", p)
        for ev in events:
            gpu, finding = explain(ev, state, orphan_reasons, comms)
            inc("cuda_oom_errors", (ev.job_id, str(ev.rank), gpu))
            self.active = [f for f in self.active if f.key != finding.key] + [finding]
        now = self.clock()
        self.active = [f for f in self.active if now - f.since <= FINDING_SECONDS]
        return list(self.active)


def tenants_of(events: Iterable[OomEvent]) -> set[int]:
    """Every co-tenant PID named by ``events`` (the daemon reads their /proc identity)."""
    return {pid for e in events for pid, _ in (e.co_tenants or ())}
