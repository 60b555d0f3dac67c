"""NVML source: GPUs, the processes that hold memory on them, and Xid critical-error events.

Reads (through nvidia-ml-py, imported as ``pynvml``) per device: index, UUID, name, PCI bus id,
memory total/used, utilisation; the compute *and* graphics processes with their used memory.
Not per-process SM utilisation: ``nvmlDeviceGetProcessUtilization`` cost 1.4 ms of CPU per GPU
per cycle at 64 processes on the H200 (``bench/nvml_poll.py``), more than the process lists, for a
value nothing exported or judged. NVML's "not available" (``None`` /
``NVML_VALUE_NOT_AVAILABLE``, as for processes inside a MIG instance) is kept as ``None`` =
unknown, never 0.

Cost: about ten NVML calls per GPU per cycle; each is an ioctl into the driver (see
``bench/nvml_poll.py`` for the measured cost: the compute-process list is the dearest, 1.1-1.8 ms
of CPU at 64 processes on the H200 through nvidia-ml-py, which asks the driver twice; one call
into a kept buffer with ``nvml_compute.ComputeProcesses``). The graphics-process list (0.9 ms there, usually empty on a
training node) is taken again every ``GRAPHICS_RELIST_SECONDS`` or when the GPU's used memory
moved by more than ``GRAPHICS_MEMORY_STEP``; in between, the last list less the processes that
exited. NVML calls can block for seconds when a GPU falls off
the bus, so ``read()`` is a plain synchronous call that the daemon runs off the scrape path under a
time-out; it never runs on a scrape.

Privilege: any user can read device data; listing *other users'* processes needs root or
CAP_SYS_ADMIN on some drivers (otherwise NVML returns only the caller's own processes).

Shell equivalent::

    nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu \
        --format=csv
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv

No driver (CI, CPU nodes) raises ``NvmlNotPresent``: the collector is down, the daemon runs on.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from gpuwatchd.isolation import NotPresent
from gpuwatchd.model import GpuDevice, GpuProcess
from gpuwatchd.sources.nvml_compute import ComputeProcesses

log = logging.getLogger(__name__)

Reading = tuple[tuple[GpuDevice, ...], tuple[GpuProcess, ...]]

# NVML return codes (nvml.h); kept here so that a fake/fixture need not import pynvml.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
# Graphics-context processes are listed again this often, or when a GPU's used memory moves by
# more than this since (NvmlSource._graphics_processes)
GRAPHICS_RELIST_SECONDS = 30.0
GRAPHICS_MEMORY_STEP = 256 << 20
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_NO_DATA = 26
_NOT_PRESENT_CODES = frozenset({NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND})
# Per-field "the driver does not say": the value becomes None, the reading goes on.
_UNKNOWN_CODES = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION, NVML_ERROR_NO_DATA})
# 2**64-1 and 2**32-1: NVML_VALUE_NOT_AVAILABLE for unsigned long long / unsigned int fields.
_NA_VALUES = frozenset({(1 << 64) - 1, (1 << 32) - 1})


class NvmlNotPresent(NotPresent):
    """No NVIDIA driver / libnvidia-ml on this host: not an error, the collector is simply down."""


class NvmlReadError(RuntimeError):
    """NVML is present but a call failed (GPU lost, driver error, time-out)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlReader(Protocol):
    """What the daemon polls: one synchronous reading, devices then processes."""

    def read(self) -> Reading: ...


def load_pynvml() -> Any:
    """Import nvidia-ml-py; its absence is "not present", like a missing driver."""
    try:
        import pynvml
    except ImportError as exc:  # the wheel is a hard dependency, but be explicit about it
        raise NvmlNotPresent(f"nvidia-ml-py is not installed: {exc}") from exc
    return pynvml


def nvml_error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def decode_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _known(value: Any) -> int | None:
    """NVML's N/A (None or the all-ones sentinel) -> None; otherwise the integer."""
    if value is None:
        return None
    number = int(value)
    return None if number in _NA_VALUES else number


class NvmlSource:
    """The real reader. ``pynvml`` is a constructor argument so tests can pass a recorded double."""

    def __init__(
        self,
        pynvml: Any = None,
        clock: Callable[[], float] = time.time,
        graphics_relist_seconds: float = GRAPHICS_RELIST_SECONDS,
    ):
        self._nvml = pynvml
        self._clock = clock
        self.graphics_relist_seconds = graphics_relist_seconds
        self._lock = threading.Lock()
        self._initialised = False
        # index -> (listed at, the GPU's used memory then, its graphics processes)
        self._graphics: dict[int, tuple[float, int | None, list[GpuProcess]]] = {}
        self.graphics_listings = 0  # nvmlDeviceGetGraphicsRunningProcesses calls (tests, benches)
        # index -> reason for the devices the last read() could not read (lost, driver error)
        self.device_errors: dict[int, str] = {}
        self.lost_devices: frozenset[int] = frozenset()  # NVML_ERROR_GPU_IS_LOST at last read()
        self.driver_version: str = ""
        self._compute: ComputeProcesses | None = None  # one driver call per GPU (nvml_compute.py)

    @property
    def library(self) -> Any:
        """The pynvml module (or recorded replay) given to the constructor; None: load the real one."""
        return self._nvml

    # -- life cycle ---------------------------------------------------------------------------
    def _lib(self) -> Any:
        if self._nvml is None:
            self._nvml = load_pynvml()
        return self._nvml

    def _ensure_init(self) -> Any:
        nv = self._lib()
        if self._initialised:
            return nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            if nvml_error_code(exc) in _NOT_PRESENT_CODES:
                raise NvmlNotPresent(f"NVML not present on this host: {exc}") from exc
            raise NvmlReadError(f"nvmlInit failed: {exc}", nvml_error_code(exc)) from exc
        self._initialised = True
        try:
            self.driver_version = decode_text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError:
            self.driver_version = ""
        return nv

    def reinit(self) -> None:
        """Shut NVML down so the next read() initialises it again (devices came or went)."""
        with self._lock:
            self._shutdown_locked()

    def close(self) -> None:
        with self._lock:
            self._shutdown_locked()

    def _shutdown_locked(self) -> None:
        if self._initialised and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
        self._initialised = False
        self._graphics.clear()  # handles and processes are listed again after a re-init
        if self._compute is not None:
            self._compute.clear()

    # -- reading ------------------------------------------------------------------------------
    def read(self) -> Reading:
        with self._lock:
            nv = self._ensure_init()
            try:
                count = int(nv.nvmlDeviceGetCount())
            except nv.NVMLError as exc:
                self._shutdown_locked()  # a driver reload needs a fresh init
                raise NvmlReadError(f"nvmlDeviceGetCount failed: {exc}", nvml_error_code(exc)) from exc
            devices: list[GpuDevice] = []
            processes: list[GpuProcess] = []
            errors: dict[int, str] = {}
            lost: set[int] = set()
            for index in range(count):
                try:
                    device, procs = self._read_device(nv, index)
                except nv.NVMLError as exc:
                    # One lost GPU must not hide the others: record it, read on.
                    errors[index] = str(exc)
                    if nvml_error_code(exc) == NVML_ERROR_GPU_IS_LOST:
                        lost.add(index)
                    continue
                devices.append(device)
                processes.extend(procs)
            self.device_errors = errors
            self.lost_devices = frozenset(lost)
            if count and not devices:
                raise NvmlReadError(
                    "no GPU could be read: " + "; ".join(f"GPU {i}: {e}" for i, e in sorted(errors.items()))
                )
            return tuple(devices), tuple(processes)

    def _optional(self, nv: Any, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except nv.NVMLError as exc:
            if nvml_error_code(exc) in _UNKNOWN_CODES:
                return None
            raise

    def _read_device(self, nv: Any, index: int) -> tuple[GpuDevice, list[GpuProcess]]:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        uuid = decode_text(nv.nvmlDeviceGetUUID(handle))
        name = decode_text(nv.nvmlDeviceGetName(handle))
        pci = nv.nvmlDeviceGetPciInfo(handle)
        bus_id = decode_text(getattr(pci, "busId", "") or getattr(pci, "busIdLegacy", ""))
        mem = self._optional(nv, lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        util = self._optional(nv, lambda: nv.nvmlDeviceGetUtilizationRates(handle))
        gpu_util = _known(getattr(util, "gpu", None)) if util is not None else None
        mem_util = _known(getattr(util, "memory", None)) if util is not None else None
        # renamed "clocks event reasons" in NVML 12.x; the old name stays as an alias
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = self._optional(nv, lambda: reasons_fn(handle)) if reasons_fn else None
        device = GpuDevice(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=bus_id,
            memory_total_bytes=_known(mem.total) if mem is not None else None,
            memory_used_bytes=_known(mem.used) if mem is not None else None,
            utilization_ratio=None if gpu_util is None else gpu_util / 100.0,
            throttle_reasons=_known(reasons) if reasons is not None else None,
            memory_utilization_ratio=None if mem_util is None else mem_util / 100.0,
        )
        if self._compute is None:  # the library is known once NVML is up
            self._compute = ComputeProcesses(nv)
        listed = self._optional(nv, functools.partial(self._compute, index, handle))
        procs = _processes(index, uuid, "compute", listed or [])
        return device, procs + self._graphics_processes(nv, handle, device)

    def _graphics_processes(self, nv: Any, handle: Any, device: GpuDevice) -> list[GpuProcess]:
        """The graphics-context processes of ``device``: listed again every
        ``GRAPHICS_RELIST_SECONDS``, at once when the GPU's used memory moved by more than
        ``GRAPHICS_MEMORY_STEP`` since (a new holder shows there first), and otherwise taken from
        the last list without the processes that exited. A training node rarely has any, and the
        listing cost 0.9 ms of CPU per GPU per cycle on the H200 with none (bench/nvml_poll.py)."""
        now = time.monotonic()
        used = device.memory_used_bytes
        last = self._graphics.get(device.index)
        if (
            last is not None
            and now - last[0] < self.graphics_relist_seconds
            and used is not None
            and last[1] is not None
            and abs(used - last[1]) <= GRAPHICS_MEMORY_STEP
        ):
            return [p for p in last[2] if _alive(p.pid)]
        listed = self._optional(nv, functools.partial(nv.nvmlDeviceGetGraphicsRunningProcesses, handle))
        self.graphics_listings += 1
        procs = _processes(device.index, device.uuid, "graphics", listed or [])
        self._graphics[device.index] = (now, used, procs)
        return procs


def _processes(index: int, uuid: str, kind: str, listed: Iterable[Any]) -> list[GpuProcess]:
    procs: list[GpuProcess] = []
    seen: set[int] = set()
    for p in listed:
        pid = int(p.pid)
        if pid in seen:
            continue
        seen.add(pid)
        procs.append(
            GpuProcess(
                gpu_index=index,
                uuid=uuid,
                pid=pid,
                used_memory_bytes=_known(getattr(p, "usedGpuMemory", None)),
                kind=kind,
            )
        )
    return procs


def _alive(pid: int) -> bool:
    """Is ``pid`` a live process (the daemon runs in the host PID namespace, as NVML reports)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's, alive
        return True
    return True


def select_devices(devices: Sequence[GpuDevice], selectors: Sequence[str]) -> tuple[GpuDevice, ...]:
    """Devices named by index ("0") or UUID ("GPU-…", a unique prefix is enough); all if empty."""
    if not selectors:
        return tuple(devices)
    chosen: list[GpuDevice] = []
    for sel in selectors:
        sel = sel.strip()
        if not sel:
            continue
        if sel.isdigit():
            match = [d for d in devices if d.index == int(sel)]
        else:
            match = [d for d in devices if d.uuid == sel or d.uuid.startswith(sel)]
        if len(match) != 1:
            raise ValueError(f"no single GPU matches {sel!r}")
        if match[0] not in chosen:
            chosen.append(match[0])
    return tuple(chosen)
