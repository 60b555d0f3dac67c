"""Alert rules and Alertmanager routing, proven with the real tools: promtool (check + unit tests),
amtool, and a real Alertmanager on loopback fed the shipped deploy/alertmanager/alertmanager.yml."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import yaml
from promstack import (
    AMTOOL,
    PROMTOOL,
    REPO,
    Webhook,
    alertmanager,
    run,
    shipped_alertmanager_config,
    wait_until,
)

from gpuwatchd.model.kinds import ALERTS

RULES = REPO / "deploy/prometheus/gpuwatchd.rules.yml"
RULE_TESTS = REPO / "deploy/prometheus/gpuwatchd.rules.test.yml"
AM_CONFIG = REPO / "deploy/alertmanager/alertmanager.yml"
RUNBOOKS = REPO / "docs/runbooks.md"

# DESIGN §5: alert -> severity (the monitoring mixins' critical | warning | info; critical pages),
# from the table of alerts (gpuwatchd/model/kinds.py; tests/test_finding_kinds.py checks the rules'
# severities, summaries, runbook anchors and selected kinds against it)
DESIGN_ALERTS = {a.name: a.severity for a in ALERTS}
# The one scrape-job selector of the rules (deploy/prometheus/README.md: how to replace it).
JOB_SELECTOR = 'job=~".*gpuwatchd.*"'


def _rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_promtool_check_rules() -> None:
    p = run([PROMTOOL, "check", "rules", str(RULES)])
    assert p.returncode == 0, p.stdout + p.stderr
    doc = yaml.safe_load(RULES.read_text())
    records = [r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r]
    assert f"SUCCESS: {len(DESIGN_ALERTS) + len(records)} rules found" in p.stdout


def test_promtool_unit_tests_pass() -> None:
    p = run([PROMTOOL, "test", "rules", str(RULE_TESTS)], cwd=RULE_TESTS.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests can fail: without the branch for a counter series that appears already
    above 0, the "first kill before the first scrape" test must fail."""
    broken = RULES.read_text().replace(
        "(rank:gpuwatch_oom_kills_total:nonzero unless gpuwatch_oom_kills_total offset 10m)",
        "(vector(0) == 1)",
    )
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    p = run([PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=tmp_path)
    assert p.returncode != 0
    assert "oom counter series appears already at 1" in p.stdout + p.stderr


def test_every_design_alert_is_a_rule_with_labels_annotations_and_runbook() -> None:
    rules = _rules()
    assert set(rules) == set(DESIGN_ALERTS)
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', RUNBOOKS.read_text()))
    for name, severity in DESIGN_ALERTS.items():
        r = rules[name]
        assert r["labels"]["severity"] == severity, name
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], name
        url = ann["runbook_url"]
        assert url.split("#")[0].endswith("docs/runbooks.md"), url
        assert url.split("#")[1] == name.lower(), url
        assert name.lower() in anchors, f"docs/runbooks.md lacks the anchor for {name}"


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    firing: set[str] = set()
    silent: set[str] = set()
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    assert firing == set(DESIGN_ALERTS)
    assert silent == set(DESIGN_ALERTS)
    # label propagation: every firing expectation of a rank alert names job_id, rank and instance
    rank_alerts = {a.name for a in ALERTS if a.per_rank}
    assert "GPURankOOMKilled" in rank_alerts and "GPUJobCrashed" in rank_alerts
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            if case["alertname"] in rank_alerts:
                for exp in case.get("exp_alerts") or []:
                    assert {"job_id", "rank", "instance", "severity"} <= set(exp["exp_labels"])


def test_scrape_config_examples_are_valid() -> None:
    p = run([PROMTOOL, "check", "config", str(REPO / "deploy/prometheus/prometheus.yml")])
    assert p.returncode == 0, p.stdout + p.stderr


def test_amtool_check_config_and_routes() -> None:
    p = run([AMTOOL, "check-config", str(AM_CONFIG)])
    assert p.returncode == 0, p.stdout + p.stderr
    cases = {
        ("alertname=GPURankOOMKilled", "severity=critical", "job_id=llm-7", "rank=3"): "page",
        ("alertname=GPUXidCritical", "severity=critical", "instance=n1:9863"): "page",
        ("alertname=GPURankFDExhaustion", "severity=warning", "job_id=llm-7"): "ticket",
        ("alertname=GPURankMisconfigured", "severity=info"): "ticket",
        ("alertname=GpuwatchdDown", "severity=warning"): "ticket",
    }
    for labels, receiver in cases.items():
        p = run([AMTOOL, "config", "routes", "test", f"--config.file={AM_CONFIG}", *labels])
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.strip() == receiver, (labels, p.stdout)


def _alert(name: str, severity: str, instance: str, **labels: str) -> dict[str, Any]:
    return {
        "labels": {"alertname": name, "severity": severity, "instance": instance, "job": "gpuwatchd", **labels},
        "annotations": {"summary": f"{name} {labels}"},
    }


def test_real_alertmanager_groups_per_job_and_inhibits(tmp_path: Path) -> None:
    """One job loses rank 3 to the OOM killer on node1: its own down/stall alerts and its peers'
    stall alerts (on both nodes) are inhibited; a peer that died is not; the page arrives as one
    notification for the job. Another job's stall still pages on its own."""
    with Webhook() as hook, alertmanager(tmp_path, shipped_alertmanager_config(hook.url)) as am:
        n1, n2 = "node1:9863", "node2:9863"
        alerts = [
            _alert("GPURankOOMKilled", "critical", n1, job_id="llm-7", rank="3", comm="python", killer="kernel"),
            _alert("GPURankDown", "critical", n1, job_id="llm-7", rank="3"),
            _alert("GPURankStalled", "critical", n1, job_id="llm-7", rank="3"),
            _alert("GPURankStalled", "critical", n1, job_id="llm-7", rank="2"),
            _alert("GPURankStalled", "critical", n2, job_id="llm-7", rank="0"),
            _alert("GPURankDown", "critical", n2, job_id="llm-7", rank="1"),
            _alert("GPURankFDExhaustion", "warning", n1, job_id="llm-7", rank="3"),
            _alert("GPURankStalled", "critical", n2, job_id="other-job", rank="0"),
        ]
        am.post_alerts(alerts)

        def settled() -> list[dict[str, Any]] | None:
            got = am.alerts()
            return got if len(got) == len(alerts) else None

        got = wait_until(settled, 10, "all alerts in Alertmanager")
        # inhibition state is computed on read; give the source alert time to register
        time.sleep(0.5)
        got = am.alerts()
        state = {
            (a["labels"]["alertname"], a["labels"]["instance"], a["labels"]["job_id"], a["labels"]["rank"]): bool(
                a["status"]["inhibitedBy"]
            )
            for a in got
        }
        assert state == {
            ("GPURankOOMKilled", n1, "llm-7", "3"): False,
            ("GPURankDown", n1, "llm-7", "3"): True,
            ("GPURankStalled", n1, "llm-7", "3"): True,
            ("GPURankStalled", n1, "llm-7", "2"): True,
            ("GPURankStalled", n2, "llm-7", "0"): True,
            ("GPURankDown", n2, "llm-7", "1"): False,
            ("GPURankFDExhaustion", n1, "llm-7", "3"): True,
            ("GPURankStalled", n2, "other-job", "0"): False,
        }

        def pages() -> list[tuple[float, str, dict[str, Any]]] | None:
            p = [r for r in hook.received if r[1] == "/page"]
            jobs = {r[2]["groupLabels"].get("job_id") for r in p}
            return p if {"llm-7", "other-job"} <= jobs else None

        wait_until(pages, 15, "page notifications for both jobs")
        time.sleep(1.5)  # a second notification for the same group would arrive by now
        page_notes = [r[2] for r in hook.received if r[1] == "/page"]
        llm7 = [n for n in page_notes if n["groupLabels"] == {"job_id": "llm-7"}]
        assert len(llm7) == 1, page_notes
        names = sorted((a["labels"]["alertname"], a["labels"]["rank"]) for a in llm7[0]["alerts"])
        assert names == [("GPURankDown", "1"), ("GPURankOOMKilled", "3")]
        assert not [r for r in hook.received if r[1] == "/ticket"]


def test_rules_agree_with_the_daemon() -> None:
    """One truth: the rule's critical-Xid list is the kernel-log parser's, and the push path's
    alert names and runbook links are the rules'. (The kinds the rules select are checked against
    the table of kinds in tests/test_finding_kinds.py.)"""
    from gpuwatchd.events import log as events
    from gpuwatchd.model.kernel import CRITICAL_XIDS

    rules = _rules()
    xid_expr = rules["GPUXidCritical"]["expr"]
    lists = set(re.findall(r'xid=~"([0-9|]+)"', xid_expr))
    assert len(lists) == 1
    assert {int(x) for x in lists.pop().split("|")} == set(CRITICAL_XIDS)
    for kind, name in events.ALERT_NAMES.items():
        assert name in rules
        url = rules[name]["annotations"]["runbook_url"]
        assert url == f"{events.RUNBOOK_BASE}#{events.RUNBOOK_ANCHORS[kind]}"


# A routing tree written for the monitoring mixins' alerts (kube-prometheus, node-mixin), as a
# site already runs it before gpuwatchd arrives: critical pages, warning opens a ticket, anything
# else is dropped. gpuwatchd's alerts must land where that site's own alerts do.
MIXIN_ROUTES = """
route:
  receiver: "null"
  routes:
    - {receiver: pager, matchers: ['severity="critical"']}
    - {receiver: tickets, matchers: ['severity="warning"']}
receivers: [{name: "null"}, {name: pager}, {name: tickets}]
"""


def test_a_mixin_routing_tree_pages_the_critical_alerts(tmp_path: Path) -> None:
    """amtool on a mixin-style tree: every alert of the rules goes where its severity says, the
    OOM kill to the pager (with severity=page it went to the null receiver)."""
    tree = tmp_path / "am-site.yml"
    tree.write_text(MIXIN_ROUTES)
    want = {"critical": "pager", "warning": "tickets", "info": "null"}
    for name, r in _rules().items():
        labels = [f"alertname={name}", *(f"{k}={v}" for k, v in r["labels"].items())]
        p = run([AMTOOL, "config", "routes", "test", f"--config.file={tree}", *labels])
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.strip() == want[r["labels"]["severity"]], (name, p.stdout)
    p = run(
        [
            AMTOOL,
            "config",
            "routes",
            "test",
            f"--config.file={tree}",
            "alertname=GPURankOOMKilled",
            "severity=critical",
            "job_id=llm-7",
            "rank=3",
        ]
    )
    assert p.stdout.strip() == "pager"


def test_summaries_are_static_sentences() -> None:
    """The mixins' style guide: one summary per alert name, a sentence with a capital letter and
    a period; the changing facts go in the description."""
    for name, r in _rules().items():
        summary = r["annotations"]["summary"]
        assert "{{" not in summary and "$" not in summary, (name, summary)
        assert summary[0].isupper() and summary.endswith("."), (name, summary)
        assert "{{" in r["annotations"]["description"], name  # the facts moved here


def test_the_job_selector_is_one_string_that_matches_every_deployment(tmp_path: Path) -> None:
    """Every selection of the daemon's scrape job uses the one selector the docs and the Helm
    chart replace, and it matches the names each deployment gives the job: a static job, the
    PodMonitor's <namespace>/<name>, the chart's jobLabel. Replaced by another selector, the
    promtool tests' GpuwatchdDown expectation for job="monitoring/gpuwatchd" must fail."""
    text = RULES.read_text()
    selectors = re.findall(r'job=~?"[^"]*"', text)
    assert selectors and set(selectors) == {JOB_SELECTOR}, selectors
    assert "up{" + JOB_SELECTOR + "}" in text
    pattern = re.compile(JOB_SELECTOR.split('"')[1])
    for job in ("gpuwatchd", "monitoring/gpuwatchd", "gpuwatchd/gpuwatchd", "gpuwatchd-fleet"):
        assert pattern.fullmatch(job), job
    assert not pattern.fullmatch("node")
    (tmp_path / RULES.name).write_text(text.replace(JOB_SELECTOR, 'job=~"gpuwatchd.*"'))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    p = run([PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=tmp_path)
    assert p.returncode != 0 and "monitoring/gpuwatchd" in p.stdout + p.stderr


def test_the_documented_selector_replacement_works(tmp_path: Path) -> None:
    """deploy/prometheus/README.md's sed line, run as written: every selection of the job is
    replaced and the result still passes promtool."""
    readme = (REPO / "deploy/prometheus/README.md").read_text()
    [line] = [ln for ln in readme.splitlines() if ln.startswith("sed ")]
    cmd = line.replace("/etc/prometheus/rules/gpuwatchd.rules.yml", str(tmp_path / "out.yml"))
    p = run(["bash", "-c", cmd], cwd=RULES.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    out = (tmp_path / "out.yml").read_text()
    assert JOB_SELECTOR not in out
    assert out.count('job="gpu-exporters"') == RULES.read_text().count(JOB_SELECTOR) >= 2
    p = run([PROMTOOL, "check", "rules", str(tmp_path / "out.yml")])
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_push_merges_with_the_rule_only_where_prometheus_adds_no_labels(tmp_path: Path) -> None:
    """What deploy/prometheus/README.md says of the direct push, in a real Alertmanager:

    - a node Prometheus scrapes as ``node1`` (its relabelling dropped the port): the daemon's
      pushed alert with ``alertmanager.instance: node1`` (a value the config refused before: it
      had to be HOST:PORT) and the rule's alert are one alert;
    - in Kubernetes the rule's alert also carries the Operator's target labels and
      kube-prometheus-stack's external labels, so the two are two alerts whatever the instance:
      there the push stays off (the Helm chart's default)."""
    from gpuwatchd.config.schema import parse_config
    from gpuwatchd.events.alertmanager import alert_for, derive_instance
    from gpuwatchd.model.events import Event

    ev = Event(
        "k",
        "oom_kill",
        time.time(),
        "critical",
        "rank 3 OOM-killed",
        job_id="llm-7",
        rank="3",
        pid=4242,
        comm="python",
        killer="kernel",
        alert=True,
    )
    series = {
        "job_id": "llm-7",
        "rank": "3",
        "comm": "python",
        "killer": "kernel",
        "job": "gpuwatchd",
        "alertname": "GPURankOOMKilled",
        "severity": "critical",
    }
    cfg = parse_config({"alertmanager": {"url": "http://am:9093", "instance": "node1"}})
    bare = alert_for(ev, cfg.alertmanager.instance)
    operator = {
        "namespace": "monitoring",
        "pod": "gpuwatchd-7xk2p",
        "container": "gpuwatchd",
        "endpoint": "metrics",
        "node": "node1",
        "prometheus": "monitoring/kube-prometheus-stack-prometheus",
        "prometheus_replica": "prometheus-kube-prometheus-stack-prometheus-0",
    }
    in_pod = alert_for(ev, derive_instance(":9863", hostname="gpuwatchd-7xk2p"))
    assert bare is not None and in_pod is not None
    with alertmanager(tmp_path, {"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}) as am:
        rule = {"labels": {**series, "instance": "node1"}, "annotations": {}, "startsAt": bare["startsAt"]}
        am.post_alerts([bare, rule])
        time.sleep(0.5)
        assert len(am.alerts()) == 1, am.alerts()
    with alertmanager(tmp_path, {"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}) as am:
        rule = {
            "labels": {**series, "instance": "node1", **operator},
            "annotations": {},
            "startsAt": in_pod["startsAt"],
        }
        am.post_alerts([in_pod, rule])
        time.sleep(0.5)
        assert len(am.alerts()) == 2, am.alerts()
