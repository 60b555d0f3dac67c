"""The daemon's NVML part: NVML collector, orphans, fork evidence, CUDA OOM events, Xid, udev.

Wires the GPU sources into the daemon's cycle (duck-typed ``daemon.Subsystem``):

- ``track``: one NVML reading through the isolation wrapper (collector ``nvml``, time-out
  ``nvml.timeout_seconds``; a hung driver call never blocks the cycle or a scrape); /proc identity
  of each GPU process outside the rank trees; the orphan tracker (``orphans.grace_seconds``);
  fork evidence for the processes of ranks that hold a CUDA context; CUDA OOM event files from the
  ranks' hook (counted, attributed and kept for the ``cuda_oom`` rule, findings/cuda_oom.py); the
  GPUs udev saw removed and those NVML reports lost, for the ``gpu_lost`` rule
  (findings/gpu_lost.py).
- when NVML fails: why /dev/nvidia* cannot be opened (``device_policy``: the device cgroup denies
  them, e.g. DeviceAllow=char-nvidia* expanded before the driver loaded) as the collector's error,
  and, when a restart would fix that, the daemon exits for systemd to restart it (once per boot).
- streaming: the NVML Xid event thread (``gpu_xid_errors``, de-duplicated against the kernel log
  through the daemon's shared ``XidDeduper``) and the udev thread.

Returns ``gpus``, ``gpu_processes``, ``orphans``, ``processes`` (GPU PIDs outside the rank trees),
``fork_evidence``, ``orphan_jobs``, ``gpus_removed``, ``gpus_lost`` and ``cuda_ooms`` (a
``GpuOutput``) for the join. The /proc reads of GPU PIDs, the devfds evidence and the CUDA-OOM
event files each run under ``guarded``: one that fails loses its own reading this cycle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from gpuwatchd.daemon.device_policy import EXIT_REEXPAND, DevicePolicyGuard
from gpuwatchd.daemon.fork_evidence import fork_evidence
from gpuwatchd.daemon.subsystem import DaemonContext, GpuOutput, Ranks, Subsystem
from gpuwatchd.findings.context import GpuRemoved, NvmlLostGpu
from gpuwatchd.isolation import Collector, guarded
from gpuwatchd.join.cuda_oom import OomTracker, claimants
from gpuwatchd.join.orphans import OrphanTracker, trees_from_entries
from gpuwatchd.model import GpuDevice, GpuProcess, GpuUevent, NodeState, OomEvent, ProcessInfo, ProcEvidence
from gpuwatchd.sources.cuda_oom_events import OomEventFiles
from gpuwatchd.sources.devfds import EvidenceReader
from gpuwatchd.sources.kmsg import read_boot_id
from gpuwatchd.sources.nvidia_devices import probe
from gpuwatchd.sources.nvml import NvmlReadError, NvmlSource
from gpuwatchd.sources.nvml_events import XidEventWatcher
from gpuwatchd.sources.nvml_fixture import open_nvml_source
from gpuwatchd.sources.udev import UdevWatcher
from gpuwatchd.units import normalize_pci_bus_id

log = logging.getLogger(__name__)

Reading = tuple[tuple[GpuDevice, ...], tuple[GpuProcess, ...]]


class NvmlSubsystem(Subsystem):
    name = "nvml"

    def __init__(self, source: NvmlSource | None = None, watch_xid: bool = True,
                 watch_udev: bool = True, guard: DevicePolicyGuard | None = None,
                 udev_monitor: Any = None) -> None:
        """``udev_monitor``: the pyudev ``Monitor`` the udev thread listens on (None: the kernel's
        netlink; tests hand it recorded uevents, there being no GPU here to unplug)."""
        self.source = source
        self.udev_monitor = udev_monitor
        self.guard = guard
        self.watch_xid = watch_xid
        self.watch_udev = watch_udev
        self.collector: Collector[Reading] | None = None
        self.tracker: OrphanTracker | None = None
        self.oom: OomTracker | None = None
        self.evidence: EvidenceReader | None = None
        self.xid: XidEventWatcher | None = None
        self.udev: UdevWatcher | None = None
        # PCI address -> its remove/unbind, from the udev thread until an add/bind of it
        self._removed: dict[str, GpuRemoved] = {}
        self._lock = threading.Lock()
        self._devices: tuple[GpuDevice, ...] = ()
        self._known: dict[int, GpuDevice] = {}  # last good reading of each GPU index
        self._last_state: NodeState | None = None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, daemon: DaemonContext) -> None:
        cfg = daemon.config
        if self.source is None:
            self.source = open_nvml_source(cfg.nvml.fixture)
        timeout = cfg.nvml.timeout_seconds
        interval = cfg.interval_seconds
        if self.guard is None and not cfg.nvml.fixture:
            paths = daemon.paths
            self.guard = DevicePolicyGuard(
                cfg.state_dir, read_boot_id(paths),
                probe_fn=lambda: probe(paths.dev(), paths.proc("devices")))
        self.collector = Collector("nvml", self._read, timeout,
                                   3 * interval + timeout, daemon.clock)
        self.tracker = OrphanTracker(cfg.orphans.grace_seconds)
        self.oom = OomTracker(daemon.clock)
        self.oom_files = OomEventFiles(cfg.rank_dir, cfg.state_dir)
        self.evidence = EvidenceReader(daemon.paths)
        dedup = daemon.services.xid_dedup
        self.dedup = dedup
        if self.watch_xid:
            lib = self.source.library  # the replay when reading a fixture
            self.xid = XidEventWatcher(daemon.counters.inc, dedup, pynvml=lib, clock=daemon.clock)
            self.xid.start()
        if self.watch_udev and not cfg.nvml.fixture:
            self.udev = UdevWatcher(self._on_uevent, monitor=self.udev_monitor, clock=daemon.clock)
            self.udev.start()

    def stop(self) -> None:
        if self.collector is not None:
            self.collector.close()
        if self.xid is not None:
            self.xid.stop(timeout=0.5)  # in a wait of up to 5 s: it ends by itself after
        if self.udev is not None:
            self.udev.stop()
        if self.source is not None:
            self.source.close()

    def _on_uevent(self, ev: GpuUevent) -> None:
        gpu = next((d for d in self._devices
                    if normalize_pci_bus_id(d.pci_bus_id) == ev.pci_bus_id), None)
        with self._lock:
            if ev.lost:
                self._removed[ev.pci_bus_id] = GpuRemoved(
                    ev, str(gpu.index) if gpu else "", gpu.uuid if gpu else "")
            else:
                self._removed.pop(ev.pci_bus_id, None)
        if self.source is not None:
            self.source.reinit()

    # -- one cycle ----------------------------------------------------------------------------
    def _read(self) -> Reading:
        """NVML's reading; when it fails and /dev/nvidia* is denied, an error that says why."""
        assert self.source is not None
        try:
            return self.source.read()
        except Exception as exc:
            why = self.guard.diagnose() if self.guard is not None else ""
            if why:
                raise NvmlDeviceDenied(f"{why} (NVML: {exc})") from exc
            raise

    def track(self, daemon: DaemonContext, ranks: Ranks) -> GpuOutput:
        if (self.collector is None or self.tracker is None or self.oom is None
                or self.evidence is None):
            return GpuOutput()
        reading = self.collector.run()
        if reading is None and self.guard is not None:
            why = self.guard.restart_reason()
            if why:
                daemon.request_exit(EXIT_REEXPAND, why)
        devices, procs = reading if reading is not None else ((), ())
        self._devices = devices
        self._known.update((d.index, d) for d in devices)
        lost_now = tuple(NvmlLostGpu(i, self._known.get(i), daemon.clock())
                         for i in sorted(self.source.lost_devices if self.source else ()))
        self.dedup.learn_devices(devices)
        processes: dict[int, ProcessInfo] = dict(ranks.processes)
        missing = sorted({p.pid for p in procs} - set(processes))
        procfs = daemon.procfs
        no_procs: Mapping[int, ProcessInfo] = {}
        extra = (guarded("nvml: /proc of GPU processes", lambda: procfs.read_many(missing), no_procs)
                 if missing else no_procs)
        processes.update(extra)
        entries = ranks.entries
        descendants = ranks.descendants
        trees = trees_from_entries(entries, processes, descendants)
        now = ranks.now
        orphans = self.tracker.update(procs, processes, trees, now)
        orphan_jobs = {}
        for o in orphans:
            p = processes.get(o.pid)
            job = self.tracker.past_job(o.pid, p.start_ticks if p else None)
            if job:
                orphan_jobs[o.pid] = job
        gpu_pids = {p.pid for p in procs}
        reader = self.evidence
        no_evidence: dict[int, ProcEvidence] = {}
        evidence = guarded("nvml: devfds evidence", lambda: fork_evidence(
            reader, entries, processes, descendants, gpu_pids if reading is not None else None), no_evidence)
        no_events: list[OomEvent] = []
        ooms = self.oom.observe(guarded("nvml: CUDA OOM event files", self.oom_files.read, no_events),
                                daemon.counters.inc, self._last_state, {o.pid: o.reason for o in orphans},
                                {pid: p.comm for pid, p in processes.items()},
                                claimants(entries, processes))
        with self._lock:
            removed = tuple(self._removed.values())
        return GpuOutput(
            status=self.collector.status,
            gpus=tuple(devices),
            gpu_processes=tuple(procs),
            orphans=tuple(orphans),
            processes=extra,
            fork_evidence=evidence,
            orphan_jobs=orphan_jobs,
            gpus_removed=removed,
            gpus_lost=lost_now,
            cuda_ooms=tuple(ooms),
        )

    def after_join(self, daemon: DaemonContext, state: NodeState) -> None:
        self._last_state = state


class NvmlDeviceDenied(NvmlReadError):
    """NVML failed and the device cgroup denies /dev/nvidia* (the message says which and why)."""

