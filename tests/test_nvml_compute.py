"""sources/nvml_compute.py: the compute-process list in one driver call, against a fake driver
function that follows NVML's contract for ``nvmlDeviceGetComputeRunningProcesses_v3`` (fill up
to ``*count`` entries; too few: NVML_ERROR_INSUFFICIENT_SIZE with ``*count`` set to what is
needed). The real driver is compared with nvidia-ml-py's own function in tests/gpu."""

from __future__ import annotations

import types
from typing import Any

import pynvml
import pytest

from gpuwatchd.sources.nvml_compute import SPARE, ComputeProcesses

NA = (1 << 64) - 1


class FakeDriver:
    """What the driver does for one GPU holding ``procs`` ((pid, used memory) pairs)."""

    def __init__(self, procs: list[tuple[int, int]], ret: int = pynvml.NVML_SUCCESS) -> None:
        self.procs = procs
        self.ret = ret
        self.calls: list[int] = []  # the buffer size of each call

    def __call__(self, handle: Any, count_ref: Any, buf: Any) -> int:
        count = count_ref._obj
        self.calls.append(count.value)
        if self.ret != pynvml.NVML_SUCCESS:
            return self.ret
        if count.value < len(self.procs):
            count.value = len(self.procs)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, mem) in enumerate(self.procs):
            buf[i].pid, buf[i].usedGpuMemory = pid, mem
        count.value = len(self.procs)
        return pynvml.NVML_SUCCESS


def lib(driver: FakeDriver | None) -> Any:
    """pynvml as the daemon sees it, its function pointer lookup answered by ``driver``."""

    def pointer(name: str) -> Any:
        assert name == "nvmlDeviceGetComputeRunningProcesses_v3"
        if driver is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return driver

    ns = {k: getattr(pynvml, k) for k in dir(pynvml) if not k.startswith("__")}
    ns["_nvmlGetFunctionPointer"] = pointer
    ns["nvmlDeviceGetComputeRunningProcesses"] = lambda h: [types.SimpleNamespace(pid=1, usedGpuMemory=2)]
    return types.SimpleNamespace(**ns)


def test_one_call_per_cycle_once_the_buffer_fits_and_it_follows_the_count() -> None:
    procs = [(1000 + i, (i + 1) << 30) for i in range(64)]
    driver = FakeDriver(procs)
    cp = ComputeProcesses(lib(driver))
    assert cp.available
    got = cp(0, object())
    assert [(p.pid, p.usedGpuMemory) for p in got] == procs
    assert driver.calls == [SPARE, 2 * 64 + SPARE]  # too small once, then the size it said
    for _ in range(3):
        assert [(p.pid, p.usedGpuMemory) for p in cp(0, object())] == procs
    assert len(driver.calls) == 5  # then one call per read
    driver.procs = procs[:3]  # most of them ended: the buffer shrinks, still one call
    assert [p.pid for p in cp(0, object())] == [1000, 1001, 1002]
    assert [p.pid for p in cp(0, object())] == [1000, 1001, 1002]
    assert driver.calls[-1] == 2 * 3 + SPARE and len(driver.calls) == 7
    driver.procs = []
    assert cp(0, object()) == []
    assert cp(1, object()) == [] and driver.calls[-1] == SPARE  # each GPU its own buffer


def test_not_available_memory_is_none_and_an_error_is_nvmls() -> None:
    driver = FakeDriver([(7, NA), (8, 5)])
    cp = ComputeProcesses(lib(driver))
    assert [(p.pid, p.usedGpuMemory) for p in cp(0, object())] == [(7, None), (8, 5)]
    driver.ret = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(pynvml.NVMLError) as e:
        cp(0, object())
    assert e.value.value == pynvml.NVML_ERROR_GPU_IS_LOST


def test_a_driver_without_the_v3_call_falls_back_to_the_library() -> None:
    cp = ComputeProcesses(lib(None))
    assert cp.available
    assert [(p.pid, p.usedGpuMemory) for p in cp(0, object())] == [(1, 2)]
    assert not cp.available  # the caller uses the public function from now on
    assert not ComputeProcesses(types.SimpleNamespace()).available  # a recorded double
