"""A GPU that fell off the bus, reported by the driver without an Xid number, as an Xid 79 event.

Drivers 570 and later print ``NVRM: The NVIDIA GPU 0000:b3:00.0 ... has fallen off the bus and is
not responding to commands`` (probe time) or ``NVRM: GPU 0000:3b:00.0: GPU has fallen off the
bus.`` (beside an ``NVRM: Xid ... 79`` line) with no Xid number (NVIDIA/NVSentinel#155). Xid 79
means exactly this ("GPU has fallen off the bus", NVIDIA Xid catalog), so the message becomes an
``xid`` event with ``xid`` 79: counted in ``gpuwatch_gpu_xid_errors_total{xid="79"}``, raising
``xid_critical`` and ``GPUXidCritical`` like the numbered line. One loss is counted once: a no-Xid
message within ``window`` seconds of a report of the same GPU, or an Xid 79 line within ``window``
of a counted no-Xid message, is stored but not counted again.

Pure and bounded: at most ``MAX_GPUS`` addresses remembered, each for ``window`` seconds.
"""

from __future__ import annotations

MAX_GPUS = 64


class BusLostDedup:
    """Not thread-safe: the kernel-event processor calls it under its lock."""

    def __init__(self, window: float = 30.0, name_window: float = 2.0) -> None:
        self.window = window
        self.name_window = name_window
        self._named: tuple[str, float] | None = None  # split records: the GPU line before the loss
        self._reports: dict[str, tuple[float, bool]] = {}  # pci -> (time, from a no-Xid message)

    def __len__(self) -> int:
        """GPU addresses remembered now (at most MAX_GPUS)."""
        return len(self._reports)

    def named(self, pci: str, at: float) -> None:
        self._named = (pci, at)

    def pci_for(self, pci: str, at: float) -> str:
        """The address of a loss message: its own, else the GPU the previous record named."""
        if pci:
            return pci
        if self._named is not None and 0 <= at - self._named[1] <= self.name_window:
            return self._named[0]
        return ""

    def count(self, pci: str, at: float, no_xid_message: bool) -> bool:
        """True when this report of a lost GPU is a new occurrence (count it)."""
        self._prune(at)
        last = self._reports.get(pci)
        if last is not None and (no_xid_message or last[1]):
            if not no_xid_message:  # the numbered line absorbed the message: the next one counts
                self._reports[pci] = (at, False)
            return False
        if len(self._reports) < MAX_GPUS or pci in self._reports:
            self._reports[pci] = (at, no_xid_message)
        return True

    def _prune(self, now: float) -> None:
        for k in [k for k, (t, _) in self._reports.items() if abs(now - t) > self.window]:
            del self._reports[k]
