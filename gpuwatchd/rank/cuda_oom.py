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

Daemon side (``OomEventFiles`` in sources/cuda_oom_events.py, ``attribute`` in join/cuda_oom.py,
the rule in findings/cuda_oom.py): each cycle reads the new event files once each (removing them
where it may), refuses those whose owner is not root or the uid of the rank they name, counts
``cuda_oom_errors{job_id,rank,gpu}`` and raises a ``cuda_oom`` finding that names the co-tenants,
e.g. "rank 0 of job dflash (pid 11641) hit CUDA OOM on GPU 0 (tried to allocate 50.1 GiB); PID 11223
(python3, not in any job, its parent died and it was adopted by init) held 55.7 GiB there".

Cost: nothing until an OOM happens. Privilege: the rank writes into the rank directory; the daemon
reads it. Shell equivalent: ``grep -n 'CUDA out of memory' train.log; nvidia-smi
--query-compute-apps=pid,used_memory --format=csv`` at the moment of the error.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from gpuwatchd.rank import rankdir

log = logging.getLogger(__name__)

SUFFIX = ".event"
PREFIX = "cuda_oom-"
MAX_EVENT_BYTES = 64 * 1024
_OOM_TEXT = re.compile(r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED")
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)")
_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


# --------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------


@dataclass
class OomHook:
    rank_dir: str
    job_id: str
    rank: int
    last_written: float = 0.0
    installed: list[str] = field(default_factory=list)


_hook: OomHook | None = None
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
    hook: OomHook,
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
    try:  # the shared directory's rules (rank/rankdir.py): no link followed, no FIFO opened
        dir_fd = rankdir.open_dir(hook.rank_dir, create=False)
        try:
            used = rankdir.write_new(dir_fd, name, name[: -len(SUFFIX)], SUFFIX, json.dumps(doc).encode())
        finally:
            os.close(dir_fd)
        path = os.path.join(hook.rank_dir, used)
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
        record_event(
            hook, device=int(device), requested_bytes=int(alloc), free_bytes=int(device_free), source="allocator"
        )


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
        record_event(hook, device=device, requested_bytes=requested, message=str(exc), source="exception")


def install_hook(rank_dir: str, job_id: str, rank: int) -> list[str]:
    """Install the OOM hooks for this process; returns which ones were installed."""
    global _hook
    with _lock:
        if _hook is not None:
            _hook.rank_dir, _hook.job_id, _hook.rank = rank_dir, job_id, rank
            return list(_hook.installed)
        _hook = OomHook(rank_dir, job_id, rank)
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

    def excepthook(t: type[BaseException], v: BaseException, tb: TracebackType | None) -> None:
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
