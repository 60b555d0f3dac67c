"""Replay of NVML readings recorded on a real GPU node (``tools/record_nvml.py``).

``RecordedNvml`` answers the subset of the nvidia-ml-py API that ``NvmlSource`` and
``XidEventWatcher`` call, from a JSON recording, so the *real* reader code (N/A handling, per-GPU
error isolation, utilisation) runs unchanged where no GPU exists: CI, demos, and the daemon when
config ``nvml.fixture`` is set. Each ``nvmlDeviceGetCount()`` starts the next recorded cycle (one
per ``NvmlSource.read()``); after the last cycle the replay starts again (``loop=True``) or stays
on the last one.

Reads: one JSON file at construction. Cost: none per cycle. Privilege: none.
Recording format: see tests/fixtures/nvml/README.md. An ``{"error": CODE}`` in place of any value
raises ``NVMLError(CODE)`` from that call, which is how "NVML raising mid-cycle" and "GPU lost" are
replayed; a document ``{"not_present": true}`` behaves like a host without the driver.
Shell equivalent: ``python3 tools/record_nvml.py --out FILE`` on the GPU node that recorded it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from gpuwatchd.sources.nvml import (
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_TIMEOUT,
    NvmlSource,
)

FORMAT = "gpuwatchd-nvml-recording/1"
XID_CRITICAL_ERROR = 0x0000000000000008  # nvmlEventTypeXidCriticalError (nvml.h)


class NVMLError(Exception):
    """Same shape as ``pynvml.NVMLError``: the NVML return code is ``.value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _raise_if_error(value: Any) -> Any:
    if isinstance(value, Mapping) and "error" in value:
        raise NVMLError(int(value["error"]))
    return value


class RecordedNvml:
    """A stand-in for the ``pynvml`` module, replaying one recording."""

    NVMLError = NVMLError
    nvmlEventTypeXidCriticalError = XID_CRITICAL_ERROR

    def __init__(
        self,
        doc: Mapping[str, Any],
        pid_map: Mapping[int, int] | None = None,
        loop: bool = True,
    ) -> None:
        self.doc = doc
        self.cycles: list[Mapping[str, Any]] = list(doc.get("cycles", []))
        self.pid_map = dict(pid_map or {})
        self.loop = loop
        self.position = -1  # index of the cycle being replayed
        self.initialised = False
        self.init_calls = 0
        self._xid_queue: list[Mapping[str, Any]] = list(doc.get("xid_events", []))

    @classmethod
    def from_file(cls, path: str, pid_map: Mapping[int, int] | None = None, loop: bool = True) -> RecordedNvml:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or (doc.get("format") != FORMAT and not doc.get("not_present")):
            raise ValueError(f"{path}: not a {FORMAT} document")
        return cls(doc, pid_map=pid_map, loop=loop)

    # -- library life cycle -------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.doc.get("not_present"):
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        _raise_if_error(self.doc.get("init", {}))
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self.doc.get("driver_version", ""))

    # -- devices ------------------------------------------------------------------------------
    def _cycle(self) -> Mapping[str, Any]:
        if not self.cycles:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self.cycles[max(self.position, 0)]

    def _device(self, handle: int) -> Mapping[str, Any]:
        dev = self._cycle()["devices"][handle]
        _raise_if_error(dev.get("handle", {}))
        return dev

    def nvmlDeviceGetCount(self) -> int:
        if not self.cycles:
            return 0
        if self.position + 1 < len(self.cycles):
            self.position += 1
        elif self.loop:
            self.position = 0
        return int(_raise_if_error(self._cycle().get("count", len(self._cycle()["devices"]))))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._device(index)
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(_raise_if_error(self._device(handle)["uuid"]))

    def nvmlDeviceGetName(self, handle: int) -> str:
        return str(_raise_if_error(self._device(handle)["name"]))

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=str(_raise_if_error(self._device(handle)["busId"])))

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        mem = _raise_if_error(self._device(handle)["memory"])
        return SimpleNamespace(**mem)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(**_raise_if_error(self._device(handle)["utilization"]))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        # recordings made before this field was recorded: what a driver without it answers
        return int(_raise_if_error(self._device(handle).get("clocks_event_reasons", {"error": 3})))  # NOT_SUPPORTED

    def _procs(self, handle: int, kind: str) -> list[SimpleNamespace]:
        listed = _raise_if_error(self._device(handle).get(kind, []))
        return [
            SimpleNamespace(pid=self.pid_map.get(int(p["pid"]), int(p["pid"])), usedGpuMemory=p.get("usedGpuMemory"))
            for p in listed
        ]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return self._procs(handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return self._procs(handle, "graphics")

    def nvmlDeviceGetProcessUtilization(self, handle: int, since: int) -> list[SimpleNamespace]:
        samples = _raise_if_error(self._device(handle).get("process_utilization", []))
        out = [
            SimpleNamespace(**{**s, "pid": self.pid_map.get(int(s["pid"]), int(s["pid"]))})
            for s in samples
            if int(s["timeStamp"]) > since
        ]
        if not out:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return out

    # -- Xid events: the recording's "xid_events" list, then time-outs ------------------------
    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: object) -> None:
        _raise_if_error(self._device(handle).get("events", {}))

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        if not self._xid_queue:
            # NVML blocks up to timeout_ms; a replay that returned at once made the Xid watcher
            # spin (13 % of a core). Capped so that the watcher still stops within 0.1 s.
            time.sleep(min(max(timeout_ms, 0), 100) / 1000)
            raise NVMLError(NVML_ERROR_TIMEOUT)
        ev = self._xid_queue.pop(0)
        return SimpleNamespace(device=int(ev["device"]), eventType=XID_CRITICAL_ERROR, eventData=int(ev["xid"]))

    def nvmlEventSetFree(self, event_set: object) -> None:
        return None


def fixture_source(path: str, pid_map: Mapping[int, int] | None = None) -> NvmlSource:
    """The daemon's NVML collector when config ``nvml.fixture`` is set."""
    return NvmlSource(pynvml=RecordedNvml.from_file(path, pid_map=pid_map))


def open_nvml_source(fixture: str | None) -> NvmlSource:
    """The daemon's factory: the real driver, or the recording named by ``nvml.fixture``."""
    return fixture_source(fixture) if fixture else NvmlSource()
