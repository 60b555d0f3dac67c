"""udev: NVIDIA GPUs that fall off the bus (or come back), seen at once.

Listens to kernel uevents (pyudev netlink monitor, ``source="kernel"``: works without a udev daemon,
as in containers) for subsystem ``pci`` with vendor 10DE and a display/3D class (``PCI_CLASS``
03xxxx). Each one is reported at once, as a ``GpuUevent`` (action, PCI address, driver, time),
through a callback: the daemon's NVML subsystem keeps a ``remove``/``unbind`` for the gpu_lost rule
(findings/gpu_lost.py) of the next cycle, without waiting for NVML to notice, and has the NVML
source re-initialise on any add/remove/bind/unbind, since NVML's device list is fixed at
``nvmlInit``. The source builds no finding.

Cost: one blocking ``poll`` on the netlink socket and a self-pipe that ``stop()`` writes: no
wake-up while no uevent arrives.
Privilege: reading kernel uevents needs no privilege. Shell equivalent: ``udevadm monitor --kernel
--subsystem-match=pci``; ``cat /sys/bus/pci/devices/*/uevent``.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuwatchd.model import GpuUevent
from gpuwatchd.sources.kmsg import Stopper
from gpuwatchd.sources.watcher import WatcherThread
from gpuwatchd.units import normalize_pci_bus_id

log = logging.getLogger(__name__)

NVIDIA_VENDOR = "10DE"
CHANGE_ACTIONS = frozenset({"add", "remove", "bind", "unbind"})


def parse_uevent_file(text: str) -> dict[str, str]:
    """``/sys/bus/pci/devices/X/uevent`` (KEY=VALUE lines) -> properties."""
    props: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key.strip()] = value.strip()
    return props


def classify(action: str, props: Mapping[str, str], now: float, vendor: str = NVIDIA_VENDOR) -> GpuUevent | None:
    """A GPU uevent, or None for every other device/action."""
    if action not in CHANGE_ACTIONS:
        return None
    pci_id = props.get("PCI_ID", "")
    if not pci_id.upper().startswith(vendor.upper() + ":"):
        return None
    if not props.get("PCI_CLASS", "").startswith("3"):  # 03xxxx: display / 3D controller
        return None
    slot = props.get("PCI_SLOT_NAME", "")
    return GpuUevent(action, normalize_pci_bus_id(slot), slot, props.get("DRIVER", ""), now)


class UdevWatcher(WatcherThread):
    """Thread that turns GPU uevents into callbacks. ``monitor`` is a pyudev Monitor (a
    constructor argument so tests can pass one filtered differently)."""

    thread_name = "gpuwatchd-udev"

    def __init__(
        self,
        on_event: Callable[[GpuUevent], None],
        monitor: Any = None,
        vendor: str = NVIDIA_VENDOR,
        clock: Callable[[], float] = time.time,
        poll_seconds: float | None = None,
    ) -> None:
        super().__init__()
        self.on_event = on_event
        self.monitor = monitor
        self.vendor = vendor
        self.clock = clock
        self.poll_seconds = poll_seconds  # None: sleep until a uevent or stop()
        self._stopper: Stopper | None = None

    def open(self) -> None:
        if self.monitor is None:
            try:
                import pyudev
            except ImportError as exc:
                self.error = f"pyudev not installed: {exc}"
                return
            try:
                context = pyudev.Context()
                self.monitor = pyudev.Monitor.from_netlink(context, source="kernel")
                self.monitor.filter_by("pci")
            except (OSError, ImportError) as exc:  # libudev missing, netlink refused
                self.error = f"udev monitor unavailable: {exc}"
                self.monitor = None
                return
        self.monitor.start()

    def start(self) -> None:
        self.open()
        if self.monitor is None:
            log.info("udev: %s", self.error)
            return
        self._stopper = Stopper()
        self._start_thread()

    def stop(self, timeout: float = 3.0) -> None:
        stopper = self._stopper
        if stopper is not None:
            stopper.stop()
        super().stop(timeout)
        if stopper is not None and not self.running:
            stopper.close()  # here, not in the thread: no write can reach a reused fd
            self._stopper = None

    def _run(self) -> None:
        assert self._stopper is not None
        poller = select.poll()
        poller.register(self.monitor.fileno(), select.POLLIN)
        poller.register(self._stopper.fd, select.POLLIN)
        wait_ms = None if self.poll_seconds is None else int(self.poll_seconds * 1000)
        while not self._stop.is_set():
            try:
                poller.poll(wait_ms)
                device = self.monitor.poll(timeout=0)  # what is queued, without blocking
                while device is not None and not self._stop.is_set():
                    self.handle(device.action or "", dict(device.properties))
                    device = self.monitor.poll(timeout=0)
            except OSError as exc:
                self.error = f"udev poll failed: {exc}"
                return

    def handle(self, action: str, props: Mapping[str, str]) -> GpuUevent | None:
        ev = classify(action, props, self.clock(), self.vendor)
        if ev is not None:
            log.warning("udev: GPU %s %s", ev.slot, ev.action)
            self.on_event(ev)
        return ev
