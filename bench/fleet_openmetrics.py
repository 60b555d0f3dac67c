"""OpenMetrics for a fleet of gpuwatchd nodes, generated from one real node's exposition.

Input: the /metrics text of a real daemon (bench/fleet_node.py). Output: a stream of OpenMetrics
lines with timestamps, time-major (every series of every node at t0, then at t1, ...), as
`promtool tsdb create-blocks-from openmetrics` reads them: each node is the template with its own
`instance`, job ids, ranks, pids and GPU UUIDs, plus the series Prometheus adds to every target
(`up`, `scrape_*`). Values move over time (counters grow, timestamps follow the clock, GPU memory
and utilisation vary by node group); small jobs restart every `churn_seconds` under a new job id,
as a fleet's short jobs do. A few nodes carry incidents: kernel OOM kills (rank down, finding),
stalls (heartbeat stops, gauge and finding after stall.after_seconds) and critical Xids.

Cost: one `%` format per node per timestamp for the ordinary nodes (C speed, ~25 KB each); only
the handful of incident nodes are built line by line. Memory is the per-node format strings
(O(nodes x series)), never the output.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# Prometheus's own series for every scraped target.
SCRAPE_SERIES = (
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
)
# Series of a rank's live process: gone once the process is (OOM-killed rank).
PROCESS_FAMILIES = {
    "gpuwatch_rank_open_fds",
    "gpuwatch_rank_max_fds",
    "gpuwatch_rank_cpu_seconds_total",
    "gpuwatch_rank_resident_memory_bytes",
    "gpuwatch_rank_threads",
    "gpuwatch_rank_gpu_memory_bytes",
    "gpuwatch_gpu_process_memory_bytes",
    "gpuwatch_rank_progress_timestamp_seconds",
    "gpuwatch_rank_stalled",
    "gpuwatch_rank_gil_samples_total",
    "gpuwatch_rank_gil_held_samples_total",
    "gpuwatch_rank_step",
    "gpuwatch_rank_tree_resident_memory_bytes",
    "gpuwatch_rank_memory_cgroup_usage_bytes",
    "gpuwatch_rank_memory_cgroup_working_set_bytes",
    "gpuwatch_rank_memory_cgroup_limit_bytes",
    "gpuwatch_rank_memory_pressure_waiting_seconds_total",
    "gpuwatch_rank_memory_pressure_stalled_seconds_total",
}
VARIANTS = 8  # node groups whose values move together
STRAGGLER_SLOWDOWN = 0.5  # a straggler's step rate, as a fraction of its node group's
STALL_AFTER = 300.0  # the daemon's default stall.after_seconds
JOB_SIZES = (128, 64, 32, 16, 8, 8, 4, 4, 2, 2, 1, 1, 1, 1)  # nodes per job, repeated


@dataclass
class Series:
    name: str
    labels: list[tuple[str, str]]
    value: float


def parse_exposition(text: str) -> list[Series]:
    """The samples of a Prometheus text exposition (no timestamps), in order.

    Unattributed OOM kills (job_id="") are the bench machine's own kernel log, not the node's
    steady state: dropped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        s = Series(name, LABEL.findall(rest), float(value))
        if name == "gpuwatch_oom_kills_total" and dict(s.labels).get("job_id") == "":
            continue
        out.append(s)
    return out


@dataclass
class Incident:
    kind: str  # oom | stall | xid | straggler
    node: int
    at: float
    local_rank: int = 0
    xid: int = 79


@dataclass
class Fleet:
    template: list[Series]
    nodes: int
    start: float
    end: float
    interval: float
    churn_seconds: float = 7200.0
    incidents: list[Incident] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_node = len(self.template) + len(SCRAPE_SERIES)
        tpl = [dict(s.labels) for s in self.template]
        self.t_job = next(d["job_id"] for d in tpl if d.get("job_id"))
        self.t_pid_rank = {
            d["pid"]: int(d["local_rank"])
            for s, d in zip(self.template, tpl, strict=True)
            if s.name == "gpuwatch_rank_info"
        }
        self.t_uuid_gpu = {
            d["uuid"]: int(d["gpu"]) for s, d in zip(self.template, tpl, strict=True) if s.name == "gpuwatch_gpu_info"
        }
        self.gpus = len(self.t_uuid_gpu)
        self.jobs: list[tuple[int, int]] = []  # (first node, size)
        n = k = 0
        while n < self.nodes:
            size = min(JOB_SIZES[k % len(JOB_SIZES)], self.nodes - n)
            self.jobs.append((n, size))
            n, k = n + size, k + 1
        self.job_of = [0] * self.nodes
        for j, (first, size) in enumerate(self.jobs):
            for i in range(first, first + size):
                self.job_of[i] = j
        self._fmt_cache: dict[tuple[int, int], str] = {}
        self._vals_cache: dict[tuple[int, int], tuple[str, ...]] = {}

    # -- who is where ----------------------------------------------------------------------
    def instance(self, node: int) -> str:
        return f"gpu-node-{node:04d}:9863"

    def epoch(self, node: int, t: float) -> int:
        """Jobs of <= 8 nodes restart every churn_seconds (a new job id, new pids)."""
        _first, size = self.jobs[self.job_of[node]]
        return int(t // self.churn_seconds) if size <= 8 else 0

    def job_id(self, node: int, epoch: int) -> str:
        j = self.job_of[node]
        return f"job-{j:04d}" + (f"-r{epoch}" if self.jobs[j][1] <= 8 else "")

    def largest_job(self) -> str:
        return self.job_id(self.jobs[0][0], 0)

    def _labels(self, node: int, epoch: int, s: Series) -> str:
        first, size = self.jobs[self.job_of[node]]
        sub = {"job_id": self.job_id(node, epoch), "world_size": str(size * self.gpus)}
        parts = ['job="gpuwatchd"', f'instance="{self.instance(node)}"']
        for k, v in s.labels:
            if k == "job_id" and v == self.t_job:
                v = sub["job_id"]
            elif k == "rank" and v:
                v = str((node - first) * self.gpus + int(v))
            elif k == "world_size":
                v = sub["world_size"]
            elif k == "pid" and v in self.t_pid_rank:
                v = str(self.pid(node, epoch, self.t_pid_rank[v]))
            elif k == "uuid" and v in self.t_uuid_gpu:
                v = self.uuid(node, self.t_uuid_gpu[v])
            parts.append(f'{k}="{v}"')
        return "{" + ",".join(parts) + "}"

    def pid(self, node: int, epoch: int, local_rank: int) -> int:
        return 4000 + (node * 7919 + epoch * 104729) % 3_000_000 + local_rank * 3

    def uuid(self, node: int, gpu: int) -> str:
        return f"GPU-{node:08x}-{gpu:04x}-4e2f-8360-ea896c371e{gpu:02x}"

    def _prefixes(self, node: int, epoch: int) -> list[str]:
        out = [s.name + self._labels(node, epoch, s) for s in self.template]
        inst = f'{{job="gpuwatchd",instance="{self.instance(node)}"}}'
        return out + [n + inst for n in SCRAPE_SERIES]

    # -- values ----------------------------------------------------------------------------
    def _value(self, s: Series, variant: int, t: float) -> float:
        n = s.name
        phase = variant / VARIANTS
        age = t - self.start
        if n.endswith("_timestamp_seconds"):
            return t - 0.5 - variant * 0.1
        if n == "gpuwatch_rank_cpu_seconds_total":
            return s.value + (0.9 + 0.1 * variant) * age
        if n == "gpuwatch_rank_gil_samples_total":
            return s.value + 50 * (age // 30)
        if n == "gpuwatch_rank_gil_held_samples_total":
            return s.value + (5 + variant) * (age // 30)
        if n == "gpuwatch_rank_step":
            return float(int(s.value + self.step_rate(variant) * age))
        if "_memory_pressure_" in n:
            return round(s.value + 0.001 * age, 3)
        if n in (
            "gpuwatch_rank_tree_resident_memory_bytes",
            "gpuwatch_rank_memory_cgroup_usage_bytes",
            "gpuwatch_rank_memory_cgroup_working_set_bytes",
        ):
            return float(int(s.value + (4 + variant + math.sin(age / 1200)) * 2**30))
        if n == "gpuwatch_gpu_utilization_ratio":
            return round(0.8 + 0.19 * math.sin(age / 900 + phase * 6.28), 3)
        if n in (
            "gpuwatch_gpu_memory_used_bytes",
            "gpuwatch_rank_gpu_memory_bytes",
            "gpuwatch_gpu_process_memory_bytes",
        ):
            return float(int(s.value + (60 + 10 * variant + 5 * math.sin(age / 1800)) * 2**30))
        if n.endswith("_duration_seconds"):
            return round(s.value * (1 + 0.2 * math.sin(age / 300 + phase)), 6)
        return s.value

    def step_rate(self, variant: int) -> float:
        """Training steps per second of a node group (all within 0.8x of each other)."""
        return 1.0 + 0.02 * variant

    def _scrape_values(self, variant: int, t: float) -> list[float]:
        n = float(len(self.template))
        return [1.0, round(0.004 + 0.001 * variant + 0.0005 * math.sin(t / 60), 6), n, n, 0.0]

    def _values(self, variant: int, t: float) -> list[float]:
        return [self._value(s, variant, t) for s in self.template] + self._scrape_values(variant, t)

    # -- output ----------------------------------------------------------------------------
    def times(self) -> Iterator[float]:
        t = self.start
        while t <= self.end:
            yield t
            t += self.interval

    def samples_estimate(self) -> int:
        steps = int((self.end - self.start) // self.interval) + 1
        return steps * self.nodes * self.per_node

    def lines(self) -> Iterator[str]:
        """The whole OpenMetrics document, in chunks (one node at one timestamp each)."""
        by_node: dict[int, list[Incident]] = {}
        for inc in self.incidents:
            by_node.setdefault(inc.node, []).append(inc)
        for t in self.times():
            ts = f" {int(t)}\n"
            vals_t: dict[int, tuple[str, ...]] = {}
            for node in range(self.nodes):
                variant = node % VARIANTS
                ep = self.epoch(node, t)
                if node in by_node:
                    yield self._incident_chunk(node, ep, variant, t, by_node[node])
                    continue
                if variant not in vals_t:
                    vals = self._values(variant, t)
                    vals_t[variant] = tuple(x for v in vals for x in (repr(v), ts))
                fmt = self._fmt_cache.get((node, ep))
                if fmt is None:
                    self._fmt_cache = {k: v for k, v in self._fmt_cache.items() if k[0] != node}
                    fmt = "".join(p.replace("%", "%%") + " %s%s" for p in self._prefixes(node, ep))
                    self._fmt_cache[(node, ep)] = fmt
                yield fmt % vals_t[variant]
        yield "# EOF\n"

    def _incident_chunk(self, node: int, ep: int, variant: int, t: float, incs: list[Incident]) -> str:
        prefixes = self._prefixes(node, ep)
        vals = self._values(variant, t)
        first = self.jobs[self.job_of[node]][0]
        base = (node - first) * self.gpus
        keep = [True] * len(prefixes)
        extra: list[tuple[str, float]] = []
        inst = f'job="gpuwatchd",instance="{self.instance(node)}"'
        jid = self.job_id(node, ep)
        for inc in incs:
            if t < inc.at:
                continue
            rank = str(base + inc.local_rank)
            pid = str(self.pid(node, ep, inc.local_rank))
            for i, s in enumerate(self.template):
                d = dict(s.labels)
                if (
                    inc.kind in ("oom", "stall")
                    and d.get("rank") == str(inc.local_rank)
                    and d.get("job_id") == self.t_job
                ):
                    if inc.kind == "oom":
                        if s.name in PROCESS_FAMILIES:
                            keep[i] = False
                        elif s.name == "gpuwatch_rank_up":
                            vals[i] = 0.0
                        elif s.name == "gpuwatch_oom_kills_total":
                            vals[i] = 1.0
                    else:
                        if s.name == "gpuwatch_rank_progress_timestamp_seconds":
                            vals[i] = inc.at
                        elif s.name == "gpuwatch_rank_step":
                            vals[i] = self._value(s, variant, inc.at)
                        elif s.name == "gpuwatch_rank_stalled" and t >= inc.at + STALL_AFTER:
                            vals[i] = 1.0
                elif (
                    inc.kind == "straggler"
                    and d.get("rank") == str(inc.local_rank)
                    and d.get("job_id") == self.t_job
                    and s.name == "gpuwatch_rank_step"
                ):
                    lost = (1 - STRAGGLER_SLOWDOWN) * self.step_rate(variant) * (t - inc.at)
                    vals[i] = float(int(self._value(s, variant, t) - lost))
            if inc.kind == "oom":
                extra.append(
                    (
                        f'gpuwatch_finding{{{inst},kind="rank_oom_killed",severity="page",'
                        f'job_id="{jid}",rank="{rank}",pid="{pid}"}}',
                        1.0,
                    )
                )
            elif inc.kind == "stall" and t >= inc.at + STALL_AFTER:
                extra.append(
                    (
                        f'gpuwatch_finding{{{inst},kind="rank_stalled",severity="page",'
                        f'job_id="{jid}",rank="{rank}",pid="{pid}"}}',
                        1.0,
                    )
                )
            elif inc.kind == "xid":
                g = inc.local_rank
                extra.append(
                    (
                        f'gpuwatch_gpu_xid_errors_total{{{inst},gpu="{g}",'
                        f'uuid="{self.uuid(node, g)}",xid="{inc.xid}"}}',
                        1.0,
                    )
                )
                extra.append(
                    (f'gpuwatch_finding{{{inst},kind="xid_critical",severity="page",job_id="",rank="",pid=""}}', 1.0)
                )
        ts = int(t)
        out = [f"{p} {v!r} {ts}\n" for p, v, k in zip(prefixes, vals, keep, strict=True) if k]
        out += [f"{p} {v!r} {ts}\n" for p, v in extra]
        return "".join(out)


def default_incidents(fleet: Fleet, now: float) -> list[Incident]:
    """A few incidents spread over the fleet and over time, several of them after `now` (the
    data run into the future) so that some are recent whenever the rules are evaluated:
    3 OOM kills (one in the largest job), 3 stalls, 4 critical Xids, 2 stragglers (one in the
    largest job: half its node group's step rate)."""
    n = fleet.nodes
    a, b, c = 0, n // 3, (2 * n) // 3
    m = 60.0
    out = [
        Incident("oom", a, now + 5 * m, local_rank=3),
        Incident("oom", b, now - 120 * m, local_rank=0),
        Incident("oom", c, now + 20 * m, local_rank=5),
        Incident("stall", min(n - 1, a + 1), now - 20 * m, local_rank=1),
        Incident("stall", min(n - 1, b + 1), now + 10 * m, local_rank=6),
        Incident("stall", min(n - 1, c + 1), now - 180 * m, local_rank=2),
        Incident("xid", min(n - 1, a + 2), now + 8 * m, local_rank=4, xid=79),
        Incident("xid", min(n - 1, b + 2), now - 300 * m, local_rank=0, xid=48),
        Incident("xid", min(n - 1, c + 2), now + 16 * m, local_rank=7, xid=94),
        Incident("xid", min(n - 1, c + 3), now + 24 * m, local_rank=2, xid=79),
        Incident("straggler", min(n - 1, a + 3), now - 40 * m, local_rank=5),
        Incident("straggler", min(n - 1, b + 3), now - 90 * m, local_rank=1),
    ]
    return [i for i in out if fleet.start <= i.at <= fleet.end]
