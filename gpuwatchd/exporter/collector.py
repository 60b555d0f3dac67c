"""NodeState -> fresh Prometheus metric families on every scrape (a custom collector on a private
registry; both from exporter/families.py, not prometheus_client, which imports ssl and its HTTP
servers). Nothing here keeps long-lived Gauge objects, so the series of a process that
died simply stop appearing (nvitop-exporter's stale-series bug cannot happen). A scrape reads the
latest immutable state plus a snapshot of the counters: it never calls NVML, /proc or py-spy.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping

from gpuwatchd import __version__
from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.exposition import Exposition
from gpuwatchd.exporter.families import CounterMetricFamily, GaugeMetricFamily, Metric, Registry
from gpuwatchd.exporter.memory import memory_families
from gpuwatchd.exporter.process import process_families
from gpuwatchd.exporter.render import Prefixes, openmetrics_parts, text_parts
from gpuwatchd.isolation import guarded
from gpuwatchd.model import COUNTER_LABELS, THROTTLE_REASONS, NodeState
from gpuwatchd.sources.containers import pod_uid

P = "gpuwatch_"

COUNTER_HELP: Mapping[str, str] = {
    "oom_kills": "Processes killed for lack of memory, by the kernel OOM killer or a userspace "
    "killer, attributed to the rank whose process tree they belonged to (job_id and rank empty "
    "when unattributed). Counted from the kernel log as the kill is logged.",
    "helper_oom_kills": 'gpuwatchd\'s own helper processes (helper="py-spy") killed for lack of '
    "memory: never counted in oom_kills, which counts the node's processes.",
    "rank_exits": "Rank processes that ended, by cause (exit_0, exit_nonzero, the terminating "
    "signal's name, signal_other, oom_kill, unknown), read from the exiting process the moment it "
    "ended; one rank_exit event each in gpuwatchd events.",
    "gpu_xid_errors": "NVIDIA Xid errors per GPU and Xid code, from the kernel log and NVML events.",
    "cuda_oom_errors": "CUDA out-of-memory errors reported by ranks through gpuwatchd's hook.",
    "rank_gil_samples": "py-spy sampling ticks taken of the rank process (sampled in the "
    "background every gil.interval_seconds).",
    "rank_gil_held_samples": "py-spy sampling ticks at which a thread of the rank held the GIL; "
    "held ratio = rate(held) / rate(samples).",
    "kernel_log_overruns": "Times the kernel ring buffer overwrote records before gpuwatchd read "
    "them (EPIPE on /dev/kmsg).",
    "kernel_log_lines_rejected": "Kernel log records that could not be used, by reason.",
    "web_connections_dropped": "Connections to /metrics that the server closed unanswered, by "
    "reason: limit (the oldest waiting one made room for a new one), timeout (no complete request "
    "or response in time), no_thread (no worker thread could be started).",
    "state_write_errors": "Writes of a file in state_dir that failed (disk full, read-only, "
    "permission denied); file is the state file's name.",
    "state_records_rejected": "Records read back from a file in state_dir that could not be used "
    "and were skipped (torn, malformed or out-of-range lines), by file and reason.",
    "cycle_deferred_probes": "Stall probes of ranks (per-thread looks, py-spy dumps) that the "
    "cycle's time budget deferred to a later cycle instead of letting one input stall the cycle.",
}


def _checked(build: Callable[[], list[Metric]]) -> list[Metric]:
    """Fail at build time, inside the isolation wrapper, on a value the text format cannot carry,
    rather than half-way through writing the response (``add_metric`` checks its own rows)."""
    families = build()
    for fam in families:
        for sample in fam.plain_samples:
            float(sample.value)
            for v in sample.labels.values():
                if not isinstance(v, str):
                    raise TypeError(f"{sample.name}: label value {v!r} is not a string")
    return families


def _g(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, labels=list(labels))


class StateCollector:
    def __init__(
        self,
        get_state: Callable[[], NodeState | None],
        counters: CounterStore,
        process: Callable[[], list[Metric]] = process_families,
        config_reload: Callable[[], tuple[bool, float]] | None = None,
    ) -> None:
        """``config_reload``: (whether the last load of the config file succeeded, the Unix time
        of the last one that did), the daemon's; None: no config families (a registry in tests)."""
        self.get_state = get_state
        self.counters = counters
        self.process = process  # the daemon's own process_* families (tests fix them)
        self.config_reload = config_reload

    def collect(self) -> Iterator[Metric]:
        state = self.get_state()
        builders: list[tuple[str, Callable[[], list[Metric]]]] = [
            ("build_info", self._build_info),
            ("process", self.process),
        ]
        if self.config_reload is not None:
            builders.append(("config_reload", self._config_reload))
        if state is not None:
            builders += [
                ("collectors", lambda: self._collectors(state)),
                ("gpus", lambda: self._gpus(state)),
                ("gpu_processes", lambda: self._gpu_processes(state)),
                ("ranks", lambda: self._ranks(state)),
                ("findings", lambda: self._findings(state)),
                ("memory", lambda: memory_families(state)),
                ("collectives", lambda: self._collectives(state)),
                ("nccl_ras", lambda: self._nccl_ras(state)),
                ("counters", lambda: self._counters(state)),
            ]
        nothing: list[Metric] = []
        for name, build in builders:
            yield from guarded(f"building metric family {name}", functools.partial(_checked, build), nothing)

    def _build_info(self) -> list[Metric]:
        m = _g("build_info", "Always 1; the version label says which gpuwatchd is running.", ["version"])
        m.add_metric([__version__], 1)
        return [m]

    def _config_reload(self) -> list[Metric]:
        # The names and meaning of Prometheus' and Alertmanager's own (prometheus_config_last_reload_*),
        # so that the same alert and panel fit: a refused SIGHUP keeps the running config and sets 0.
        assert self.config_reload is not None
        ok, at = self.config_reload()
        last = GaugeMetricFamily(
            "gpuwatch_config_last_reload_successful",
            "1 when the last load "
            "of the config file (at start or on SIGHUP) succeeded, 0 when the "
            "last reload was refused and the daemon kept the running config.",
        )
        last.add_metric([], 1 if ok else 0)
        ts = GaugeMetricFamily(
            "gpuwatch_config_last_reload_success_timestamp_seconds",
            "Unix time of the last successful load of the config file (at start or on SIGHUP).",
        )
        ts.add_metric([], at)
        return [last, ts]

    def _collectors(self, s: NodeState) -> list[Metric]:
        ok = _g(
            "collector_success",
            "1 when the collector's last run succeeded, 0 when it failed, "
            "timed out or its subject is absent on this host.",
            ["collector"],
        )
        dur = _g("collector_duration_seconds", "Seconds the collector's last run took.", ["collector"])
        last = _g(
            "collector_last_success_timestamp_seconds",
            "Unix time of the collector's last successful run.",
            ["collector"],
        )
        for c in s.collectors:
            ok.add_metric([c.name], 1 if c.success else 0)
            dur.add_metric([c.name], c.duration_seconds)
            if c.last_success_timestamp is not None:
                last.add_metric([c.name], c.last_success_timestamp)
        cyc = _g("cycle_duration_seconds", "Seconds the last polling cycle took (all polled collectors plus the join).")
        cyc.add_metric([], s.cycle_seconds)
        ts = _g("last_cycle_timestamp_seconds", "Unix time at which the last polling cycle ended.")
        ts.add_metric([], s.timestamp)
        out: list[Metric] = [ok, dur, last, cyc, ts]
        if s.oom_score_adj is not None:
            adj = _g(
                "process_oom_score_adj",
                "The daemon's own oom_score_adj (/proc/self/"
                "oom_score_adj): -900 when the unit's OOMScoreAdjust took effect.",
            )
            adj.add_metric([], s.oom_score_adj)
            out.append(adj)
        if s.memory_limit_bytes is not None:
            lim = _g(
                "process_memory_limit_bytes",
                "The memory limit of the daemon's own cgroup in "
                "bytes: the tightest memory.max (v1 memory.limit_in_bytes) on its path, i.e. "
                "the unit's MemoryMax= or the pod's limits.memory; absent without a limit.",
            )
            lim.add_metric([], s.memory_limit_bytes)
            out.append(lim)
        return out

    def _gpus(self, s: NodeState) -> list[Metric]:
        info = _g("gpu_info", "Always 1, one series per GPU, naming it.", ["gpu", "uuid", "name", "pci_bus_id"])
        total = _g(
            "gpu_memory_total_bytes",
            "Total memory of the GPU in bytes (NVML, polled every interval_seconds).",
            ["gpu", "uuid"],
        )
        used = _g("gpu_memory_used_bytes", "Memory in use on the GPU in bytes (NVML, polled).", ["gpu", "uuid"])
        util = _g(
            "gpu_utilization_ratio",
            "Fraction of the last sample period (0..1) during which a kernel ran on the GPU (NVML, polled).",
            ["gpu", "uuid"],
        )
        throttle = _g(
            "gpu_clock_throttled",
            "1 when NVML reports this reason for the GPU's clocks "
            "being below their maximum (nvmlDeviceGetCurrentClocksEventReasons), else 0; "
            "absent when the driver does not say.",
            ["gpu", "uuid", "reason"],
        )
        for g in s.gpus:
            labels = [str(g.index), g.uuid]
            info.add_metric([*labels, g.name, g.pci_bus_id], 1)
            if g.throttle_reasons is not None:
                for reason, bit in THROTTLE_REASONS.items():
                    throttle.add_metric([*labels, reason], 1 if g.throttle_reasons & bit else 0)
            if g.memory_total_bytes is not None:
                total.add_metric(labels, g.memory_total_bytes)
            if g.memory_used_bytes is not None:
                used.add_metric(labels, g.memory_used_bytes)
            if g.utilization_ratio is not None:
                util.add_metric(labels, g.utilization_ratio)
        return [info, total, used, util, throttle]

    def _gpu_processes(self, s: NodeState) -> list[Metric]:
        pm = _g(
            "gpu_process_memory_bytes",
            "GPU memory in bytes held by each process on each GPU; "
            "job_id and rank are empty when the process is in no rank's process tree. Absent "
            "when NVML reports N/A (as on MIG).",
            ["gpu", "uuid", "pid", "comm", "user", "job_id", "rank"],
        )
        rank_mem: dict[tuple[str, str, str], float] = defaultdict(float)
        for p in s.gpu_processes:
            if p.used_memory_bytes is None:
                continue
            pm.add_metric([str(p.gpu_index), p.uuid, str(p.pid), p.comm, p.user, p.job_id, p.rank], p.used_memory_bytes)
            if p.job_id:
                rank_mem[(p.job_id, p.rank, str(p.gpu_index))] += p.used_memory_bytes
        rm = _g(
            "rank_gpu_memory_bytes",
            "GPU memory in bytes held by the rank's whole process tree (rank process plus descendants) on each GPU.",
            ["job_id", "rank", "gpu"],
        )
        for (job_id, rank, gpu), v in sorted(rank_mem.items()):
            rm.add_metric([job_id, rank, gpu], v)
        om = _g(
            "orphan_gpu_memory_bytes",
            "GPU memory in bytes held by a process that belongs to "
            "no live rank, after the grace period; reason says why it is considered stale.",
            ["gpu", "uuid", "pid", "comm", "user", "reason"],
        )
        for o in s.orphans:
            if o.used_memory_bytes is not None:
                om.add_metric([str(o.gpu_index), o.uuid, str(o.pid), o.comm, o.user, o.reason], o.used_memory_bytes)
        return [pm, rm, om]

    def _ranks(self, s: NodeState) -> list[Metric]:
        jr = ["job_id", "rank"]
        info = _g(
            "rank_info",
            "Always 1 per registered rank, with its PID and layout.",
            ["job_id", "rank", "local_rank", "pid", "world_size"],
        )
        up = _g("rank_up", "1 when the rank's process is alive, 0 when it is registered but dead.", jr)
        fds = _g("rank_open_fds", "File descriptors open in the rank process.", jr)
        maxfds = _g("rank_max_fds", "Soft RLIMIT_NOFILE of the rank process.", jr)
        cpu = CounterMetricFamily(
            P + "rank_cpu_seconds", "CPU seconds (user+system) used by the rank process.", labels=jr
        )
        rss = _g("rank_resident_memory_bytes", "Resident memory of the rank process in bytes.", jr)
        thr = _g("rank_threads", "Threads of the rank process.", jr)
        prog = _g(
            "rank_progress_timestamp_seconds",
            "Unix time of the rank's last progress (heartbeat); absent when the rank sends none.",
            jr,
        )
        stalled = _g("rank_stalled", "1 when the rank is alive but has made no progress for stall.after_seconds.", jr)
        step = _g(
            "rank_step",
            "The step the rank passed to its last gpuwatchd.heartbeat(step); "
            "deriv() of it is the rank's step rate. Absent when the rank sends no step.",
            jr,
        )
        pod = _g(
            "rank_pod_info",
            "Always 1 per rank that runs in a Kubernetes pod: uid is the "
            "pod's UID, read from the rank's cgroup path (no API call), as kube-state-metrics' "
            "kube_pod_info{uid} carries it, so on (uid) joins the two.",
            [*jr, "uid"],
        )
        for r in s.ranks:
            labels = [r.job_id, str(r.rank)]
            uid = pod_uid(r.container)
            if uid:
                pod.add_metric([*labels, uid], 1)
            info.add_metric(
                [
                    *labels,
                    "" if r.local_rank is None else str(r.local_rank),
                    str(r.pid),
                    "" if r.world_size is None else str(r.world_size),
                ],
                1,
            )
            up.add_metric(labels, 1 if r.alive else 0)
            stalled.add_metric(labels, 1 if r.stalled else 0)
            if r.progress_timestamp is not None:
                prog.add_metric(labels, r.progress_timestamp)
            if r.step is not None:
                step.add_metric(labels, r.step)
            p = r.process
            if p is None:
                continue
            if p.open_fds is not None:
                fds.add_metric(labels, p.open_fds)
            if p.max_fds_soft is not None:
                maxfds.add_metric(labels, p.max_fds_soft)
            cpu.add_metric(labels, p.cpu_seconds)
            rss.add_metric(labels, p.rss_bytes)
            thr.add_metric(labels, p.threads)
        return [info, up, fds, maxfds, cpu, rss, thr, prog, stalled, step, pod]

    def _collectives(self, s: NodeState) -> list[Metric]:
        labels = ["job_id", "rank", "pg"]
        started = _g(
            "rank_collective_last_started_seq",
            "Highest collective sequence number the "
            "rank entered in the process group, from its PyTorch flight recorder (read "
            "when a rank of the job looks stalled).",
            labels,
        )
        done = _g(
            "rank_collective_last_completed_seq",
            "Highest collective sequence number the "
            "rank completed in the process group, from its PyTorch flight recorder.",
            labels,
        )
        for c in s.collectives:
            values = [c.job_id, str(c.rank), c.pg]
            started.add_metric(values, c.last_started)
            done.add_metric(values, c.last_completed)
        return [started, done]

    def _nccl_ras(self, s: NodeState) -> list[Metric]:
        labels = ["job_id", "rank"]
        ops = _g(
            "nccl_ras_rank_operations",
            "Collective operations the rank has issued, all "
            "functions, as NCCL RAS reports it (asked when a rank of the job looks stalled, "
            "suspect, late with its heartbeat or in a collective, every "
            "stall.nccl_ras_interval_seconds).",
            labels,
        )
        still = _g(
            "nccl_ras_rank_operations_unchanged_seconds",
            "Seconds since NCCL RAS last saw the rank's operation count change, at the latest answer.",
            labels,
        )
        missing = _g(
            "nccl_ras_missing_ranks",
            "Ranks of the job that NCCL RAS reports missing, by "
            "reason (dead: its RAS peer is gone; unresponsive: it did not answer).",
            ["job_id", "reason"],
        )
        errors = _g(
            "nccl_ras_async_error_ranks",
            "Ranks of the job with an asynchronous NCCL error or the abort flag set, per NCCL RAS.",
            ["job_id"],
        )
        culprit = _g(
            "nccl_ras_culprit",
            "1 per rank that NCCL RAS names as the one its job waits for "
            "(reason: dead, unresponsive, missing, behind, async_error), at most 4 of each; "
            "nccl_rank is its rank in NCCL's world communicator, host its RAS address.",
            ["job_id", "nccl_rank", "host", "pid", "reason"],
        )
        jobs: set[str] = set()
        for r in s.nccl_ras:
            if r.counted:  # a one-rank communicator's counts are always 0 (join/nccl_ras.py)
                ops.add_metric([r.job_id, str(r.rank)], r.ops)
                still.add_metric([r.job_id, str(r.rank)], max(0.0, r.asked_at - r.moved_at))
            if r.job_id not in jobs:
                jobs.add(r.job_id)
                missing.add_metric([r.job_id, "dead"], r.dead)
                missing.add_metric([r.job_id, "unresponsive"], r.unresponsive)
                errors.add_metric([r.job_id], r.errors)
                for rank, host, pid, reason in r.culprits:
                    culprit.add_metric([r.job_id, str(rank), host, str(pid), reason], 1)
        return [ops, still, missing, errors, culprit]

    def _findings(self, s: NodeState) -> list[Metric]:
        m = _g(
            "finding",
            "1 per active finding (diagnosis); the explanation is in the events log, "
            "`gpuwatchd ps` and the alert annotations.",
            ["kind", "severity", "job_id", "rank", "pid"],
        )
        seen: set[tuple[str, ...]] = set()
        for f in s.findings:
            labels = (f.kind, f.severity, f.job_id, f.rank, f.pid)
            if labels not in seen:  # several bad rank files share one label set
                seen.add(labels)
                m.add_metric(list(labels), 1)
        return [m]

    def _counters(self, s: NodeState) -> list[Metric]:
        snap = {name: dict(series) for name, series in self.counters.snapshot().items()}
        # A live rank's series exist at 0 before the first event, so increase() sees the first one.
        for r in s.ranks:
            if r.alive and r.process is not None:
                jr = (r.job_id, str(r.rank))
                snap["oom_kills"].setdefault((*jr, r.process.comm, "kernel"), 0.0)
                snap["rank_gil_samples"].setdefault(jr, 0.0)
                snap["rank_gil_held_samples"].setdefault(jr, 0.0)
        out: list[Metric] = []
        for name, labels in COUNTER_LABELS.items():
            series = snap.get(name, {})
            if not series and labels:
                continue
            m = CounterMetricFamily(P + name, COUNTER_HELP.get(name, name), labels=list(labels))
            for values, v in sorted(series.items()):
                m.add_metric(list(values), v)
            if not labels and not series:
                m.add_metric([], 0.0)
            out.append(m)
        return out


class StateRegistry(Registry):
    """The private registry, plus ``exposition(fmt)``: the rendered scrape (with its gzip and its
    ``name[]`` filter, exporter/exposition.py) is reused until the state or a counter changes,
    so a scrape between two cycles costs a dictionary lookup, whatever it asks for."""

    def __init__(self, collector: StateCollector, liveness: Callable[[], str] = lambda: "") -> None:
        super().__init__()
        self.collector = collector
        self._liveness = liveness
        self.register(collector)
        self._cache: dict[str, tuple[NodeState | None, int, Exposition]] = {}
        self._render_lock = threading.Lock()  # Registry has its own _lock
        # What the last render wrote, per format (render.py).
        self._prefixes = {"text": Prefixes(), "openmetrics": Prefixes()}
        self.renders = 0  # renderings made (tests: a request never renders anew)

    def exposition(self, fmt: str) -> Exposition:
        """This cycle's rendering in ``fmt`` (``"text"`` or ``"openmetrics"``)."""
        # The cache holds the state object itself (compared with `is`), so its id cannot be reused.
        state, version = self.collector.get_state(), self.collector.counters.version
        with self._render_lock:
            c = self._cache.get(fmt)
            if c is not None and c[0] is state and c[1] == version:
                return c[2]
            build = openmetrics_parts if fmt == "openmetrics" else text_parts
            exp = Exposition(build(self.collect(), self._prefixes[fmt]), fmt == "openmetrics")
            self.renders += 1
            self._cache[fmt] = (state, version, exp)
            return exp

    def encode_text(self) -> bytes:
        return self.exposition("text").body

    def readiness(self) -> NodeState | None:
        """The state /-/ready judges (None: the first cycle has not ended)."""
        return self.collector.get_state()

    def liveness(self) -> str:
        """Why /-/healthy fails ("" while cycles keep finishing: the daemon's watchdog rule)."""
        return self._liveness()


def make_registry(
    get_state: Callable[[], NodeState | None],
    counters: CounterStore,
    process: Callable[[], list[Metric]] = process_families,
    liveness: Callable[[], str] = lambda: "",
    config_reload: Callable[[], tuple[bool, float]] | None = None,
) -> StateRegistry:
    """``liveness``: "" while the producer of the states is alive, else why not (/-/healthy).
    ``config_reload``: (the last load succeeded, its Unix time), for gpuwatch_config_last_reload_*."""
    return StateRegistry(StateCollector(get_state, counters, process, config_reload), liveness)
