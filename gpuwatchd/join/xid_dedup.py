"""One Xid, counted once: de-duplication between NVML Xid events and kernel ``NVRM: Xid`` lines.

The driver reports a critical Xid twice: as an NVML event (``nvmlEventTypeXidCriticalError``,
sources/nvml.py) and as a kernel log line ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...``
(sources/kernel_log.py). Both feed ``gpuwatch_gpu_xid_errors_total``. The two sides name the GPU
differently (NVML: UUID and bus id "00000000:3B:00.0"; kernel: "PCI:0000:3b:00"), so the key is the
normalised PCI address ``"0000:3b:00"`` (domain:bus:device, lower case, function dropped).

Rule: an event from one source that finds an *unmatched* event with the same (GPU, Xid) from the
*other* source within ``window_seconds`` is the same occurrence -> not counted again (each event
absorbs at most one of the other side). Two events from the same source are always two
occurrences. Thread-safe; memory bounded by pruning entries older than the window.

Kernel-log side usage::

    dedup = XidDeduper()            # one instance shared with the NVML watcher (daemon wires it)
    key = normalize_pci_bus_id("PCI:0000:3b:00")
    if dedup.record(key, 79, line_timestamp, SOURCE_KERNEL):
        gpu, uuid = dedup.labels_for(key)
        counters.inc("gpu_xid_errors", (gpu, uuid, "79"))
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from gpuwatchd.model import GpuDevice
from gpuwatchd.units import normalize_pci_bus_id

__all__ = ["XidDeduper"]

DEFAULT_WINDOW_SECONDS = 30.0


class XidDeduper:
    def __init__(self, window_seconds: float = DEFAULT_WINDOW_SECONDS) -> None:
        self.window = window_seconds
        self._lock = threading.Lock()
        # (gpu key, xid, source) -> timestamps of events not yet matched by the other source
        self._pending: dict[tuple[str, int, str], deque[float]] = {}
        # gpu key -> (index, uuid) for counter labels
        self._devices: dict[str, tuple[str, str]] = {}

    def learn_device(self, pci_bus_id: str, uuid: str, index: int) -> None:
        with self._lock:
            self._devices[normalize_pci_bus_id(pci_bus_id)] = (str(index), uuid)

    def learn_devices(self, devices: Iterable[GpuDevice]) -> None:
        for d in devices:
            self.learn_device(d.pci_bus_id, d.uuid, d.index)

    def labels_for(self, gpu_key: str) -> tuple[str, str]:
        """(gpu index, uuid) for counter labels; ("", "") while the GPU is unknown."""
        with self._lock:
            return self._devices.get(normalize_pci_bus_id(gpu_key), ("", ""))

    def record(self, gpu_key: str, xid: int, at: float, source: str) -> bool:
        """True when this is a new occurrence (count it), False when it duplicates the other
        source's report of the same Xid."""
        key = normalize_pci_bus_id(gpu_key)
        with self._lock:
            self._prune(at)
            for other_key, stamps in self._pending.items():
                if other_key[0] != key or other_key[1] != xid or other_key[2] == source:
                    continue
                for i, t in enumerate(stamps):
                    if abs(t - at) <= self.window:
                        del stamps[i]
                        return False
            self._pending.setdefault((key, xid, source), deque()).append(at)
            return True

    def _prune(self, now: float) -> None:
        empty = []
        for k, stamps in self._pending.items():
            while stamps and now - stamps[0] > self.window:
                stamps.popleft()
            if not stamps:
                empty.append(k)
        for k in empty:
            del self._pending[k]
