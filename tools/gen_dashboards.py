#!/usr/bin/env python3
"""Generate the Grafana dashboards in grafana/dashboards/ from the panel lists below.

    python3 tools/gen_dashboards.py           # write grafana/dashboards/*.json
    python3 tools/gen_dashboards.py --check   # exit 1 if the committed JSON differs (CI)

Plain Python and the standard library, so that a panel is one line in a list and the JSON stays
reviewable; the generated files are committed and provisioned by grafana/provisioning/.
Every expression uses only series the daemon exports (tests/test_dashboards.py checks them against
the daemon's real /metrics and parses each one with promtool). Every field Grafana's schema
requires is written out (tests/test_dashboard_schema.py: a grafana-foundation-sdk round trip
changes nothing), so a typed tool that loads these files keeps what they say (legends on).

Variables used in expressions: $instance (Node, multi-select), $job_id and $rank (Job,
multi-select), $job (Health: the scrape job), $__rate_interval, $__range and $__interval (Grafana
built-ins).

Panels whose query would touch every rank of a big job or every node of the fleet at each step
read the recording rules of deploy/prometheus/gpuwatchd.recording.yml (`rank:...`,
`collector:...`) instead, so that each stays under 1 s on 1,250 nodes (deploy/prometheus/FLEET.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "grafana" / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    fmt: str = "time_series"  # or "table"


@dataclass
class Panel:
    title: str
    kind: str  # timeseries | stat | table
    targets: list[Target]
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    thresholds: list[tuple[float | None, str]] = field(default_factory=lambda: [(None, "green")])
    min: float | None = None
    max: float | None = None
    overrides: list[dict[str, Any]] = field(default_factory=list)
    transformations: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)  # data links (fieldConfig)


def graph(expr: str, legend: str = "") -> Target:
    """A range query for a time-series panel."""
    return Target(expr, legend)


def table(expr: str, legend: str = "") -> Target:
    """An instant query shown as a table."""
    return Target(expr, legend, instant=True, fmt="table")


def stat(expr: str, legend: str = "") -> Target:
    """An instant query for a stat panel."""
    return Target(expr, legend, instant=True)


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    steps = [{"color": c, "value": v} for v, c in p.thresholds]
    defaults: dict[str, Any] = {"unit": p.unit, "thresholds": {"mode": "absolute", "steps": steps}}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
        }
    if p.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
    if p.kind == "table":
        defaults["custom"] = {"align": "auto", "inspect": False}
    if p.links:
        defaults["links"] = p.links
    out: dict[str, Any] = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "transparent": False,
        "repeatDirection": "h",
        "fieldConfig": {"defaults": defaults, "overrides": p.overrides},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": t.expr,
                "legendFormat": t.legend,
                "instant": t.instant,
                "range": not t.instant,
                "format": t.fmt,
            }
            for i, t in enumerate(p.targets)
        ],
    }
    if p.kind == "timeseries":
        out["options"] = {
            "legend": {
                "showLegend": True,
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "stat":
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
            "wideLayout": True,
            "showPercentChange": False,
            "percentChangeColorMode": "standard",
        }
    elif p.kind == "table":
        out["options"] = {
            "showHeader": True,
            "cellHeight": "sm",
            "frameIndex": 0,
            "showTypeIcons": False,
            "footer": {"show": False, "countRows": False, "reducer": []},
        }
        out["transformations"] = p.transformations or [
            {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True, "job": True}}}
        ]
    return out


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: list[dict[str, Any]],
    rows: list[tuple[str, list[Panel]]],
    tags: list[str],
    annotations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid = 1
    y = 0
    for row_title, row_panels in rows:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid += 1
        y += 1
        x = 0
        row_h = 0
        for p in row_panels:
            if x + p.width > 24:
                x, y = 0, y + row_h
                row_h = 0
            panels.append(_panel_json(p, pid, x, y))
            pid += 1
            x += p.width
            row_h = max(row_h, p.height)
        y += row_h
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["gpuwatchd", *tags],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "utc",
        "fiscalYearStartMonth": 0,
        "links": [
            {
                "type": "dashboards",
                "tags": ["gpuwatchd"],
                "asDropdown": True,
                "title": "gpuwatchd",
                "includeVars": False,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                *(annotations or []),
            ]
        },
        "templating": {"list": [DATASOURCE_VAR, *variables]},
        "panels": panels,
    }


DATASOURCE_VAR: dict[str, Any] = {
    "name": "datasource",
    "label": "Prometheus",
    "type": "datasource",
    "query": "prometheus",
    "current": {"text": "", "value": ""},
    "hide": 0,
    "refresh": 1,
    "regex": "",
    "options": [],
    "multi": False,
    "includeAll": False,
    "skipUrlSync": False,
    "allowCustomValue": True,
    "auto": False,
    "auto_count": 30,
    "auto_min": "10s",
}


def query_var(name: str, label: str, query: str, multi: bool = False) -> dict[str, Any]:
    """A query variable; ``multi``: several values or All (".*"), used as ``label=~"$name"``."""
    v: dict[str, Any] = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "sort": 1 if name != "rank" else 3,
        "multi": multi,
        "includeAll": multi,
        "current": {"text": "", "value": ""},
        "hide": 0,
        "options": [],
        "regex": "",
        "skipUrlSync": False,
        "allowCustomValue": True,
        "auto": False,
        "auto_count": 30,
        "auto_min": "10s",
    }
    if multi:
        v["allValue"] = ".*"
    return v


def annotation(name: str, expr: str, color: str, title: str, text: str, tags: str) -> dict[str, Any]:
    """Events drawn on every graph of the dashboard: one mark per step where ``expr`` has a
    sample (a counter that rose), titled and tagged from the series' labels. The query is in
    the Prometheus data source's own fields (expr, step, titleFormat, ...), which Grafana's
    schema leaves to the data source."""
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "builtIn": 0,
        "expr": expr,
        "step": "1m",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": tags,
        "useValueForTime": False,
    }


# --- Node ---------------------------------------------------------------------------------------
N = 'instance=~"$instance"'
RED_AT_1 = [(None, "green"), (1, "red")]

# Job -> Node: a series (timeseries) or a row (table) that names a node opens that node's
# dashboard at the same time range.
_NODE_URL = "/d/gpuwatchd-node/gpuwatchd-node?var-instance={}&${{__url_time_range}}&${{datasource:queryparam}}"
NODE_LINK = [
    {
        "title": "Node ${__field.labels.instance}",
        "targetBlank": False,
        "url": _NODE_URL.format("${__field.labels.instance}"),
    }
]
NODE_LINK_ROW = [
    {
        "title": "Node ${__data.fields.instance}",
        "targetBlank": False,
        "url": _NODE_URL.format("${__data.fields.instance}"),
    }
]

NODE_ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Node",
        [
            Panel(
                "Ranks up",
                "stat",
                [stat(f"count(gpuwatch_rank_up{{{N}}} == 1) or vector(0)")],
                width=4,
                height=4,
                thresholds=[(None, "blue")],
            ),
            Panel(
                "Ranks down",
                "stat",
                [stat(f"count(gpuwatch_rank_up{{{N}}} == 0) or vector(0)")],
                width=4,
                height=4,
                thresholds=RED_AT_1,
            ),
            Panel(
                "Stalled ranks",
                "stat",
                [stat(f"count(gpuwatch_rank_stalled{{{N}}} == 1) or vector(0)")],
                width=4,
                height=4,
                thresholds=RED_AT_1,
            ),
            Panel(
                "OOM kills (range)",
                "stat",
                [stat(f"sum(increase(gpuwatch_oom_kills_total{{{N}}}[$__range])) or vector(0)")],
                width=4,
                height=4,
                thresholds=RED_AT_1,
                unit="none",
                description="Kernel, systemd-oomd and earlyoom kills on this node in the time range, "
                "attributed or not.",
            ),
            Panel(
                "Orphan GPU memory",
                "stat",
                [stat(f"sum(gpuwatch_orphan_gpu_memory_bytes{{{N}}}) or vector(0)")],
                width=4,
                height=4,
                unit="bytes",
                thresholds=[(None, "green"), (1, "orange")],
            ),
            Panel(
                "Findings",
                "stat",
                [stat(f"count(gpuwatch_finding{{{N}}} == 1) or vector(0)")],
                width=4,
                height=4,
                thresholds=[(None, "green"), (1, "orange")],
            ),
            Panel(
                "Active findings",
                "table",
                [table(f"gpuwatch_finding{{{N}}} == 1")],
                width=24,
                height=7,
                description="One row per active diagnosis; `gpuwatchd ps` on the node prints each one's explanation.",
            ),
        ],
    ),
    (
        "GPUs",
        [
            Panel(
                "GPU memory used",
                "timeseries",
                [
                    graph(f"gpuwatch_gpu_memory_used_bytes{{{N}}}", "GPU {{gpu}} used"),
                    graph(f"gpuwatch_gpu_memory_total_bytes{{{N}}}", "GPU {{gpu}} total"),
                ],
                unit="bytes",
                min=0,
            ),
            Panel(
                "GPU utilization",
                "timeseries",
                [graph(f"gpuwatch_gpu_utilization_ratio{{{N}}}", "GPU {{gpu}}")],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "GPU memory by rank",
                "timeseries",
                [
                    graph(
                        f"sum by (job_id, rank, gpu) (gpuwatch_rank_gpu_memory_bytes{{{N}}})",
                        "{{job_id}} rank {{rank}} GPU {{gpu}}",
                    )
                ],
                unit="bytes",
                min=0,
                description="Sum over each rank's process tree (rank and DataLoader workers).",
            ),
            Panel(
                "GPU memory held by orphans",
                "timeseries",
                [graph(f"gpuwatch_orphan_gpu_memory_bytes{{{N}}}", "GPU {{gpu}} pid {{pid}} {{comm}} ({{reason}})")],
                unit="bytes",
                min=0,
                description="Processes that hold GPU memory but belong to no live rank: "
                "`gpuwatchd check --kill` frees them.",
            ),
            Panel("GPU inventory", "table", [table(f"gpuwatch_gpu_info{{{N}}}")], width=12, height=5),
            Panel(
                "CUDA out-of-memory errors (range)",
                "stat",
                [stat(f"sum(increase(gpuwatch_cuda_oom_errors_total{{{N}}}[$__range])) or vector(0)")],
                width=12,
                height=5,
                unit="none",
                thresholds=[(None, "green"), (1, "orange")],
                description="CUDA OOM exceptions the ranks reported (GPU memory, not host memory).",
            ),
            Panel(
                "GPU processes",
                "table",
                [table(f"gpuwatch_gpu_process_memory_bytes{{{N}}}")],
                unit="bytes",
                width=24,
                height=7,
            ),
            Panel(
                "Xid errors",
                "timeseries",
                [graph(f"increase(gpuwatch_gpu_xid_errors_total{{{N}}}[$__rate_interval])", "GPU {{gpu}} Xid {{xid}}")],
                unit="none",
                width=12,
                height=6,
            ),
            Panel(
                "GPU clock throttle reasons",
                "timeseries",
                [graph(f'gpuwatch_gpu_clock_throttled{{{N},reason=~"hw_.*|sw_.*"}}', "GPU {{gpu}} {{reason}}")],
                unit="none",
                width=12,
                height=6,
                min=0,
                max=1,
                description="NVML's reasons for clocks below maximum (1 = active). hw_slowdown, "
                "hw_thermal, sw_thermal, sw_power_cap and hw_power_brake slow a busy "
                "GPU down: a rank on it becomes a straggler.",
            ),
        ],
    ),
    (
        "Ranks",
        [
            Panel(
                "Open fds / limit",
                "timeseries",
                [graph(f"gpuwatch_rank_open_fds{{{N}}} / gpuwatch_rank_max_fds{{{N}}}", "{{job_id}} rank {{rank}}")],
                unit="percentunit",
                min=0,
                max=1,
                thresholds=[(None, "green"), (0.9, "red")],
            ),
            Panel(
                "GIL held (py-spy samples)",
                "timeseries",
                [
                    graph(
                        f"rate(gpuwatch_rank_gil_held_samples_total{{{N}}}[$__rate_interval]) / "
                        f"rate(gpuwatch_rank_gil_samples_total{{{N}}}[$__rate_interval])",
                        "{{job_id}} rank {{rank}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Rank CPU",
                "timeseries",
                [graph(f"rate(gpuwatch_rank_cpu_seconds_total{{{N}}}[$__rate_interval])", "{{job_id}} rank {{rank}}")],
                unit="percentunit",
                min=0,
            ),
            Panel(
                "Rank resident memory",
                "timeseries",
                [graph(f"gpuwatch_rank_resident_memory_bytes{{{N}}}", "{{job_id}} rank {{rank}}")],
                unit="bytes",
                min=0,
            ),
            Panel(
                "Rank threads",
                "timeseries",
                [graph(f"gpuwatch_rank_threads{{{N}}}", "{{job_id}} rank {{rank}}")],
                min=0,
            ),
            Panel(
                "OOM kills",
                "timeseries",
                [graph(f"gpuwatch_oom_kills_total{{{N}}}", "{{job_id}} rank {{rank}} {{comm}} ({{killer}})")],
                unit="none",
                min=0,
            ),
            Panel(
                "Step rate per rank",
                "timeseries",
                [graph(f"deriv(gpuwatch_rank_step{{{N}}}[5m])", "{{job_id}} rank {{rank}}")],
                unit="none",
                min=0,
                width=24,
                height=6,
                description="Steps per second from each rank's heartbeat(step).",
            ),
        ],
    ),
    (
        "Host memory",
        [
            Panel(
                "Memory cgroup use / limit per rank",
                "timeseries",
                [
                    graph(
                        f"gpuwatch_rank_memory_cgroup_working_set_bytes{{{N}}} / "
                        f"gpuwatch_rank_memory_cgroup_limit_bytes{{{N}}}",
                        "{{job_id}} rank {{rank}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
                thresholds=[(None, "green"), (0.9, "red")],
                description="Working set (usage minus inactive file cache) of the memory cgroup that "
                "bounds each rank, over its limit: at 1 the kernel OOM-kills. "
                "rank_memory_pressure warns at memory.ratio_threshold or earlier when "
                "the trend reaches the limit within memory.horizon_seconds.",
            ),
            Panel(
                "Memory cgroup working set and limit",
                "timeseries",
                [
                    graph(
                        f"gpuwatch_rank_memory_cgroup_working_set_bytes{{{N}}}", "{{job_id}} rank {{rank}} working set"
                    ),
                    graph(
                        f"gpuwatch_rank_memory_cgroup_usage_bytes{{{N}}}",
                        "{{job_id}} rank {{rank}} usage (with file cache)",
                    ),
                    graph(f"gpuwatch_rank_memory_cgroup_limit_bytes{{{N}}}", "{{job_id}} rank {{rank}} limit"),
                ],
                unit="bytes",
                min=0,
            ),
            Panel(
                "Rank tree resident memory",
                "timeseries",
                [graph(f"gpuwatch_rank_tree_resident_memory_bytes{{{N}}}", "{{job_id}} rank {{rank}}")],
                unit="bytes",
                min=0,
                description="RSS of each rank's whole process tree (rank plus DataLoader workers); "
                "which worker grew is in the memory_snapshot events (gpuwatchd events).",
            ),
            Panel(
                "Memory pressure (PSI, time waiting for memory)",
                "timeseries",
                [
                    graph(
                        f"rate(gpuwatch_rank_memory_pressure_waiting_seconds_total{{{N}}}[$__rate_interval])",
                        "{{job_id}} rank {{rank}}",
                    ),
                    graph(
                        f"rate(gpuwatch_rank_memory_pressure_stalled_seconds_total{{{N}}}[$__rate_interval])",
                        "{{job_id}} rank {{rank}} (all tasks stalled)",
                    ),
                    graph(
                        f"rate(gpuwatch_node_memory_pressure_waiting_seconds_total{{{N}}}[$__rate_interval])", "node"
                    ),
                    graph(
                        f"rate(gpuwatch_node_memory_pressure_stalled_seconds_total{{{N}}}[$__rate_interval])",
                        "node (all tasks stalled)",
                    ),
                ],
                unit="percentunit",
                min=0,
                description="Share of time some task waited for memory (reclaim, swap-in): rises "
                "before an OOM kill; absent where the kernel has no PSI.",
            ),
            Panel(
                "Node memory available",
                "timeseries",
                [
                    graph(f"gpuwatch_node_memory_available_bytes{{{N}}}", "available"),
                    graph(f"gpuwatch_node_memory_total_bytes{{{N}}}", "total"),
                ],
                unit="bytes",
                min=0,
                width=24,
                height=6,
            ),
        ],
    ),
]

# --- Job ----------------------------------------------------------------------------------------
J = 'job_id=~"$job_id"'
JR = 'job_id=~"$job_id",rank=~"$rank"'  # per-rank panels follow the rank selection too
# Time at which each rank first failed in the range: dead, stalled, or OOM-killed. The earliest is
# the rank the others wait for (DESIGN §1: one rank dies, its peers hang in a collective).
FAILED_AT = (
    f"min by (job_id, instance, rank) (min_over_time(timestamp("
    f"gpuwatch_rank_up{{{J}}} == 0 or gpuwatch_rank_stalled{{{J}}} == 1"
    f" or gpuwatch_oom_kills_total{{{J}}} > 0"
    f")[$__range:$__interval]))"
)

STEP_RATE = f"deriv(gpuwatch_rank_step{{{J}}}[10m])"
# Each rank's step rate against its job's median (recorded: gpuwatchd.recording.yml), as
# GPURankStraggler compares them.
STEP_RATIO = f"{STEP_RATE} / on (job_id) group_left () job_id:gpuwatch_rank_step:deriv10m_median{{{J}}}"

JOB_ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Job",
        [
            Panel(
                "Ranks up",
                "stat",
                [stat(f"count(gpuwatch_rank_up{{{J}}} == 1) or vector(0)")],
                width=4,
                height=4,
                thresholds=[(None, "blue")],
            ),
            Panel(
                "Ranks down",
                "stat",
                [stat(f"count(gpuwatch_rank_up{{{J}}} == 0) or vector(0)")],
                width=4,
                height=4,
                thresholds=RED_AT_1,
            ),
            Panel(
                "Stalled ranks",
                "stat",
                [stat(f"count(gpuwatch_rank_stalled{{{J}}} == 1) or vector(0)")],
                width=4,
                height=4,
                thresholds=RED_AT_1,
            ),
            Panel(
                "OOM kills",
                "stat",
                [stat(f"sum(gpuwatch_oom_kills_total{{{J}}}) or vector(0)")],
                width=4,
                height=4,
                thresholds=RED_AT_1,
                unit="none",
                description="OOM kills of this job's ranks and their workers, on every node.",
            ),
            Panel(
                "Nodes",
                "stat",
                [stat(f"count(count by (instance) (gpuwatch_rank_info{{{J}}}))")],
                width=4,
                height=4,
                thresholds=[(None, "blue")],
            ),
            Panel(
                "Ranks waiting on a failed rank",
                "stat",
                [
                    stat(
                        f"(count(gpuwatch_rank_up{{{J}}} == 1) or vector(0))"
                        f" and on () (count(gpuwatch_rank_up{{{J}}} == 0)"
                        f" or count(gpuwatch_rank_stalled{{{J}}} == 1))"
                    )
                ],
                width=4,
                height=4,
                thresholds=[(None, "orange")],
                description="Live ranks while some rank is dead or stalled: they wait for it in their next collective.",
            ),
            Panel(
                "First rank to fail",
                "table",
                [table(f"bottomk(1, {FAILED_AT}) * 1000")],
                unit="dateTimeAsIso",
                width=12,
                height=5,
                description="The rank whose failure (death, OOM kill or stall) came first in the "
                "time range: the one the other ranks wait for. `gpuwatchd job JOB_ID "
                "--prometheus URL` says the same from a shell.",
            ),
            Panel(
                "Failed ranks, in order",
                "table",
                [table(f"sort({FAILED_AT}) * 1000")],
                unit="dateTimeAsIso",
                width=12,
                height=5,
            ),
            Panel(
                "Ranks",
                "table",
                [table(f"gpuwatch_rank_info{{{JR}}}")],
                width=24,
                height=8,
                description="Every registered rank of the job on every node (pid, local rank).",
            ),
            Panel(
                "Pods of the ranks",
                "table",
                [table(f"gpuwatch_rank_pod_info{{{JR}}}")],
                width=24,
                height=6,
                description="Ranks that run in Kubernetes pods, with the pod's UID from the rank's "
                "cgroup path. With kube-state-metrics in the same Prometheus, "
                "`* on (uid) group_left (namespace, pod) kube_pod_info` names the pod "
                "(docs/integration.md). Empty outside Kubernetes.",
            ),
        ],
    ),
    (
        "Rank exits and NCCL's own view",
        [
            Panel(
                "Rank exits by cause (range)",
                "table",
                [table(f"sum by (instance, rank, cause) (max_over_time(gpuwatch_rank_exits_total{{{JR}}}[$__range]))")],
                unit="none",
                width=12,
                height=6,
                description="Every exit of a rank of the job, by cause (exit_0, exit_nonzero, the "
                "signal, oom_kill, unknown), read the moment it ended. `gpuwatchd events` "
                "on the node says which rank failed first and which were torn down after "
                "it (docs/runbooks.md#rank-exits).",
            ),
            Panel(
                "NCCL RAS: the culprit",
                "table",
                [table(f"gpuwatch_nccl_ras_culprit{{{J}}} == 1")],
                width=12,
                height=6,
                description="The ranks NCCL's RAS names when the job's counts stop: dead, "
                "unresponsive, or behind (lowest operation count), with host and pid, as "
                "seen from each node. Asked only for suspect jobs (docs/runbooks.md).",
            ),
            Panel(
                "NCCL RAS: collective operations per rank",
                "timeseries",
                [graph(f"gpuwatch_nccl_ras_rank_operations{{{JR}}}", "rank {{rank}} ({{instance}})")],
                unit="none",
                min=0,
                description="Collective operations each local rank has issued, per NCCL RAS, while "
                "the job is suspect: moving counts mean the job progresses.",
            ),
            Panel(
                "NCCL RAS: seconds since the counts moved",
                "timeseries",
                [graph(f"gpuwatch_nccl_ras_rank_operations_unchanged_seconds{{{JR}}}", "rank {{rank}} ({{instance}})")],
                unit="s",
                min=0,
            ),
            Panel(
                "NCCL RAS: missing ranks and async errors",
                "timeseries",
                [
                    graph(f"gpuwatch_nccl_ras_missing_ranks{{{J}}}", "missing: {{reason}} ({{instance}})"),
                    graph(f"gpuwatch_nccl_ras_async_error_ranks{{{J}}}", "async error ({{instance}})"),
                ],
                unit="none",
                min=0,
                width=24,
                height=6,
            ),
        ],
    ),
    (
        "State over time",
        [
            Panel(
                "Ranks up / down",
                "timeseries",
                [
                    graph(f"count(gpuwatch_rank_up{{{J}}} == 1) or vector(0)", "up"),
                    graph(f"count(gpuwatch_rank_up{{{J}}} == 0) or vector(0)", "down"),
                ],
                min=0,
            ),
            Panel(
                "Stalled, per rank",
                "timeseries",
                [graph(f"gpuwatch_rank_stalled{{{JR}}}", "rank {{rank}} ({{instance}})")],
                min=0,
                max=1,
            ),
            Panel(
                "OOM kills by rank",
                "timeseries",
                [graph(f"gpuwatch_oom_kills_total{{{JR}}}", "rank {{rank}} {{comm}} ({{killer}}, {{instance}})")],
                unit="none",
                min=0,
            ),
            Panel("Active findings", "table", [table(f"gpuwatch_finding{{{J}}} == 1")]),
            Panel(
                "Time since last progress",
                "timeseries",
                [graph(f"time() - gpuwatch_rank_progress_timestamp_seconds{{{JR}}}", "rank {{rank}} ({{instance}})")],
                unit="s",
                min=0,
                description="Age of each rank's last heartbeat / observed progress; a rank is "
                "stalled when this passes stall.after_seconds.",
            ),
            Panel(
                "CUDA out-of-memory errors",
                "stat",
                [stat(f"sum(gpuwatch_cuda_oom_errors_total{{{J}}}) or vector(0)")],
                unit="none",
                thresholds=[(None, "green"), (1, "orange")],
                description="CUDA OOM exceptions the job's ranks reported (GPU memory).",
            ),
        ],
    ),
    (
        "Progress and stragglers",
        [
            Panel(
                "Step rate per rank",
                "timeseries",
                [graph(f"deriv(gpuwatch_rank_step{{{JR}}}[5m])", "rank {{rank}} ({{instance}})")],
                unit="none",
                min=0,
                description="Steps per second from each rank's gpuwatchd.heartbeat(step).",
            ),
            Panel(
                "Step rate / job median",
                "timeseries",
                [graph(STEP_RATIO, "rank {{rank}} ({{instance}})")],
                unit="percentunit",
                min=0,
                thresholds=[(None, "red"), (0.8, "green")],
                description="Each rank's step rate over 10 m against the job's median across all "
                "nodes: below 0.8 for 10 m is the straggler (alert GPURankStraggler; "
                "the node's rank_straggler finding names the cause).",
            ),
            Panel(
                "Slowest ranks",
                "table",
                [table(f"bottomk(3, {STEP_RATIO})")],
                unit="percentunit",
                description="The three ranks furthest below the job's median step rate.",
            ),
            Panel(
                "Collective sequence per rank",
                "table",
                [
                    table(f"gpuwatch_rank_collective_last_started_seq{{{JR}}}", "entered"),
                    table(f"gpuwatch_rank_collective_last_completed_seq{{{JR}}}", "completed"),
                ],
                description="Last collective each rank entered (flight recorder, read when the job "
                "looks stalled): the rank with the lowest number never entered the "
                "collective its peers wait in.",
            ),
        ],
    ),
    (
        "Resources",
        [
            Panel(
                "GPU memory per rank",
                "timeseries",
                [graph(f"gpuwatch_rank_gpu_memory_bytes{{{JR}}}", "rank {{rank}} GPU {{gpu}} ({{instance}})")],
                unit="bytes",
                min=0,
            ),
            Panel(
                "GIL held per rank",
                "timeseries",
                [
                    graph(
                        f"rate(gpuwatch_rank_gil_held_samples_total{{{JR}}}[5m])"
                        f" / rate(gpuwatch_rank_gil_samples_total{{{JR}}}[5m])",
                        "rank {{rank}} ({{instance}})",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Open fds / limit per rank",
                "timeseries",
                [
                    graph(
                        f"gpuwatch_rank_open_fds{{{JR}}} / gpuwatch_rank_max_fds{{{JR}}}",
                        "rank {{rank}} ({{instance}})",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
                thresholds=[(None, "green"), (0.9, "red")],
            ),
            Panel(
                "Resident memory per rank",
                "timeseries",
                [graph(f"gpuwatch_rank_resident_memory_bytes{{{JR}}}", "rank {{rank}} ({{instance}})")],
                unit="bytes",
                min=0,
            ),
        ],
    ),
]

# --- gpuwatchd health ---------------------------------------------------------------------------
UPJ = 'job=~"$job"'  # the Health dashboard's scrape-job variable


def nonzero(counter: str, label: str) -> str:
    """A fleet-wide graph of a rarely rising counter: only the nodes where it rose, a 0 line while
    none did. Filtering before the sum keeps it under 1 s at 1,250 nodes x several label values
    (bench/fleet_prometheus.py); thousands of flat 0 lines would say nothing more."""
    return f"sum by (instance, {label}) (increase({counter}[$__rate_interval]) > 0) or on () vector(0)"


HEALTH_ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Daemons",
        [
            Panel(
                "Daemons scraped", "stat", [stat(f"sum(up{{{UPJ}}})")], width=6, height=4, thresholds=[(None, "blue")]
            ),
            Panel(
                "Daemons down",
                "stat",
                [stat(f"count(up{{{UPJ}}} == 0) or vector(0)")],
                width=6,
                height=4,
                thresholds=RED_AT_1,
            ),
            Panel(
                "Failing collectors",
                "stat",
                [stat("count(gpuwatch_collector_success == 0) or vector(0)")],
                width=6,
                height=4,
                thresholds=[(None, "green"), (1, "orange")],
            ),
            Panel("Versions", "table", [table("count by (version) (gpuwatch_build_info)")], width=6, height=4),
        ],
    ),
    (
        "Collectors",
        [
            Panel(
                "Nodes with a failing collector",
                "timeseries",
                [graph("collector:gpuwatch_collector_success:failing_count", "{{collector}}")],
                min=0,
                description="Nodes whose collector's last run failed, per collector; the "
                'table "Collectors, failing first" names them.',
            ),
            Panel(
                "Collector duration (slowest node)",
                "timeseries",
                [graph("collector:gpuwatch_collector_duration_seconds:max", "{{collector}}")],
                unit="s",
                min=0,
            ),
            Panel(
                "Time since last success (oldest node)",
                "timeseries",
                [graph("collector:gpuwatch_collector_last_success_timestamp_seconds:max_age", "{{collector}}")],
                unit="s",
                min=0,
            ),
            Panel(
                "Collectors, failing first",
                "table",
                [table("sort(gpuwatch_collector_success)")],
                description="1: the collector's last run succeeded; 0: it failed (or its source "
                "is absent on this node, e.g. nvml without a driver).",
            ),
        ],
    ),
    (
        "Daemon footprint",
        [
            Panel(
                "Daemon resident memory (10 largest)",
                "timeseries",
                [graph(f"topk(10, process_resident_memory_bytes{{{UPJ}}})", "{{instance}}")],
                unit="bytes",
                min=0,
                description="RSS of the daemon itself (budget: 60 MB at 64 watched processes; the "
                "unit's MemoryMax=256M, the pod's memory limit).",
            ),
            Panel(
                "Daemon memory / its limit (10 highest)",
                "timeseries",
                [
                    graph(
                        f"topk(10, process_resident_memory_bytes{{{UPJ}}} / on (instance, job) "
                        f"gpuwatch_process_memory_limit_bytes)",
                        "{{instance}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
                thresholds=[(None, "green"), (0.8, "orange")],
                description="RSS over the memory limit of the daemon's own cgroup: "
                "GpuwatchdMemoryHigh fires above 0.8 for 15 minutes. Empty where the "
                "daemon runs without a limit.",
            ),
            Panel(
                "Daemon CPU (10 busiest)",
                "timeseries",
                [graph(f"topk(10, rate(process_cpu_seconds_total{{{UPJ}}}[$__rate_interval]))", "{{instance}}")],
                unit="percentunit",
                min=0,
                description="CPU of the daemon (share of one core; budget 0.5 % at a 5 s cycle, "
                "the unit's CPUQuota=25 %). py-spy samples run as its children and "
                "are not in this number.",
            ),
            Panel(
                "Cycle duration (10 slowest)",
                "timeseries",
                [graph("topk(10, gpuwatch_cycle_duration_seconds)", "{{instance}}")],
                unit="s",
                min=0,
            ),
            Panel(
                "Daemon open fds (10 most)",
                "timeseries",
                [graph(f"topk(10, process_open_fds{{{UPJ}}})", "{{instance}}")],
                min=0,
            ),
            Panel(
                "Daemon restarts (range)",
                "stat",
                [stat(f"sum(changes(process_start_time_seconds{{{UPJ}}}[$__range])) or vector(0)")],
                unit="none",
                thresholds=[(None, "green"), (1, "orange")],
                description="Restarts of the daemons in the time range (watchdog, OOM kill, upgrade).",
            ),
        ],
    ),
    (
        "Cycle and scrape",
        [
            Panel(
                "Time since last cycle",
                "timeseries",
                [graph("time() - gpuwatch_last_cycle_timestamp_seconds", "{{instance}}")],
                unit="s",
                min=0,
                description="GpuwatchdCycleStopped fires when a daemon's last cycle stops moving "
                "for 5 minutes; /-/healthy answers 503 after two intervals plus 30 s.",
            ),
            Panel(
                "Scrape duration",
                "timeseries",
                [graph(f"scrape_duration_seconds{{{UPJ}}}", "{{instance}}")],
                unit="s",
                min=0,
            ),
            Panel(
                "Series per scrape", "timeseries", [graph(f"scrape_samples_scraped{{{UPJ}}}", "{{instance}}")], min=0
            ),
        ],
    ),
    (
        "Errors",
        [
            Panel(
                "Kernel log overruns",
                "timeseries",
                [graph("increase(gpuwatch_kernel_log_overruns_total[$__rate_interval])", "{{instance}}")],
                unit="none",
                min=0,
                description="/dev/kmsg ring overruns (EPIPE): kernel lines lost before gpuwatchd read them.",
            ),
            Panel(
                "Rejected kernel log records (range)",
                "stat",
                [
                    stat(
                        "sum by (reason) (increase(gpuwatch_kernel_log_lines_rejected_total[$__range])) or vector(0)",
                        "{{reason}}",
                    )
                ],
                unit="none",
                description="Malformed or too long records, and userspace writes to /dev/kmsg that "
                "looked like an OOM kill or Xid (not_kernel).",
            ),
            Panel(
                "Dropped /metrics connections",
                "timeseries",
                [graph(nonzero("gpuwatch_web_connections_dropped_total", "reason"), "{{instance}} {{reason}}")],
                unit="none",
                min=0,
                description="Connections the /metrics server closed unanswered: limit (the oldest "
                "waiting one made room), timeout, no_thread. A steady rise is a client "
                "holding connections open (slowloris); scrapes are still answered.",
            ),
            Panel(
                "Bad rank files",
                "table",
                [table('gpuwatch_finding{kind="bad_rank_file"} == 1')],
                description="Rank files the daemon rejected (schema, owner, symlink, size).",
            ),
            Panel(
                "State file write errors",
                "timeseries",
                [graph(nonzero("gpuwatch_state_write_errors_total", "file"), "{{instance}} {{file}}")],
                unit="none",
                min=0,
                description="Failed writes of state_dir files (disk full, read-only): OOM kills are "
                "still counted, but not persisted across a restart.",
            ),
            Panel(
                "Rejected state file records",
                "stat",
                [
                    stat(
                        "sum by (file, reason) (max_over_time(gpuwatch_state_records_rejected_total"
                        "[$__range])) or vector(0)",
                        "{{file}} {{reason}}",
                    )
                ],
                unit="none",
                description="Lines of state_dir files (events.jsonl, rank_trees.json) that could not "
                "be used and were skipped when the daemon started (counted before the "
                "first scrape, so the counter's value, not its increase).",
            ),
            Panel(
                "Deferred stall probes",
                "timeseries",
                [graph(nonzero("gpuwatch_cycle_deferred_probes_total", "probe"), "{{instance}} {{probe}}")],
                unit="none",
                min=0,
                description="Per-thread looks and py-spy dumps that the cycle's time budget moved to "
                "a later cycle: a node whose ranks have very many threads or listings. "
                "Cycles keep finishing; stall verdicts of those ranks come later.",
            ),
            Panel(
                "gpuwatchd's own helpers OOM-killed",
                "timeseries",
                [graph(nonzero("gpuwatch_helper_oom_kills_total", "helper"), "{{instance}} {{helper}}")],
                unit="none",
                min=0,
                description="Kernel OOM kills of the daemon's own py-spy runs: the monitor's "
                "helpers, never counted as the node's OOM kills. Each run is killed by "
                "the daemon itself at 64 MiB RSS, so this stays 0 unless MemoryMax is "
                "lowered.",
            ),
            Panel(
                "Last config reload",
                "stat",
                [
                    stat("gpuwatch_config_last_reload_successful", "{{instance}}"),
                    stat(
                        "time() - gpuwatch_config_last_reload_success_timestamp_seconds",
                        "{{instance}} seconds since the last good load",
                    ),
                ],
                unit="none",
                thresholds=[(None, "red"), (1, "green")],
                description="1 when the last load of the config file (start or SIGHUP) succeeded; "
                "0 when a reload was refused and the old config still runs (the log "
                "names every bad key). gpuwatch_config_last_reload_success_timestamp_"
                "seconds says when it last succeeded.",
            ),
            Panel(
                "Daemon oom_score_adj",
                "stat",
                [stat("gpuwatch_process_oom_score_adj", "{{instance}}")],
                unit="none",
                description="The daemon's own /proc/self/oom_score_adj: -900 when the unit's "
                "OOMScoreAdjust took effect, so the kernel kills a rank, not the monitor.",
            ),
        ],
    ),
]


OOM_TEXT = "{{job_id}} rank {{rank}}: {{comm}} killed by the {{killer}} OOM killer"
XID_TEXT = "GPU {{gpu}} ({{uuid}}) Xid {{xid}} on {{instance}}"
NODE_ANNOTATIONS = [
    annotation(
        "OOM kills", f"changes(gpuwatch_oom_kills_total{{{N}}}[1m]) > 0", "red", "OOM kill", OOM_TEXT, "job_id,rank"
    ),
    annotation(
        "Xid errors",
        f"changes(gpuwatch_gpu_xid_errors_total{{{N}}}[1m]) > 0",
        "orange",
        "Xid {{xid}}",
        XID_TEXT,
        "gpu,xid",
    ),
]
JOB_ANNOTATIONS = [
    annotation(
        "OOM kills", f"changes(gpuwatch_oom_kills_total{{{J}}}[1m]) > 0", "red", "OOM kill", OOM_TEXT, "job_id,rank"
    ),
    # Xids of the GPUs of the job's nodes (an Xid names a GPU, not a rank)
    annotation(
        "Xid errors",
        f"changes(gpuwatch_gpu_xid_errors_total[1m]) > 0 and on (instance) "
        f"count by (instance) (gpuwatch_rank_info{{{J}}})",
        "orange",
        "Xid {{xid}}",
        XID_TEXT,
        "gpu,xid",
    ),
]


def with_node_links(rows: list[tuple[str, list[Panel]]]) -> list[tuple[str, list[Panel]]]:
    """The rows with a link to the Node dashboard on every panel whose series or rows name a
    node: timeseries with {{instance}} in a legend, and tables."""
    for _, panels in rows:
        for p in panels:
            if p.kind == "table":
                p.links = NODE_LINK_ROW
            elif p.kind == "timeseries" and any("{{instance}}" in t.legend for t in p.targets):
                p.links = NODE_LINK
    return rows


def build() -> dict[str, dict[str, Any]]:
    return {
        "gpuwatchd-node.json": dashboard(
            "gpuwatchd-node",
            "gpuwatchd / Node",
            "One GPU node: GPUs, GPU memory by rank and by orphan, fds, GIL, OOM kills, findings.",
            [query_var("instance", "Node", "label_values(gpuwatch_build_info, instance)", multi=True)],
            NODE_ROWS,
            ["node"],
            NODE_ANNOTATIONS,
        ),
        "gpuwatchd-job.json": dashboard(
            "gpuwatchd-job",
            "gpuwatchd / Job",
            "One training job across every node: ranks up/down/stalled/OOM-killed, the first rank "
            "to fail, per-rank GPU memory, GIL and fds.",
            [
                query_var("job_id", "Job", "label_values(gpuwatch_rank_info, job_id)", multi=True),
                query_var("rank", "Rank", 'label_values(gpuwatch_rank_info{job_id=~"$job_id"}, rank)', multi=True),
            ],
            with_node_links(JOB_ROWS),
            ["job"],
            JOB_ANNOTATIONS,
        ),
        "gpuwatchd-health.json": dashboard(
            "gpuwatchd-health",
            "gpuwatchd / Daemon health",
            "The daemons themselves: scrapes, collectors, cycle time, errors.",
            # the jobs that scrape a gpuwatchd, by its own series: any job name (the rules'
            # selector is the user's to set), where a name pattern found only gpuwatchd-ish ones
            [query_var("job", "Scrape job", "label_values(gpuwatch_build_info, job)", multi=True)],
            HEALTH_ROWS,
            ["health"],
        ),
    }


def render(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    stale = []
    for name, d in build().items():
        path = args.out / name
        text = render(d)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale, run tools/gen_dashboards.py: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
