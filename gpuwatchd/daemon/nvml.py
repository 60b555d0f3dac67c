"""The daemon's NVML part: NVML collector, orphans, fork evidence, CUDA OOM events, Xid, udev.

Wires the GPU sources into the daemon's cycle; every collaborator is built in the constructor,
``start`` starts the two threads:

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

Returns ``gpus``, ``holders`` (NVML's processes per GPU), ``orphans``, ``other_processes`` (GPU
PIDs outside the rank trees), ``fork_evidence``, ``orphan_jobs``, ``gpus_removed``, ``gpus_lost``
and ``cuda_ooms`` (a ``GpuOutput``, model/parts.py) for the stall part's GPU readings, the join
and the rules. The track stage hands it the last cycle's state, the co-tenants a CUDA OOM is
attributed among. The /proc reads of GPU PIDs, the devfds evidence and the CUDA-OOM
event files each run under ``guarded``: one that fails loses its own reading this cycle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from gpuwatchd.config.schema import Config
from gpuwatchd.daemon.device_policy import EXIT_REEXPAND, DevicePolicyGuard
from gpuwatchd.daemon.fork_evidence import fork_evidence
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.isolation import Collector, guarded
from gpuwatchd.join.cuda_oom import OomTracker, claimants
from gpuwatchd.join.orphans import OrphanTracker
from gpuwatchd.model import GpuDevice, GpuProcess, GpuUevent, NodeState, ProcessInfo, ProcEvidence
from gpuwatchd.model.cuda_oom import OomEvent
from gpuwatchd.model.parts import GpuOutput, GpuRemoved, NvmlLostGpu
from gpuwatchd.sources.cuda_oom_events import OomEventFiles
from gpuwatchd.sources.devfds import EvidenceReader
from gpuwatchd.sources.nvidia_devices import DeviceProbe, probe
from gpuwatchd.sources.nvml import NvmlReadError, NvmlSource
from gpuwatchd.sources.nvml_events import XidEventWatcher
from gpuwatchd.sources.nvml_fixture import open_nvml_source
from gpuwatchd.sources.udev import UdevWatcher
from gpuwatchd.units import normalize_pci_bus_id

log = logging.getLogger(__name__)

Reading = tuple[tuple[GpuDevice, ...], tuple[GpuProcess, ...]]


class NvmlSubsystem(Subsystem):
    name = "nvml"

    def __init__(
        self,
        config: Config,
        services: Services,
        *,
        source: NvmlSource | None = None,
        watch_xid: bool = True,
        watch_udev: bool = True,
        guard: DevicePolicyGuard | None = None,
        udev_monitor: Any = None,
    ) -> None:
        """Every collaborator built here, nothing started (``start`` starts the Xid and udev
        threads). ``source``: the NVML reader (default: the driver, or ``nvml.fixture``'s
        recording); ``guard``: the device-cgroup diagnosis (default: the host's; with a fixture,
        one that finds no device node: a recording has none to deny); ``udev_monitor``: the
        pyudev ``Monitor`` the udev thread listens on (None: the kernel's netlink; tests hand it
        recorded uevents, there being no GPU here to unplug)."""
        cfg = config.nvml
        paths = services.paths
        self.source = source or open_nvml_source(cfg.fixture)
        probe_fn = (lambda: DeviceProbe((), {})) if cfg.fixture else (lambda: probe(paths.dev(), paths.proc("devices")))
        self.guard = guard or DevicePolicyGuard(config.state_dir, services.boot_id, probe_fn=probe_fn)
        timeout = cfg.timeout_seconds
        self.collector: Collector[Reading] = Collector(
            "nvml", self._read, timeout, 3 * config.interval_seconds + timeout, services.clock
        )
        self.tracker = OrphanTracker(config.orphans.grace_seconds)
        self.oom = OomTracker(services.clock)
        self.oom_files = OomEventFiles(config.rank_dir, config.state_dir)
        self.evidence = EvidenceReader(paths)
        self.dedup = services.xid_dedup  # shared with the kernel log (daemon/services.py)
        # the Xid event thread reads the source's library (the replay when reading a fixture)
        self.xid = (XidEventWatcher(services.counters.inc, self.dedup, pynvml=self.source.library,
                                    clock=services.clock) if watch_xid else None)  # fmt: skip
        self.udev = (UdevWatcher(self._on_uevent, monitor=udev_monitor, clock=services.clock)
                     if watch_udev and not cfg.fixture else None)  # fmt: skip
        # PCI address -> its remove/unbind, from the udev thread until an add/bind of it
        self._removed: dict[str, GpuRemoved] = {}
        self._lock = threading.Lock()
        self._devices: tuple[GpuDevice, ...] = ()
        self._known: dict[int, GpuDevice] = {}  # last good reading of each GPU index

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, daemon: DaemonContext) -> None:
        for thread in (self.xid, self.udev):
            if thread is not None:
                thread.start()

    def stop(self) -> None:
        self.collector.close()
        if self.xid is not None:
            self.xid.stop(timeout=0.5)  # in a wait of up to 5 s: it ends by itself after
        if self.udev is not None:
            self.udev.stop()
        self.source.close()

    def _on_uevent(self, ev: GpuUevent) -> None:
        gpu = next((d for d in self._devices if normalize_pci_bus_id(d.pci_bus_id) == ev.pci_bus_id), None)
        with self._lock:
            if ev.lost:
                self._removed[ev.pci_bus_id] = GpuRemoved(ev, str(gpu.index) if gpu else "", gpu.uuid if gpu else "")
            else:
                self._removed.pop(ev.pci_bus_id, None)
        self.source.reinit()

    # -- one cycle ----------------------------------------------------------------------------
    def _read(self) -> Reading:
        """NVML's reading; when it fails and /dev/nvidia* is denied, an error that says why."""
        try:
            return self.source.read()
        except Exception as exc:
            why = self.guard.diagnose()
            if why:
                raise NvmlDeviceDenied(f"{why} (NVML: {exc})") from exc
            raise

    def track(self, daemon: DaemonContext, ranks: Ranks, last: NodeState | None) -> GpuOutput:
        """``last``: the previous cycle's state (the co-tenants a CUDA OOM is attributed among:
        the GPU memory as it was when the error was raised, before this reading)."""
        reading = self.collector.run()
        if reading is None:
            why = self.guard.restart_reason()
            if why:
                daemon.request_exit(EXIT_REEXPAND, why)
        devices, procs = reading if reading is not None else ((), ())
        self._devices = devices
        self._known.update((d.index, d) for d in devices)
        lost_now = tuple(NvmlLostGpu(i, self._known.get(i), daemon.clock()) for i in sorted(self.source.lost_devices))
        self.dedup.learn_devices(devices)
        processes: dict[int, ProcessInfo] = dict(ranks.processes)
        missing = sorted({p.pid for p in procs} - set(processes))
        procfs = daemon.procfs
        no_procs: Mapping[int, ProcessInfo] = {}
        extra = (
            guarded("nvml: /proc of GPU processes", lambda: procfs.read_many(missing), no_procs)
            if missing
            else no_procs
        )
        processes.update(extra)
        entries = ranks.entries
        descendants = ranks.descendants
        now = ranks.now
        orphans = self.tracker.update(procs, processes, ranks.trees, now)
        orphan_jobs = {}
        for o in orphans:
            p = processes.get(o.pid)
            job = self.tracker.past_job(o.pid, p.start_ticks if p else None)
            if job:
                orphan_jobs[o.pid] = job
        gpu_pids = {p.pid for p in procs}
        reader = self.evidence
        no_evidence: dict[int, ProcEvidence] = {}
        evidence = guarded(
            "nvml: devfds evidence",
            lambda: fork_evidence(reader, entries, processes, descendants, gpu_pids if reading is not None else None),
            no_evidence,
        )
        no_events: list[OomEvent] = []
        ooms = self.oom.observe(
            guarded("nvml: CUDA OOM event files", self.oom_files.read, no_events),
            daemon.counters.inc,
            last,
            {o.pid: o.reason for o in orphans},
            {pid: p.comm for pid, p in processes.items()},
            claimants(entries, processes),
        )
        with self._lock:
            removed = tuple(self._removed.values())
        return GpuOutput(
            status=self.collector.status,
            gpus=tuple(devices),
            holders=tuple(procs),
            orphans=tuple(orphans),
            other_processes=extra,
            fork_evidence=evidence,
            orphan_jobs=orphan_jobs,
            gpus_removed=removed,
            gpus_lost=lost_now,
            cuda_ooms=tuple(ooms),
        )


class NvmlDeviceDenied(NvmlReadError):
    """NVML failed and the device cgroup denies /dev/nvidia* (the message says which and why)."""
