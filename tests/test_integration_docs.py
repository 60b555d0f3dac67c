"""docs/integration.md: every recipe that joins gpuwatchd's series with another exporter's,
evaluated by promtool against series shaped as that exporter writes them (labels from each
exporter's own documentation), so the recipes are true as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from promstack import PROMTOOL, REPO, run

DOC = REPO / "docs" / "integration.md"
UUID = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
POD = "0b8d1c2e-3f4a-4b5c-8d6e-7f8091a2b3c4"

GW = {"instance": "node1:9863", "job": "gpuwatchd"}
DCGM = {"instance": "10.1.2.3:9400", "job": "dcgm-exporter", "modelName": "NVIDIA H200", "Hostname": "node1"}
KSM = {"instance": "10.0.0.9:8080", "job": "kube-state-metrics"}
SJE = {"instance": "node1:9798", "job": "slurm-job-exporter"}
KPS_NODE = {
    "job": "node-exporter",
    "namespace": "monitoring",
    "pod": "kps-prometheus-node-exporter-x1",
    "service": "kps-prometheus-node-exporter",
    "endpoint": "http-metrics",
    "container": "node-exporter",
}


def s(metric: str, values: str, *common: dict[str, str], **labels: str) -> tuple[str, str]:
    """One promtool input series: the metric, its labels (common sets first), its values."""
    merged = {k: v for c in common for k, v in c.items()} | labels
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in merged.items()) + "}", values


def lab(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


OOM = {"comm": "python", "killer": "kernel"}
# recipe -> (input series, the samples it must return)
CASES: dict[str, tuple[list[tuple[str, str]], list[tuple[str, float]]]] = {
    "dcgm": (
        [
            s("gpuwatch_rank_gpu_memory_bytes", "1e9x5", GW, job_id="llm-7", rank="3", gpu="1"),
            s("gpuwatch_gpu_info", "1x5", GW, gpu="1", uuid=UUID, name="NVIDIA H200"),
            s("gpuwatch_gpu_info", "1x5", GW, gpu="0", uuid="GPU-other", name="NVIDIA H200"),
            s("DCGM_FI_PROF_SM_ACTIVE", "0.42x5", DCGM, gpu="1", UUID=UUID),
            s("DCGM_FI_PROF_SM_ACTIVE", "0.9x5", DCGM, gpu="0", UUID="GPU-other"),
        ],
        [(lab(job_id="llm-7", rank="3", uuid=UUID), 0.42)],
    ),
    "node": (
        [
            s("gpuwatch_rank_stalled", "1x5", GW, job_id="llm-7", rank="3"),
            s("gpuwatch_rank_stalled", "0x5", GW, instance="node2:9863", job_id="llm-7", rank="4"),
            s("node_memory_MemAvailable_bytes", "5e9x5", instance="node1:9100", job="node"),
            s("node_memory_MemAvailable_bytes", "7e9x5", instance="node2:9100", job="node"),
        ],
        [(lab(instance="node1:9863", job="gpuwatchd", job_id="llm-7", rank="3", node="node1"), 5e9)],
    ),
    # kube-prometheus-stack: its node-exporter ServiceMonitor keeps instance="<host IP>:9100"
    # (relabelings: [] in its values), while this repository's PodMonitor names gpuwatchd's
    # instance after the node; node_uname_info carries the node's host name
    "node_kps": (
        [
            s("gpuwatch_rank_stalled", "1x5", GW, instance="node1", node="node1", job_id="llm-7", rank="3"),
            s("gpuwatch_rank_stalled", "0x5", GW, instance="node2", node="node2", job_id="llm-7", rank="4"),
            s("node_memory_MemAvailable_bytes", "5e9x5", KPS_NODE, instance="10.0.0.11:9100"),
            s("node_memory_MemAvailable_bytes", "7e9x5", KPS_NODE, instance="10.0.0.12:9100"),
            s("node_uname_info", "1x5", KPS_NODE, instance="10.0.0.11:9100", nodename="node1"),
            s("node_uname_info", "1x5", KPS_NODE, instance="10.0.0.12:9100", nodename="node2"),
        ],
        [(lab(instance="node1", node="node1", job="gpuwatchd", job_id="llm-7", rank="3", nodename="node1"), 5e9)],
    ),
    "pods": (
        [
            s("gpuwatch_rank_pod_info", "1x5", GW, instance="node1", job_id="llm-7", rank="0", uid=POD),
            s("gpuwatch_rank_up", "0x5", GW, instance="node1", job_id="llm-7", rank="0"),
            s("gpuwatch_rank_up", "1x5", GW, instance="node1", job_id="llm-7", rank="1"),
            s("kube_pod_info", "1x5", KSM, namespace="team-a", pod="llm-7-worker-0", uid=POD, node="node1"),
        ],
        [
            (
                lab(
                    instance="node1",
                    job="gpuwatchd",
                    job_id="llm-7",
                    rank="0",
                    uid=POD,
                    namespace="team-a",
                    pod="llm-7-worker-0",
                ),
                0,
            )
        ],
    ),
    "slurm": (
        [
            s("gpuwatch_oom_kills_total", "0 0 1 1 1 1 1 1", GW, OOM, job_id="1234.0", rank="3"),
            s("gpuwatch_oom_kills_total", "0 0 0 1 1 1 1 1", GW, OOM, instance="node2:9863", job_id="1234.0", rank="9"),
            s("gpuwatch_oom_kills_total", "0x7", GW, OOM, job_id="1300", rank="0"),
            s("slurm_job_memory_usage", "1e9x7", SJE, slurmjobid="1234", user="alice", account="llm"),
            s("slurm_job_memory_usage", "1e9x7", SJE, slurmjobid="1300", user="bob", account="vision"),
        ],
        [
            (lab(slurmjobid="1234", account="llm", user="alice"), 2.0),
            (lab(slurmjobid="1300", account="vision", user="bob"), 0.0),
        ],
    ),
}


def recipes() -> dict[str, str]:
    text = DOC.read_text()
    return dict(re.findall(r"<!-- recipe: (\w+) -->\n```promql\n(.*?)```", text, re.S))


def test_every_recipe_is_tested() -> None:
    assert set(recipes()) == set(CASES)


def test_recipes_join_as_documented(tmp_path: Path) -> None:
    tests: list[dict[str, Any]] = []
    for name, expr in recipes().items():
        series, want = CASES[name]
        tests.append(
            {
                "name": name,
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "6m",
                        "exp_samples": [{"labels": lab, "value": val} for lab, val in want],
                    }
                ],
            }
        )
    (tmp_path / "recipes.test.yml").write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": tests}))
    p = run([PROMTOOL, "test", "rules", "recipes.test.yml"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_kube_prometheus_stack_node_exporter_does_not_share_the_instance(tmp_path: Path) -> None:
    """Why the node_kps recipe: joined on instance as they are, kube-prometheus-stack's
    node-exporter series (instance "<host IP>:9100") meet no gpuwatchd series (instance the node
    name, from the PodMonitor); docs/integration.md said the two "match as they are"."""
    series, _ = CASES["node_kps"]
    tests = [
        {
            "name": "naive",
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "promql_expr_test": [
                {
                    "expr": "gpuwatch_rank_stalled == 1 and on (instance) node_memory_MemAvailable_bytes",
                    "eval_time": "4m",
                    "exp_samples": [],
                }
            ],
        }
    ]
    (tmp_path / "naive.test.yml").write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": tests}))
    p = run([PROMTOOL, "test", "rules", "naive.test.yml"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
