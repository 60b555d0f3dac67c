"""A GPU's compute processes in one NVML call: what ``nvmlDeviceGetComputeRunningProcesses``
returns, at about half its cost.

nvidia-ml-py's function calls the driver twice per GPU and cycle: once with an empty buffer to
learn the count, then again with a buffer twice that size; and it turns every entry into a
Python object (``nvmlStructToFriendlyObject``: a dict and an attribute per field). At 64
processes that was the dearest NVML call of a cycle (1.1-1.8 ms of CPU on the H200,
bench/nvml_poll.py). ``ComputeProcesses`` keeps one buffer per GPU, sized from the last count
(twice it, plus ``SPARE``), calls ``nvmlDeviceGetComputeRunningProcesses_v3`` once into it and
reads two fields of each entry; when the driver says the buffer is too small
(``NVML_ERROR_INSUFFICIENT_SIZE``, with the count it needs) it grows the buffer and asks again.

It uses nvidia-ml-py's ctypes parts (``_nvmlGetFunctionPointer``, ``c_nvmlProcessInfo_v3_t``,
the struct its own v3 function fills): where they are not there (another version, a recorded
double), ``available`` is False and a call is the library's public function; so it is from then
on where the driver has no v3 call.
tests/test_nvml_compute.py drives the buffer logic with a fake driver function;
tests/gpu/test_gpu_suite.py compares both on a real GPU with real holders.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

SPARE = 16  # entries beyond twice the last count: processes that start between two cycles
MAX_ATTEMPTS = 4  # a buffer too small is grown and asked again at most this often per call
_NA = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong: usedGpuMemory unknown (WDDM, MIG)


class ComputeProcess(NamedTuple):
    """The two fields of ``nvmlProcessInfo_v3_t`` the daemon reads (the public function's objects
    have the same names)."""

    pid: int
    usedGpuMemory: int | None  # NVML's name, as pynvml's objects spell it


class ComputeProcesses:
    """``nvmlDeviceGetComputeRunningProcesses(handle)`` with a kept buffer per GPU index."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.calls = 0  # driver calls made (tests)
        self._buffers: dict[int, Any] = {}  # GPU index -> its buffer
        self._struct: Any = getattr(nv, "c_nvmlProcessInfo_v3_t", None)
        self.available = (
            self._struct is not None
            and callable(getattr(nv, "_nvmlGetFunctionPointer", None))
            and callable(getattr(nv, "nvmlDeviceGetComputeRunningProcesses_v3", None))
            and all(
                isinstance(getattr(nv, c, None), int)
                for c in ("NVML_SUCCESS", "NVML_ERROR_INSUFFICIENT_SIZE", "NVML_ERROR_FUNCTION_NOT_FOUND")
            )
        )

    def clear(self) -> None:
        """Forget the buffers (after nvmlShutdown the GPUs are listed again)."""
        self._buffers.clear()

    def __call__(self, index: int, handle: Any) -> list[Any]:
        """The processes of GPU ``index`` (``handle``: its NVML handle), as ``ComputeProcess``;
        where the kept buffer cannot be used, what the library's own function returns."""
        nv = self.nv
        if not self.available:
            return list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
        try:
            fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
        except nv.NVMLError as e:  # a driver without the v3 call: the public function from now on
            if getattr(e, "value", None) != nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            self.available = False
            return list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
        buf = self._buffers.get(index)
        if buf is None:
            buf = (self._struct * SPARE)()
        for _ in range(MAX_ATTEMPTS):
            count = ctypes.c_uint(len(buf))
            self.calls += 1
            ret = fn(handle, ctypes.byref(count), buf)
            if ret == nv.NVML_ERROR_INSUFFICIENT_SIZE:  # more than fit: count says how many
                buf = (self._struct * (2 * count.value + SPARE))()
                continue
            if ret != nv.NVML_SUCCESS:
                raise nv.NVMLError(ret)
            n = min(count.value, len(buf))
            out = [ComputeProcess(e.pid, None if e.usedGpuMemory == _NA else e.usedGpuMemory) for e in buf[:n]]
            if not n + SPARE <= len(buf) <= 4 * (n + SPARE):  # room for new ones, not far more
                buf = (self._struct * (2 * n + SPARE))()
            self._buffers[index] = buf
            return out
        raise nv.NVMLError(nv.NVML_ERROR_INSUFFICIENT_SIZE)
