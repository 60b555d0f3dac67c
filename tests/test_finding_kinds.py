"""The table of finding kinds (gpuwatchd/model/kinds.py) against everything that names a kind: the
rule modules' ``Finding`` calls, docs/metrics.md's "Finding kinds" table, the README's list, the
anchors of docs/runbooks.md and the alerts of deploy/prometheus/gpuwatchd.rules.yml.

Each check is a function of the table, so that the tests below also show it failing: a row added to
the table and to nothing else, and a row taken out of it, are each reported by every place that
then disagrees."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from gpuwatchd.model import INFO, PAGE, WARNING
from gpuwatchd.model.kinds import ALERTS, FINDING_SERIES, KINDS, Alert, FindingKind, rule_modules

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "gpuwatchd"
FINDINGS = PKG / "findings"
RULES_YML = REPO / "deploy/prometheus/gpuwatchd.rules.yml"
RUNBOOK_BASE = "https://github.com/gpuwatchd/gpuwatchd/blob/main/docs/runbooks.md"
SEVERITY_NAMES = {"PAGE": PAGE, "WARNING": WARNING, "INFO": INFO}
FINDING_CALLS = {"Finding", "rank_finding"}
# rank_finding itself: it builds the Finding of the kind its caller passes
FORWARDERS = {"gpuwatchd/findings/context.py"}


def raised() -> dict[str, set[tuple[str, str]]]:
    """module (gpuwatchd/...py, relative) -> the (kind, severity) of each ``Finding(...)`` /
    ``rank_finding(...)`` call with a ``kind=`` in it, read from the AST. A kind or severity that
    is not a literal / a severity constant reads as "?" (and then matches no row)."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        if str(path.relative_to(REPO)) in FORWARDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FINDING_CALLS):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            if "kind" not in kw:
                continue
            kind, sev = kw["kind"], kw.get("severity")
            out.setdefault(str(path.relative_to(REPO)), set()).add(
                (
                    kind.value if isinstance(kind, ast.Constant) and isinstance(kind.value, str) else "?",
                    SEVERITY_NAMES.get(sev.id, "?") if isinstance(sev, ast.Name) else "?",
                )
            )
    return out


def table_problems(kinds: Iterable[FindingKind], alerts: Iterable[Alert], anchors: set[str]) -> list[str]:
    kinds, alerts = tuple(kinds), {a.name: a for a in alerts}
    out = []
    names = [k.kind for k in kinds]
    out += [f"{n}: two rows" for n in set(names) if names.count(n) > 1]
    for k in kinds:
        if k.severity not in (PAGE, WARNING, INFO):
            out.append(f"{k.kind}: severity {k.severity!r}")
        if k.alert and k.alert not in alerts:
            out.append(f"{k.kind}: no alert {k.alert} in the table of alerts")
        if k.severity == PAGE and k.alert and alerts[k.alert].severity != "critical":
            out.append(f"{k.kind}: a page reported by the {alerts[k.alert].severity} alert {k.alert}")
        if k.runbook not in anchors:
            out.append(f"{k.kind}: docs/runbooks.md has no anchor {k.runbook!r}")
        if not (FINDINGS / f"{k.rule}.py").is_file():
            out.append(f"{k.kind}: no rule module gpuwatchd/findings/{k.rule}.py")
        if k.kind != k.rule and sum(j.rule == k.rule for j in kinds) == 1:
            out.append(f"{k.kind}: its module is named {k.rule}, not as the kind")
    out += [f"{a.name}: anchor missing from docs/runbooks.md" for a in alerts.values() if a.anchor not in anchors]
    return out


def rule_problems(kinds: Iterable[FindingKind], found: dict[str, set[tuple[str, str]]]) -> list[str]:
    """Each row's kind is raised by its module with its severity; nothing else raises a kind."""
    want: dict[str, set[tuple[str, str]]] = {}
    for k in kinds:
        want.setdefault(f"gpuwatchd/findings/{k.rule}.py", set()).add((k.kind, k.severity))
    out = []
    for module in sorted(set(want) | set(found)):
        for kind, sev in sorted(found.get(module, set()) - want.get(module, set())):
            out.append(f"{module} raises {kind} ({sev}), which the table does not give it")
        for kind, sev in sorted(want.get(module, set()) - found.get(module, set())):
            out.append(f"{module} does not raise {kind} ({sev}) as its row says")
    return out


def metrics_doc_rows(text: str) -> dict[str, tuple[str, str]]:
    """docs/metrics.md's "Finding kinds" table: kind -> (severity, raised when)."""
    section = text.split("\n## Finding kinds\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([a-z]+) \| (.*) \|$", section, re.M)
    return {kind: (sev, when) for kind, sev, when in rows}


def metrics_doc_problems(kinds: Iterable[FindingKind], rows: dict[str, tuple[str, str]]) -> list[str]:
    kinds = {k.kind: k for k in kinds}
    out = [f"docs/metrics.md lists {n}, which the table lacks" for n in sorted(set(rows) - set(kinds))]
    out += [f"docs/metrics.md lacks {n}" for n in sorted(set(kinds) - set(rows))]
    for n in sorted(set(rows) & set(kinds)):
        sev, when = rows[n]
        if sev != kinds[n].severity:
            out.append(f"docs/metrics.md: {n} is {sev}, the table says {kinds[n].severity}")
        if not when.startswith(kinds[n].line):
            out.append(f"docs/metrics.md: {n}'s 'raised when' does not start with the table's line {kinds[n].line!r}")
    return out


def readme_kinds(text: str) -> list[str]:
    para = text.split("\n## Diagnoses (findings)\n", 1)[1].split("Each comes with", 1)[0]
    return re.findall(r"`([a-z_]+)`", para)


def readme_problems(kinds: Iterable[FindingKind], listed: list[str]) -> list[str]:
    names = {k.kind for k in kinds}
    out = [f"README lists {n}, which the table lacks" for n in sorted(set(listed) - names)]
    out += [f"README's list lacks {n}" for n in sorted(names - set(listed))]
    out += [f"README lists {n} twice" for n in sorted({n for n in listed if listed.count(n) > 1})]
    return out


def rules_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def alert_rule_problems(
    kinds: Iterable[FindingKind], alerts: Iterable[Alert], rules: dict[str, dict[str, Any]]
) -> list[str]:
    """The table of alerts is the rules' alerts, with their severity, summary and runbook anchor;
    every kind with an alert is selected by that alert (through ``gpuwatch_finding{kind=...}`` or
    the series its row names); every kind a rule selects is a row reporting to that rule."""
    kinds, alerts = tuple(kinds), {a.name: a for a in alerts}
    out = [f"rules: alert {n} is not in the table" for n in sorted(set(rules) - set(alerts))]
    out += [f"rules: the table's alert {n} is no rule" for n in sorted(set(alerts) - set(rules))]
    for name in sorted(set(rules) & set(alerts)):
        r, a = rules[name], alerts[name]
        if r["labels"]["severity"] != a.severity:
            out.append(f"rules: {name} is {r['labels']['severity']}, the table says {a.severity}")
        if r["annotations"]["summary"] != a.summary:
            out.append(f"rules: {name}'s summary is not the table's")
        if r["annotations"]["runbook_url"] != f"{RUNBOOK_BASE}#{a.anchor}":
            out.append(f"rules: {name}'s runbook_url is not #{a.anchor}")
    selected = {
        (kind, name)
        for name, r in rules.items()
        for group in re.findall(FINDING_SERIES + r'\{kind=~?"([a-z_|]+)"', r["expr"])
        for kind in group.split("|")
    }
    by_row = {(k.kind, k.alert) for k in kinds if k.alert and k.series == FINDING_SERIES}
    out += [
        f"rules: {name} selects kind {kind}, which the table does not report there"
        for kind, name in sorted(selected - by_row)
    ]
    out += [f"rules: {name} does not select kind {kind} as the table says" for kind, name in sorted(by_row - selected)]
    for k in kinds:
        if k.alert and k.series != FINDING_SERIES and k.alert in rules and k.series not in rules[k.alert]["expr"]:
            out.append(f"rules: {k.alert} does not read {k.series}, which carries {k.kind}")
    return out


def _anchors() -> set[str]:
    return set(re.findall(r'<a id="([a-z0-9_-]+)"></a>', (REPO / "docs/runbooks.md").read_text()))


def _all_problems(kinds: tuple[FindingKind, ...]) -> list[str]:
    return (
        table_problems(kinds, ALERTS, _anchors())
        + rule_problems(kinds, raised())
        + metrics_doc_problems(kinds, metrics_doc_rows((REPO / "docs/metrics.md").read_text()))
        + readme_problems(kinds, readme_kinds((REPO / "README.md").read_text()))
        + alert_rule_problems(kinds, ALERTS, rules_of(yaml.safe_load(RULES_YML.read_text())))
    )


def test_the_table_rule_modules_docs_and_alert_rules_agree() -> None:
    assert _all_problems(KINDS) == []


def test_a_row_added_to_the_table_alone_is_reported_by_each_place() -> None:
    new = FindingKind(
        "gpu_too_hot", WARNING, "GPURankTooHot", "gpuranktoohot", "a GPU above its slowdown temperature", "gpu_too_hot"
    )
    got = "\n".join(_all_problems((*KINDS, new)))
    for place in (
        "no alert GPURankTooHot",
        "no anchor 'gpuranktoohot'",
        "no rule module",
        "gpu_too_hot.py does not raise",
        "docs/metrics.md lacks gpu_too_hot",
        "README's list lacks gpu_too_hot",
    ):
        assert place in got, (place, got)


def test_a_row_missing_from_the_table_is_reported_by_each_place() -> None:
    fewer = tuple(k for k in KINDS if k.kind != "fd_exhaustion")
    got = "\n".join(_all_problems(fewer))
    for place in (
        "fd_exhaustion.py raises fd_exhaustion",
        "docs/metrics.md lists fd_exhaustion",
        "README lists fd_exhaustion",
        "GPURankFDExhaustion selects kind fd_exhaustion",
    ):
        assert place in got, (place, got)


def test_a_wrong_severity_alert_or_series_is_reported() -> None:
    i = next(i for i, k in enumerate(KINDS) if k.kind == "gil_saturated")
    for row, words in (
        (
            replace(KINDS[i], severity=INFO),
            ("gil_saturated.py does not raise gil_saturated (info)", "docs/metrics.md: gil_saturated is warning"),
        ),
        (
            replace(KINDS[i], alert="GPURankStraggler"),
            ("GPURankStraggler does not select kind gil_saturated", "GPURankGILSaturated selects kind gil_saturated"),
        ),
        (replace(KINDS[i], line="the GPU waits"), ("does not start with the table's line",)),
    ):
        got = "\n".join(_all_problems((*KINDS[:i], row, *KINDS[i + 1 :])))
        for w in words:
            assert w in got, (w, got)
    j = next(i for i, k in enumerate(KINDS) if k.kind == "rank_oom_killed")
    got = "\n".join(_all_problems((*KINDS[:j], replace(KINDS[j], series="gpuwatch_oom_kill_total"), *KINDS[j + 1 :])))
    assert "GPURankOOMKilled does not read gpuwatch_oom_kill_total" in got


def test_a_rule_that_raises_an_unlisted_kind_is_reported() -> None:
    found = raised()
    found["gpuwatchd/findings/fd_exhaustion.py"] = {("fd_exhausted", WARNING)}
    assert rule_problems(KINDS, found) == [
        "gpuwatchd/findings/fd_exhaustion.py raises fd_exhausted (warning), which the table does not give it",
        "gpuwatchd/findings/fd_exhaustion.py does not raise fd_exhaustion (warning) as its row says",
    ]


def test_the_registry_runs_every_rule_module_of_the_table_in_its_order() -> None:
    from gpuwatchd import findings

    assert [r.__module__.rpartition(".")[2] for r in findings.RULES] == list(rule_modules())
    assert [r.__module__.rpartition(".")[2] for r in findings.LATE_RULES] == ["rank_straggler"]
    on_disk = {p.stem for p in FINDINGS.glob("*.py")} - {"__init__", "context"}
    assert on_disk == set(findings.MODULES) == {k.rule for k in KINDS}


def test_the_event_log_reads_the_table() -> None:
    from gpuwatchd.daemon.finding_events import SKIP_KINDS
    from gpuwatchd.events import log

    assert set(SKIP_KINDS) == {"rank_oom_killed", "xid_critical"}
    assert dict(log.ALERT_NAMES) == {"oom_kill": "GPURankOOMKilled", "xid": "GPUXidCritical"}
    assert dict(log.RUNBOOK_ANCHORS) == {"oom_kill": "gpurankoomkilled", "xid": "gpuxidcritical"}
    rules = rules_of(yaml.safe_load(RULES_YML.read_text()))
    for event, name in log.ALERT_NAMES.items():
        assert log.ALERT_SUMMARIES[event] == rules[name]["annotations"]["summary"]
