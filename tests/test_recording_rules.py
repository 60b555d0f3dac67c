"""The dashboards' recording rules (deploy/prometheus/gpuwatchd.recording.yml), proven with the
real promtool: they parse, their unit tests pass and can fail, and each one feeds a panel."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from promstack import DASHBOARDS, PROMTOOL, REPO, run

RECORDING = REPO / "deploy/prometheus/gpuwatchd.recording.yml"
RECORDING_TESTS = REPO / "deploy/prometheus/gpuwatchd.recording.test.yml"


def _records() -> list[str]:
    doc = yaml.safe_load(RECORDING.read_text())
    return [r["record"] for g in doc["groups"] for r in g["rules"]]


def test_promtool_check_recording_rules() -> None:
    p = run([PROMTOOL, "check", "rules", str(RECORDING)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(_records())} rules found" in p.stdout


def test_promtool_unit_tests_pass_and_cover_every_recorded_series() -> None:
    p = run([PROMTOOL, "test", "rules", str(RECORDING_TESTS)], cwd=RECORDING_TESTS.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    tests = yaml.safe_load(RECORDING_TESTS.read_text())
    tested = {t["expr"] for g in tests["tests"] for t in g.get("promql_expr_test", [])}
    assert tested == set(_records())


def test_promtool_unit_tests_catch_a_wrong_recording_rule(tmp_path: Path) -> None:
    doc = yaml.safe_load(RECORDING.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if r["record"] == "collector:gpuwatch_collector_duration_seconds:max":
                r["expr"] = r["expr"].replace("max by", "min by")
    (tmp_path / RECORDING.name).write_text(yaml.safe_dump(doc))
    (tmp_path / RECORDING_TESTS.name).write_text(RECORDING_TESTS.read_text())
    p = run([PROMTOOL, "test", "rules", RECORDING_TESTS.name], cwd=tmp_path)
    assert p.returncode != 0 and "collector:gpuwatch_collector_duration_seconds:max" in p.stdout + p.stderr


def test_every_recorded_series_is_on_a_dashboard() -> None:
    exprs = [
        t["expr"]
        for path in DASHBOARDS.glob("*.json")
        for panel in json.loads(path.read_text())["panels"]
        for t in panel.get("targets", [])
    ]
    unused = [r for r in _records() if not any(r in e for e in exprs)]
    assert not unused, f"recorded but read by no panel: {unused}"
