"""NodeState.rank_memory / node_memory -> metric families (built fresh on every scrape).

One series per rank and per node, never per worker: the tree's processes are summed, and which of
them hold and gained the memory is kept in the snapshots of the event log instead
(memory_evidence.py). Values are those of the last cycle (memory_subsystem.py).
"""

from __future__ import annotations

from gpuwatchd.exporter.families import CounterMetricFamily, GaugeMetricFamily, Metric
from gpuwatchd.model import NodeState

P = "gpuwatch_"
JR = ["job_id", "rank"]


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, labels=labels)


def memory_families(s: NodeState) -> list[Metric]:
    tree = _g(
        "rank_tree_resident_memory_bytes",
        "Resident memory in bytes of the rank's whole "
        "process tree (rank process plus descendants such as DataLoader workers).",
        JR,
    )
    usage = _g(
        "rank_memory_cgroup_usage_bytes",
        "Memory charged to the memory cgroup that bounds "
        "the rank (v1 memory.usage_in_bytes, v2 memory.current), in bytes.",
        JR,
    )
    ws = _g(
        "rank_memory_cgroup_working_set_bytes",
        "That cgroup's usage minus its inactive file cache, in bytes: what is compared with the limit.",
        JR,
    )
    limit = _g(
        "rank_memory_cgroup_limit_bytes",
        "The limit of that cgroup (v1 memory.limit_in_bytes, v2 memory.max) in bytes; absent when unlimited.",
        JR,
    )
    waiting = CounterMetricFamily(
        P + "rank_memory_pressure_waiting_seconds",
        "Seconds some task "
        "of the rank's cgroup waited for memory (PSI memory.pressure "
        "'some' total); absent where the kernel has no cgroup PSI.",
        labels=JR,
    )
    stalled = CounterMetricFamily(
        P + "rank_memory_pressure_stalled_seconds",
        "Seconds all tasks of the rank's cgroup stalled on memory (PSI 'full' total).",
        labels=JR,
    )
    for m in s.rank_memory:
        labels = [m.job_id, str(m.rank)]
        tree.add_metric(labels, m.tree_rss_bytes)
        if m.usage_bytes is not None:
            usage.add_metric(labels, m.usage_bytes)
        if m.working_set_bytes is not None:
            ws.add_metric(labels, m.working_set_bytes)
        if m.limit_bytes is not None:
            limit.add_metric(labels, m.limit_bytes)
        if m.pressure_some_seconds is not None:
            waiting.add_metric(labels, m.pressure_some_seconds)
        if m.pressure_full_seconds is not None:
            stalled.add_metric(labels, m.pressure_full_seconds)
    total = _g("node_memory_total_bytes", "MemTotal of /proc/meminfo in bytes.", [])
    avail = _g(
        "node_memory_available_bytes",
        "MemAvailable of /proc/meminfo in bytes: what can be allocated without swapping, before the OOM killer acts.",
        [],
    )
    n_wait = CounterMetricFamily(
        P + "node_memory_pressure_waiting_seconds",
        "Seconds some task of the node waited for memory (/proc/pressure/memory 'some' total).",
        labels=[],
    )
    n_stall = CounterMetricFamily(
        P + "node_memory_pressure_stalled_seconds",
        "Seconds all tasks of the node stalled on memory (/proc/pressure/memory 'full').",
        labels=[],
    )
    n = s.node_memory
    if n is not None:
        total.add_metric([], n.total_bytes)
        avail.add_metric([], n.available_bytes)
        if n.pressure_some_seconds is not None:
            n_wait.add_metric([], n.pressure_some_seconds)
        if n.pressure_full_seconds is not None:
            n_stall.add_metric([], n.pressure_full_seconds)
    return [tree, usage, ws, limit, waiting, stalled, total, avail, n_wait, n_stall]
