"""NVML Xid critical-error events: one thread blocked in ``nvmlEventSetWait``; each event is
recorded into the join's Xid de-duplicator (``XidRecorder``, join/xid_dedup.py) and, when it is
new, counted as ``gpu_xid_errors``.

Cost: one blocked thread, nothing per cycle. An event ends a wait at once; a wait that times out
is an ``NVMLError`` raised and caught in Python, which is the watcher's only cost, so the waits are
5 s long (1 s before: 0.02 % of a core on the H200). The daemon's ``stop`` waits at most 0.5 s for
the thread, which ends by itself at the end of its wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from gpuwatchd.model import SOURCE_NVML
from gpuwatchd.sources.nvml import NVML_ERROR_TIMEOUT, decode_text, load_pynvml, nvml_error_code
from gpuwatchd.sources.watcher import WatcherThread
from gpuwatchd.units import normalize_pci_bus_id

log = logging.getLogger(__name__)


class XidRecorder(Protocol):
    """Where the Xid watcher records what it saw (``join.xid_dedup.XidDeduper``): a source only
    reports; the de-duplication against the kernel log lives in the join."""

    def learn_device(self, pci_bus_id: str, uuid: str, index: int) -> None: ...

    def record(self, gpu_key: str, xid: int, at: float, source: str) -> bool: ...


class XidEventWatcher(WatcherThread):
    """Streams NVML Xid critical-error events into the ``gpu_xid_errors`` counter.

    One thread blocks in ``nvmlEventSetWait`` (``wait_ms``, 5 s). Each event
    goes through the shared ``XidDeduper`` so that the same Xid also logged by the kernel
    (``NVRM: Xid (PCI:0000:3b:00): 79, ...``) counts once. ``inc`` is ``CounterStore.inc``.
    """

    thread_name = "gpuwatchd-xid"

    def __init__(
        self,
        inc: Callable[[str, tuple[str, ...]], None],
        deduper: XidRecorder,
        pynvml: Any = None,
        clock: Callable[[], float] = time.time,
        wait_ms: int = 5000,
    ) -> None:
        super().__init__()
        self._inc = inc
        self._dedup = deduper
        self._nvml = pynvml
        self._clock = clock
        self._wait_ms = wait_ms
        self.events_seen = 0

    def start(self) -> None:
        self._start_thread()

    def _run(self) -> None:
        nv = self._nvml if self._nvml is not None else load_pynvml()
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            self.error = f"NVML not available for Xid events: {exc}"
            return
        try:
            event_set = self.register_xid_events(nv)
            if event_set is None:
                return
            try:
                while not self._stop.is_set():
                    self.poll_once(nv, event_set)
            finally:
                nv.nvmlEventSetFree(event_set)
        except nv.NVMLError as exc:
            self.error = f"Xid event wait failed: {exc}"
        finally:
            nv.nvmlShutdown()

    def register_xid_events(self, nv: Any) -> Any:
        event_set = nv.nvmlEventSetCreate()
        registered = 0
        for index in range(int(nv.nvmlDeviceGetCount())):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except nv.NVMLError as exc:  # NOT_SUPPORTED inside some VMs, or a lost GPU
                log.info("GPU %d: no Xid events: %s", index, exc)
        if not registered:
            self.error = "no GPU supports Xid events"
            nv.nvmlEventSetFree(event_set)
            return None
        return event_set

    def poll_once(self, nv: Any, event_set: Any) -> bool:
        """Wait up to wait_ms for one event; True when one was counted."""
        try:
            data = nv.nvmlEventSetWait_v2(event_set, self._wait_ms)
        except nv.NVMLError as exc:
            if nvml_error_code(exc) == NVML_ERROR_TIMEOUT:
                return False
            raise
        if int(data.eventType) != int(nv.nvmlEventTypeXidCriticalError):
            return False
        self.events_seen += 1
        xid = int(data.eventData)
        uuid = decode_text(nv.nvmlDeviceGetUUID(data.device))
        index = int(nv.nvmlDeviceGetIndex(data.device))
        bus = decode_text(nv.nvmlDeviceGetPciInfo(data.device).busId)
        self._dedup.learn_device(bus, uuid, index)
        if self._dedup.record(normalize_pci_bus_id(bus), xid, self._clock(), SOURCE_NVML):
            self._inc("gpu_xid_errors", (str(index), uuid, str(xid)))
            return True
        return False
