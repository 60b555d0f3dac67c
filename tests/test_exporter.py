"""The exposition: linted by the real promtool, documented in docs/metrics.md, robust per family."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.exporter.process import process_families
from gpuwatchd.model import (
    CollectorStatus,
    Finding,
    GpuDevice,
    GpuProcessRow,
    NodeMemoryState,
    NodeState,
    Orphan,
    ProcessInfo,
    RankMemory,
    RankState,
)
from gpuwatchd.model.collectives import CollectiveStatus
from gpuwatchd.model.nccl_ras import RasRankStatus

REPO = Path(__file__).resolve().parent.parent
POD_UID = "0b8d1c2e-3f4a-4b5c-8d6e-7f8091a2b3c4"


def full_state() -> tuple[NodeState, CounterStore]:
    p = ProcessInfo(
        pid=10,
        ppid=1,
        comm="python",
        state="S",
        uid=0,
        user="root",
        start_ticks=1,
        start_time=1.0,
        cpu_seconds=2.5,
        rss_bytes=1 << 30,
        threads=40,
        open_fds=900,
        max_fds_soft=1024,
        max_fds_hard=4096,
    )
    ranks = (
        RankState(
            "llm-7",
            0,
            10,
            0,
            2,
            True,
            p,
            (10, 11),
            ("0",),
            1700000000.0,
            True,
            step=1200,
            container=f"Kubernetes pod {POD_UID}",
        ),
        RankState("llm-7", 1, 12, 1, 2, False, None, died_at=1700000001.0),
    )
    gpus = (
        GpuDevice(0, "GPU-a", "NVIDIA H200", "00000000:3B:00.0", 150 << 30, 60 << 30, 0.97, throttle_reasons=0x44),
        GpuDevice(1, "GPU-b", "NVIDIA H200", "00000000:3C:00.0", None, None, None),
    )
    rows = (
        GpuProcessRow(0, "GPU-a", 10, 40 << 30, "python", "root", "llm-7", "0"),
        GpuProcessRow(0, "GPU-a", 11, 1 << 30, "pt_data_worker", "root", "llm-7", "0"),
        GpuProcessRow(0, "GPU-a", 30, 55 << 30, "python", "alice", "", ""),
        GpuProcessRow(1, "GPU-b", 31, None, "python", "bob", "", ""),
    )
    orphans = (Orphan(0, "GPU-a", 30, 55 << 30, "python", "alice", "reparented_to_init", 1.0),)
    findings = (
        Finding("rank_down", "page", "rank 1 ...", "llm-7", "1", "12"),
        Finding("bad_rank_file", "info", "a"),
        Finding("bad_rank_file", "info", "b"),
    )
    collectors = (
        CollectorStatus("procfs", True, 0.001, 1700000000.0),
        CollectorStatus("nvml", False, 0.0, None, "not present"),
    )
    counters = CounterStore()
    counters.inc("oom_kills", ("llm-7", "1", "python", "kernel"))
    counters.inc("oom_kills", ("", "", "stress", "earlyoom"))
    counters.inc("helper_oom_kills", ("py-spy", "kernel"))
    counters.inc("rank_exits", ("llm-7", "1", "SIGSEGV"))
    counters.inc("gpu_xid_errors", ("0", "GPU-a", "79"))
    counters.inc("cuda_oom_errors", ("llm-7", "0", "0"))
    counters.inc("rank_gil_samples", ("llm-7", "0"), 249)
    counters.inc("rank_gil_held_samples", ("llm-7", "0"), 240)
    counters.inc("kernel_log_overruns")
    counters.inc("kernel_log_lines_rejected", ("not_kernel_facility",))
    counters.inc("cycle_deferred_probes", ("threads",), 3)
    counters.inc("web_connections_dropped", ("limit",))
    memory = (
        RankMemory(
            "llm-7",
            0,
            10,
            3 << 30,
            1e6,
            cgroup="/slurm/job_7",
            cgroup_version=2,
            usage_bytes=75 << 30,
            working_set_bytes=74 << 30,
            limit_bytes=80 << 30,
            high_bytes=78 << 30,
            pressure_some_seconds=12.5,
            pressure_full_seconds=1.5,
        ),
    )
    node = NodeMemoryState(2 << 40, 40 << 30, 0.01, 100.0, 20.0)
    counters.inc("state_write_errors", ("state.json",))
    counters.inc("state_records_rejected", ("events.jsonl", "malformed"))
    state = NodeState(
        timestamp=1700000002.0,
        ranks=ranks,
        gpus=gpus,
        gpu_processes=rows,
        orphans=orphans,
        findings=findings,
        collectors=collectors,
        cycle_seconds=0.004,
        rank_memory=memory,
        node_memory=node,
        collectives=(CollectiveStatus("llm-7", 0, 10, "0", 5, 4, "nccl:all_reduce"),),
        nccl_ras=(
            RasRankStatus(
                "llm-7",
                0,
                10,
                0,
                10239,
                {"AllReduce": 10234},
                90.0,
                100.0,
                dead=1,
                culprits=((3, "10.1.0.5", 4104, "dead"),),
            ),
        ),
        oom_score_adj=-900,
        memory_limit_bytes=256 << 20,
    )
    return state, counters


def exposition(state: NodeState | None, counters: CounterStore) -> str:
    # the daemon's config-reload status (a refused SIGHUP: tests/test_logs.py)
    return generate_latest(make_registry(lambda: state, counters, config_reload=lambda: (True, 1.0))).decode()


def names(text: str) -> set[str]:
    out = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.add(s.name.removesuffix("_created"))
    return out


def documented() -> set[str]:
    doc = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `((?:gpuwatch|process)_[a-z_]+)` \|", doc, re.M))


def test_promtool_lints_the_real_exposition() -> None:
    state, counters = full_state()
    text = exposition(state, counters)
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is part of the test dependencies"
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_docs_list_exactly_what_is_exported() -> None:
    state, counters = full_state()
    exported = names(exposition(state, counters))
    assert exported - documented() == set(), "exported but not in docs/metrics.md"
    assert documented() - exported == set(), "documented but never exported"


def test_values_and_labels() -> None:
    state, counters = full_state()
    text = exposition(state, counters)
    assert 'gpuwatch_rank_up{job_id="llm-7",rank="1"} 0.0' in text
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert values[("gpuwatch_rank_gpu_memory_bytes", (("gpu", "0"), ("job_id", "llm-7"), ("rank", "0")))] == 41 << 30
    assert 'gpuwatch_orphan_gpu_memory_bytes{comm="python",gpu="0",pid="30",reason="reparented_to_init",' in text
    assert 'pid="31"' not in text  # N/A memory is not exported as 0
    assert text.count('gpuwatch_finding{job_id="",kind="bad_rank_file"') == 1  # one per label set
    # the live rank's OOM series exists at 0 before its first kill
    assert 'gpuwatch_oom_kills_total{comm="python",job_id="llm-7",killer="kernel",rank="0"} 0.0' in text
    assert 'gpuwatch_oom_kills_total{comm="python",job_id="llm-7",killer="kernel",rank="1"} 1.0' in text
    assert "hostname" not in text and 'job="' not in text


def test_rank_pod_info_joins_kube_state_metrics_on_uid(tmp_path: Path) -> None:
    """A rank in a pod gets gpuwatch_rank_pod_info{job_id,rank,uid}; promtool proves that
    `on (uid) group_left (namespace, pod) kube_pod_info` names the pod of a down rank, with
    kube-state-metrics' own labels (its job and instance differ from the daemon's)."""
    state, counters = full_state()
    text = exposition(state, counters)
    assert f'gpuwatch_rank_pod_info{{job_id="llm-7",rank="0",uid="{POD_UID}"}} 1.0' in text
    assert 'gpuwatch_rank_pod_info{job_id="llm-7",rank="1"' not in text  # not in a pod
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'gpuwatch_rank_pod_info{{instance="node1",job="gpuwatchd",job_id="llm-7",'
                        f'rank="0",uid="{POD_UID}"}}',
                        "values": "1x3",
                    },
                    {
                        "series": 'gpuwatch_rank_up{instance="node1",job="gpuwatchd",job_id="llm-7",rank="0"}',
                        "values": "0x3",
                    },
                    {
                        "series": f'kube_pod_info{{instance="10.0.0.9:8080",job="kube-state-metrics",'
                        f'namespace="team-a",pod="llm-7-worker-0",uid="{POD_UID}",node="node1"}}',
                        "values": "1x3",
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": "(gpuwatch_rank_up == 0) * on (instance, job_id, rank) group_left (uid) "
                        "gpuwatch_rank_pod_info * on (uid) group_left (namespace, pod) "
                        "max by (uid, namespace, pod) (kube_pod_info)",
                        "eval_time": "2m",
                        "exp_samples": [
                            {
                                "labels": '{instance="node1",job="gpuwatchd",job_id="llm-7",'
                                f'rank="0",uid="{POD_UID}",namespace="team-a",'
                                'pod="llm-7-worker-0"}',
                                "value": 0,
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "join.test.yml").write_text(yaml.safe_dump(tests))
    promtool = shutil.which("promtool")
    assert promtool
    r = subprocess.run([promtool, "test", "rules", "join.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dead_process_series_vanish_with_fresh_families() -> None:
    state, counters = full_state()
    reg_state = {"s": state}
    reg = make_registry(lambda: reg_state["s"], counters)
    assert 'pid="11"' in generate_latest(reg).decode()
    reg_state["s"] = NodeState(timestamp=2.0)
    after = generate_latest(reg).decode()
    assert 'pid="11"' not in after
    assert not [line for line in after.splitlines() if line.startswith("gpuwatch_rank_up")]


def test_one_broken_family_does_not_break_the_scrape() -> None:
    state, counters = full_state()
    broken = GpuDevice(0, "GPU-x", "x", "x", 1, 1, 0.5)
    object.__setattr__(broken, "index", object())  # a reading no label can be made of
    object.__setattr__(broken, "memory_total_bytes", "not a number")
    from dataclasses import replace

    text = exposition(replace(state, gpus=(broken,)), counters)
    assert "gpuwatch_rank_up" in text and "gpuwatch_build_info" in text
    assert "gpuwatch_gpu_memory_total_bytes{" not in text


def test_scrape_before_first_cycle() -> None:
    text = exposition(None, CounterStore())
    assert "gpuwatch_build_info" in text


def test_fast_renderer_equals_prometheus_client_and_passes_promtool() -> None:
    state, counters = full_state()
    # one reading of the daemon's own process_* families for both renderings (CI: the CPU
    # seconds read twice moved by a tick between them, 14.71 against 14.72)
    own = process_families()
    reg = make_registry(lambda: state, counters, lambda: own)
    fast = reg.encode_text().decode()
    ref = generate_latest(reg).decode()

    def parsed(text: str) -> dict:
        return {
            (
                f.name,
                f.type,
                f.documentation,
                tuple((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples),
            )
            for f in text_string_to_metric_families(text)
        }

    assert parsed(fast) == parsed(ref)
    r = subprocess.run(
        [shutil.which("promtool") or "promtool", "check", "metrics"], input=fast, capture_output=True, text=True
    )
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_rendered_scrape_is_reused_until_state_or_counters_change() -> None:
    state, counters = full_state()
    holder = {"s": state}
    reg = make_registry(lambda: holder["s"], counters)
    first = reg.encode_text()
    assert reg.encode_text() is first
    counters.inc("oom_kills", ("llm-7", "0", "python", "kernel"))
    second = reg.encode_text()
    assert second is not first and b'killer="kernel",rank="0"} 1.0' in second
    from dataclasses import replace

    holder["s"] = replace(state, timestamp=state.timestamp + 5)
    assert reg.encode_text() is not second
