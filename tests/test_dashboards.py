"""The Grafana dashboards: generated JSON is current and well-formed, every PromQL expression of
the dashboards and the alert rules parses (promtool) and uses only series the daemon really
exports (its /metrics output, read from a running `gpuwatchd run`), and every panel returns data
from a real Prometheus scraping a node that has every kind of series."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from promstack import (
    DASHBOARDS,
    PROMTOOL,
    RECORDING_RULES,
    REPO,
    RULES,
    MetricsServer,
    NodeRank,
    dashboard_panels,
    dashboard_variable_queries,
    fill_vars,
    free_port,
    node_exposition,
    prometheus,
    rule_exprs,
    run,
    wait_until,
)

# Series Prometheus adds to every target itself (not the daemon's).
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# The dashboards' recording rules (fleet scale): panels may read these series, and those that
# gpuwatchd.rules.yml records beside the alerts that use them.
RECORDING = RECORDING_RULES


def _recorded() -> dict[str, str]:
    docs = [yaml.safe_load(f.read_text()) for f in (RULES, RECORDING)]
    return {r["record"]: r["expr"] for doc in docs for g in doc["groups"] for r in g["rules"] if "record" in r}


def _expand(expr: str) -> str:
    """``expr`` with each recorded series replaced by the expression that records it."""
    for name, e in sorted(_recorded().items(), key=lambda x: -len(x[0])):
        expr = re.sub(re.escape(name) + r"(\{[^}]*\})?", f"({e})", expr)
    return expr


def _annotation_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, annotation name, expr) of every Prometheus annotation."""
    return [
        (path.name, a["name"], a["expr"])
        for path in sorted(DASHBOARDS.glob("*.json"))
        for a in json.loads(path.read_text())["annotations"]["list"]
        if "expr" in a
    ]


def _all_exprs() -> list[tuple[str, str]]:
    out = [
        (f"{d} / {title}", fill_vars(e, instance="node1:9863", job_id="llm-7")) for d, title, e in dashboard_panels()
    ]
    out += [
        (f"{d} / variable {name}", fill_vars(e, instance="node1:9863", job_id="llm-7"))
        for d, name, e in dashboard_variable_queries()
    ]
    out += [
        (f"{d} / annotation {name}", fill_vars(e, instance="node1:9863", job_id="llm-7"))
        for d, name, e in _annotation_exprs()
    ]
    out += [(f"rule {name}", e) for name, e in rule_exprs()]
    out += [(f"recording rule {name}", e) for name, e in _recorded().items()]
    return out


def test_generated_dashboards_are_current() -> None:
    p = run([sys.executable, str(REPO / "tools/gen_dashboards.py"), "--check"])
    assert p.returncode == 0, p.stderr
    assert {p.name for p in DASHBOARDS.glob("*.json")} == {
        "gpuwatchd-node.json",
        "gpuwatchd-job.json",
        "gpuwatchd-health.json",
    }


def test_dashboards_are_well_formed() -> None:
    for path in DASHBOARDS.glob("*.json"):
        d = json.loads(path.read_text())
        assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), path.name
        titles = [p["title"] for p in d["panels"]]
        assert len(titles) == len(set(titles)), f"{path.name}: panel titles repeat"
        variables = {v["name"] for v in d["templating"]["list"]}
        assert "datasource" in variables
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, (path.name, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{path.name}: {p['title']} overlaps"
                    cells.add((x, y))
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"], p["title"]
            for t in p["targets"]:
                used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval", "__range", "__interval"}
                assert used <= variables, (path.name, p["title"], used)
    # the Job dashboard is the cross-node view: every query is scoped to $job_id
    job = json.loads((DASHBOARDS / "gpuwatchd-job.json").read_text())
    for p in job["panels"]:
        for t in p.get("targets", []):
            assert 'job_id=~"$job_id"' in t["expr"], p["title"]


def test_provisioning_points_at_the_dashboards() -> None:
    prov = yaml.safe_load((REPO / "grafana/provisioning/dashboards/gpuwatchd.yml").read_text())
    assert prov["apiVersion"] == 1
    assert prov["providers"][0]["type"] == "file"
    ds = yaml.safe_load((REPO / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses each expression as a recording rule: one bad expression fails the check
    and names itself."""
    exprs = _all_exprs()
    rules = {
        "groups": [
            {"name": "parse", "rules": [{"record": f"parse:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]}
        ]
    }
    f = tmp_path / "exprs.yml"
    f.write_text(yaml.safe_dump(rules))
    p = run([PROMTOOL, "check", "rules", str(f)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in p.stdout
    # and the check can fail
    f.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "bad", "rules": [{"record": "parse:bad", "expr": "rate(gpuwatch_rank_up[5m]"}]}]}
        )
    )
    assert run([PROMTOOL, "check", "rules", str(f)]).returncode != 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    return _real_daemon_metric_names(tmp_path_factory.mktemp("names"))


def _real_daemon_metric_names(tmp_path: Path) -> set[str]:
    """Metric names in the real daemon's /metrics: `gpuwatchd run` with one registered rank and
    a bad rank file, plus the exporter fed one value per counter of the daemon's CounterStore
    (counters appear once they count something: Xids, kernel-log rejects ...)."""
    from prometheus_client import generate_latest

    from gpuwatchd.counters import CounterStore
    from gpuwatchd.exporter.collector import make_registry
    from gpuwatchd.model import COUNTER_LABELS, NodeState

    port = free_port()
    ranks = tmp_path / "ranks"
    state = tmp_path / "state"
    ranks.mkdir()
    state.mkdir()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "web": {"listen_address": f"127.0.0.1:{port}"},
                "interval_seconds": 1,
                "rank_dir": str(ranks),
                "state_dir": str(state),
                "kernel_log": "off",
                "nvml": {"enabled": False},
            }
        )
    )
    (ranks / "broken.json").write_text("{not json")
    sleeper = subprocess.Popen(["sleep", "60"])
    gw = str(Path(sys.executable).with_name("gpuwatchd"))
    daemon = subprocess.Popen(
        [gw, "run", "--config.file", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        run([gw, "register", "--job-id", "names", "--rank", "0", "--pid", str(sleeper.pid), "--rank-dir", str(ranks)])
        import urllib.request

        def scrape() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return None
            return text if 'gpuwatch_rank_up{job_id="names"' in text else None

        text = wait_until(scrape, 20, "the daemon's /metrics with the rank")
    finally:
        daemon.terminate()
        sleeper.kill()
        daemon.wait(timeout=10)
        sleeper.wait(timeout=5)
    counters = CounterStore()
    for name, labels in COUNTER_LABELS.items():
        counters.inc(name, tuple("x" for _ in labels))
    # families that need a GPU (NVML), a heartbeat step or a flight-recorder answer
    from gpuwatchd.model import GpuDevice, RankState
    from gpuwatchd.model.collectives import CollectiveStatus

    fuller = NodeState(
        timestamp=time.time(),
        memory_limit_bytes=256 << 20,
        ranks=(
            RankState(
                "x", 0, 1, 0, 1, True, None, step=1, container="Kubernetes pod 0b8d1c2e-3f4a-4b5c-8d6e-7f8091a2b3c4"
            ),
        ),
        gpus=(GpuDevice(0, "GPU-x", "n", "p", 1, 1, 0.5, throttle_reasons=0x40),),
        collectives=(CollectiveStatus("x", 0, 1, "0", 5, 4),),
    )
    text += generate_latest(make_registry(lambda: fuller, counters)).decode()
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def test_expressions_use_only_series_the_daemon_exports(exported: set[str]) -> None:
    assert "gpuwatch_rank_up" in exported and "gpuwatch_oom_kills_total" in exported
    missing: dict[str, set[str]] = {}
    for where, expr in _all_exprs():
        expr = _expand(expr)
        names = set(re.findall(r"\bgpuwatch_\w+", expr))
        # any other selector (an identifier followed by {) must be one Prometheus adds itself
        others = set(re.findall(r"\b([a-z_:][a-z0-9_:]*)\{", expr)) - names
        bad = (names - exported) | (others - PROMETHEUS_SERIES - exported)  # or its process_*
        if bad:
            missing[where] = bad
    assert not missing, f"not exported by the daemon: {missing}"


def test_every_series_the_daemon_exports_is_on_a_dashboard(exported: set[str]) -> None:
    on_panels = {n for _, _, e in dashboard_panels() for n in re.findall(r"\bgpuwatch_\w+", _expand(e))}
    samples = {n for n in exported if n.startswith("gpuwatch_")}
    # a counter family is listed by its name without _total and its samples with it
    samples = {n for n in samples if (n + "_total") not in samples}
    assert samples - on_panels == set(), "exported but on no dashboard panel"


def test_every_panel_returns_data_from_prometheus(tmp_path: Path) -> None:
    """A real Prometheus scrapes a stand-in node that has every kind of series (one rank
    OOM-killed, one stalled) and evaluates the recording rules: each panel's query, variables
    filled in, returns data.
    tests/test_e2e_alerting.py does the same against the real daemons."""
    ranks = [
        NodeRank("llm-7", 0, 100, 3, gpu=0),
        NodeRank("llm-7", 1, 101, 3, gpu=1),
        NodeRank("llm-7", 2, 102, 3, gpu=2),
    ]
    for r in ranks:
        r.gil_samples, r.gil_held = 50, 10
    with (
        MetricsServer(node_exposition(ranks)) as node,
        prometheus(tmp_path, [node.address], rule_files=[RULES, RECORDING]) as prom,
    ):
        wait_until(lambda: prom.query("gpuwatch_rank_up"), 20, "first scrape")
        time.sleep(2)
        for r in ranks:
            r.gil_samples, r.gil_held = 150, 40
        ranks[1].oom_kills, ranks[1].up, ranks[1].exit_cause = 1, False, "oom_kill"
        node.text = node_exposition(ranks)
        time.sleep(3)
        ranks[2].stalled = True
        node.text = node_exposition(ranks)
        wait_until(lambda: prom.query("gpuwatch_rank_stalled == 1"), 10, "stall scraped")
        time.sleep(5)  # $__rate_interval (4s) worth of samples after the changes
        empty = []
        for d, title, expr in dashboard_panels():
            q = fill_vars(expr, instance=node.address, job_id="llm-7")
            if not prom.query(q):
                empty.append((d, title, q))
        assert not empty, empty
        for d, name, q in dashboard_variable_queries():
            assert prom.query(fill_vars(q, instance=node.address, job_id="llm-7")), (d, name)
        first = [p for p in dashboard_panels() if p[1] == "First rank to fail"]
        (res,) = prom.query(fill_vars(first[0][2], job_id="llm-7"))
        assert res["metric"]["rank"] == "1"


def _dash(name: str) -> dict[str, Any]:
    return dict(json.loads((DASHBOARDS / f"gpuwatchd-{name}.json").read_text()))


def test_dashboards_have_what_an_sre_looks_for() -> None:
    """Multi-select node and job variables and a rank variable; from a failed rank (Job) a click
    to its node (Node) at the same time; OOM kills and Xids marked on the graphs; the daemon's
    own footprint (process_*, cycle duration) in a row of the Health dashboard."""
    node, job, health = _dash("node"), _dash("job"), _dash("health")
    variables = {
        d: {v["name"]: v for v in dash["templating"]["list"]}
        for d, dash in (("node", node), ("job", job), ("health", health))
    }
    for d, name in (("node", "instance"), ("job", "job_id"), ("job", "rank"), ("health", "job")):
        v = variables[d][name]
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*", (d, name)
    assert "$job_id" in variables["job"]["rank"]["query"]["query"]  # the ranks of the chosen jobs
    for p in node["panels"] + job["panels"]:
        for t in p.get("targets", []):
            for var in ("instance", "job_id", "rank"):
                assert f'{var}="${var}"' not in t["expr"], (p["title"], "a multi value needs =~")

    linked = {
        p["title"]
        for p in job["panels"]
        for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])
        if link["url"].startswith("/d/gpuwatchd-node/gpuwatchd-node?var-instance=$")
    }
    for p in job["panels"]:
        names_node = p["type"] == "table" or (
            p["type"] == "timeseries" and any("{{instance}}" in t["legendFormat"] for t in p["targets"])
        )
        assert (p["title"] in linked) == names_node, p["title"]
    assert "First rank to fail" in linked and "Stalled, per rank" in linked

    for dash in (node, job):
        anns = {a["name"]: a["expr"] for a in dash["annotations"]["list"] if "expr" in a}
        assert "gpuwatch_oom_kills_total" in anns["OOM kills"]
        assert "gpuwatch_gpu_xid_errors_total" in anns["Xid errors"]

    rows: dict[str, list[str]] = {}
    current = ""
    for p in health["panels"]:
        if p["type"] == "row":
            current = p["title"]
            continue
        rows.setdefault(current, []).extend(t["expr"] for t in p["targets"])
    footprint = " ".join(rows["Daemon footprint"])
    for series in (
        "process_resident_memory_bytes",
        "gpuwatch_process_memory_limit_bytes",
        "process_cpu_seconds_total",
        "gpuwatch_cycle_duration_seconds",
    ):
        assert series in footprint, series


def test_the_health_dashboard_finds_a_scrape_job_of_any_name(tmp_path: Path) -> None:
    """The Health dashboard's `$job` lists every scrape job that has a gpuwatchd in it, whatever the
    job is called (the rules' selector is a value users set: prometheusRule.jobSelector, or the
    README's sed, e.g. for a job named gpu-exporters); it listed only names matching
    `.*gpuwatchd.*`, so such a user's Health dashboard was empty. Evaluated by promtool: each
    variable's label_values(EXPR, LABEL) as Grafana asks Prometheus for it."""
    health = _dash("health")
    [v] = [v for v in health["templating"]["list"] if v["name"] == "job"]
    q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
    m = re.fullmatch(r"label_values\((.+), *(\w+)\)", q)
    assert m, q
    series = [
        ('gpuwatch_build_info{instance="n1:9863",job="gpu-exporters",version="0.1.0"}', "1x5"),
        ('up{instance="n1:9863",job="gpu-exporters"}', "1x5"),
        ('up{instance="n1:9100",job="node"}', "1x5"),
        ('gpuwatch_build_info{instance="n2",job="monitoring/gpuwatchd",version="0.1.0"}', "1x5"),
        ('up{instance="n2",job="monitoring/gpuwatchd"}', "1x5"),
    ]
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "promql_expr_test": [
                    {
                        "expr": f"count by ({m.group(2)}) ({m.group(1)})",
                        "eval_time": "4m",
                        "exp_samples": [
                            {"labels": '{job="gpu-exporters"}', "value": 1},
                            {"labels": '{job="monitoring/gpuwatchd"}', "value": 1},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "job.test.yml").write_text(yaml.safe_dump(tests))
    p = run([PROMTOOL, "test", "rules", "job.test.yml"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
