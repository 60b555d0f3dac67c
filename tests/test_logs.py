"""The daemon's log and its config-reload metrics, as a log pipeline and Prometheus see them.

A real daemon runs with ``--log.format json`` on a node without the NVIDIA library (NVML's
not-present recording): every line of its log is one JSON object, the absent source is said
once at INFO, and a refused reload (a multi-line message) stays one record. Its
``gpuwatch_config_last_reload_successful`` / ``..._success_timestamp_seconds`` follow a refused
and then an accepted SIGHUP, as Prometheus' own ``prometheus_config_last_reload_*`` do."""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from daemonutil import DaemonProc, write_config

from gpuwatchd.logs import JsonFormatter, LogfmtFormatter

HERE = Path(__file__).resolve().parent
NOT_PRESENT = HERE / "fixtures" / "nvml" / "not_present.json"
OK = "gpuwatch_config_last_reload_successful"
AT = "gpuwatch_config_last_reload_success_timestamp_seconds"


def test_json_log_absent_nvml_and_the_reload_metrics(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path, nvml={"enabled": True, "fixture": str(NOT_PRESENT)})
    good = path.read_text()
    t0 = time.time()
    d = DaemonProc(path, cfg, args=["--log.format", "json", "--log.level", "info"])
    try:
        assert d.value(OK) == 1
        started = d.value(AT)
        assert started is not None and t0 - 1 <= started <= time.time()
        d.wait_for(lambda: d.value("gpuwatch_collector_success", collector="nvml") == 0, what="nvml down")
        time.sleep(1.5)  # three more cycles: the absent source is still said once

        path.write_text(good + "interval_seconds: 1\n")  # a key twice: refused
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: d.value(OK) == 0, what="reload refused")
        assert d.value(AT) == started  # the last success is still the start

        path.write_text(good.replace("interval_seconds: 0.5", "interval_seconds: 0.6"))
        before = time.time()
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: d.value(OK) == 1, what="reload accepted")
        at = d.value(AT)
        assert at is not None and before - 0.01 <= at <= time.time()
    finally:
        assert d.stop() == 0
    records = [json.loads(line) for line in d.log_path.read_text().splitlines()]  # one object a line
    assert all(set(r) == {"ts", "level", "logger", "msg"} for r in records), records
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["ts"]) for r in records)
    absent = [r for r in records if "collector nvml: source not present" in r["msg"]]
    assert [(r["level"], r["logger"]) for r in absent] == [("info", "gpuwatchd.isolation")], absent
    (refused,) = [r for r in records if r["msg"].startswith("reload refused")]
    assert refused["level"] == "error" and "\n  - " in refused["msg"] and "interval_seconds" in refused["msg"]


def _record(msg: str, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    r = logging.LogRecord("gpuwatchd.x", logging.WARNING, __file__, 1, msg, None, info)
    r.created = 1733400000.25
    return r


@pytest.mark.parametrize("msg", ["plain", 'a "quoted"\nsecond line', "k=v with spaces", "", "tab\there"])
def test_logfmt_is_one_line_and_reads_back(msg: str) -> None:
    line = LogfmtFormatter().format(_record(msg))
    assert "\n" not in line
    fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line))
    assert fields["ts"] == "2024-12-05T12:00:00.250Z" and fields["level"] == "warning"
    value = fields["msg"]
    assert (json.loads(value) if value.startswith('"') else value) == msg


def test_json_keeps_an_exception_in_the_record() -> None:
    line = JsonFormatter().format(_record("failed", exc=True))
    doc = json.loads(line)
    assert "\n" not in line and doc["msg"] == "failed" and "ValueError: boom" in doc["exc"]
