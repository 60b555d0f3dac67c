"""events.py sinks (JSONL, journal native protocol, a real Alertmanager) and `gpuwatchd events`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatchd.cli.events import parse_since, render
from gpuwatchd.events import alertmanager as am
from gpuwatchd.events import bus as event_bus
from gpuwatchd.events import journal_sink
from gpuwatchd.events import log as ev
from gpuwatchd.model import frozen_map

ROOT = Path(__file__).resolve().parent.parent


def oom_event(key: str = "b:kernel:42:1000", t: float | None = None, **kw: Any) -> ev.Event:
    d: dict[str, Any] = dict(
        key=key,
        kind="oom_kill",
        time=t if t is not None else time.time(),
        severity="page",
        summary="rank 3 of job llm-7 (pid 42, python3) was killed by the kernel OOM killer at "
        "14:22:07 holding 84.0 GiB RSS; 15 peers alive: they will wait in their next collective",
        job_id="llm-7",
        rank="3",
        pid=42,
        comm="python3",
        killer="kernel",
        boot_id="b",
        counter="oom_kills",
        labels=("llm-7", "3", "python3", "kernel"),
        fields=frozen_map({"rss_bytes": 84 << 30, "memcg": "/slurm/job_1", "peers_alive": 15}),
        alert=True,
    )
    d.update(kw)
    return ev.Event(**d)


def test_jsonl_round_trip_and_torn_lines(tmp_path: Path) -> None:
    sink = ev.JsonlSink(str(tmp_path))
    a = oom_event("k1")
    sink.emit(a)
    with open(sink.path, "ab") as f:
        f.write(b'{"key": "torn", "ki')  # crash mid-append
    b = oom_event("k2", worker=True)
    sink.emit(b)  # starts on a fresh line
    with open(sink.path, "ab") as f:
        f.write(b'\xff\xfe binary\n[1,2]\n{"key": 5, "kind": "x"}\n')
    got = list(ev.read_events(sink.path))
    assert [e.key for e in got] == ["k1", "k2"]
    assert got[0] == a and got[1].worker
    assert got[0].fields["rss_bytes"] == 84 << 30
    assert list(ev.read_events(str(tmp_path / "missing.jsonl"))) == []


def test_journal_native_protocol_to_a_real_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    try:
        e = oom_event(summary="two\nlines")
        journal_sink.JournalSink(socket_path=path).emit(e)
        data = server.recv(65536)
    finally:
        server.close()
    fields: dict[str, str] = {}
    i = 0
    while i < len(data):  # decode the native protocol the way journald does
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, _, v = line.partition(b"=")
            fields[k.decode()] = v.decode()
            i = nl + 1
        else:
            n = int.from_bytes(data[nl + 1 : nl + 9], "little")
            fields[line.decode()] = data[nl + 9 : nl + 9 + n].decode()
            i = nl + 9 + n + 1
    assert fields["MESSAGE"] == "two\nlines"
    assert fields["MESSAGE_ID"] == ev.MESSAGE_IDS["oom_kill"]
    assert fields["GPUWATCH_JOB_ID"] == "llm-7" and fields["GPUWATCH_RANK"] == "3"
    assert fields["GPUWATCH_PID"] == "42" and fields["GPUWATCH_KILLER"] == "kernel"
    assert fields["GPUWATCH_RSS_BYTES"] == str(84 << 30)
    assert fields["GPUWATCH_MEMCG"] == "/slurm/job_1"
    assert fields["PRIORITY"] == "2"
    assert all(k.replace("_", "").isalnum() and k.isupper() for k in fields)


def test_journal_sink_without_journald_does_not_raise(tmp_path: Path) -> None:
    s = journal_sink.JournalSink(socket_path=str(tmp_path / "nobody-listens"))
    s.emit(oom_event())
    assert s.errors == 1


def test_derive_instance() -> None:
    assert am.derive_instance("0.0.0.0:9863", "gpu-node-001") == "gpu-node-001:9863"
    assert am.derive_instance(":9863", "n1") == "n1:9863"
    assert am.derive_instance("[::]:9863", "n1") == "n1:9863"
    assert am.derive_instance("10.0.0.5:9863") == "10.0.0.5:9863"
    assert am.derive_instance("[::1]:9863") == "[::1]:9863"


def rule(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "deploy/prometheus/gpuwatchd.rules.yml").read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if r.get("alert") == name:
                return dict(r)
    raise AssertionError(name)


def test_alert_labels_match_the_prometheus_rule() -> None:
    a = am.alert_for(oom_event(), "n1:9863")
    assert a is not None
    # the rule alert = the counter series' labels + job/instance (scrape) + the rule's labels
    series_labels = {"job_id", "rank", "comm", "killer", "instance", "job"}
    r = rule("GPURankOOMKilled")
    assert set(a["labels"]) == {"alertname"} | series_labels | set(r["labels"])
    assert a["labels"]["severity"] == r["labels"]["severity"] == "critical"
    assert a["annotations"]["summary"] == r["annotations"]["summary"]
    assert a["annotations"]["runbook_url"] == r["annotations"]["runbook_url"]
    xid = ev.Event(
        key="x",
        kind="xid",
        time=time.time(),
        severity="page",
        summary="GPU 0 Xid 79",
        fields=frozen_map({"xid": 79, "gpu": "0", "uuid": "GPU-1", "pci": "0000:3b:00"}),
        alert=True,
    )
    ax = am.alert_for(xid, "n1:9863")
    assert ax is not None and ax["labels"]["alertname"] == "GPUXidCritical"
    assert set(ax["labels"]) == {"alertname", "instance", "job", "severity", "gpu", "uuid", "xid"}
    assert ax["annotations"]["runbook_url"] == rule("GPUXidCritical")["annotations"]["runbook_url"]
    assert ax["annotations"]["summary"] == rule("GPUXidCritical")["annotations"]["summary"]
    assert am.alert_for(oom_event(alert=False), "n1:9863") is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    cfg = tmp_path / "am.yml"
    cfg.write_text(yaml.safe_dump({"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}))
    proc = subprocess.Popen(
        [
            "prometheus-alertmanager",
            f"--config.file={cfg}",
            f"--storage.path={tmp_path / 'am'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/-/ready", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < end, "alertmanager did not become ready"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def am_alerts(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/api/v2/alerts", timeout=2) as r:
        return list(json.load(r))


def test_push_to_a_real_alertmanager(alertmanager: str) -> None:
    sink = am.AlertmanagerSink(alertmanager, "gpu-node-001:9863", timeout_seconds=2.0)
    try:
        t0 = time.monotonic()
        sink.emit(oom_event())
        sink.emit(oom_event(key="other", alert=False))  # warning-only events do not page
        got: list[dict[str, Any]] = []
        while time.monotonic() - t0 < 10 and not got:
            got = [a for a in am_alerts(alertmanager) if a["labels"].get("alertname") == "GPURankOOMKilled"]
            time.sleep(0.02)
        assert len(got) == 1
        labels = got[0]["labels"]
        assert labels == {
            "alertname": "GPURankOOMKilled",
            "instance": "gpu-node-001:9863",
            "job": "gpuwatchd",
            "severity": "critical",
            "job_id": "llm-7",
            "rank": "3",
            "comm": "python3",
            "killer": "kernel",
        }
        assert "15 peers alive" in got[0]["annotations"]["description"]
        assert got[0]["status"]["state"] == "active"
        sink.emit(oom_event())  # the same alert again (e.g. after a restart): still one alert
        time.sleep(0.3)
        assert len([a for a in am_alerts(alertmanager) if a["labels"].get("alertname") == "GPURankOOMKilled"]) == 1
        assert sink.errors == 0 and sink.sent == 2
    finally:
        sink.close()


def test_push_to_a_dead_alertmanager_gives_up_without_raising() -> None:
    sink = am.AlertmanagerSink(f"http://127.0.0.1:{free_port()}", "n:1", timeout_seconds=0.5, retry_seconds=0.5)
    t0 = time.monotonic()
    sink.emit(oom_event())
    sink.close()
    assert time.monotonic() - t0 < 5
    assert sink.errors >= 1 and sink.sent == 0


def test_bus_isolates_a_failing_sink(tmp_path: Path) -> None:
    class Broken:
        def emit(self, event: ev.Event) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    jsonl = ev.JsonlSink(str(tmp_path))
    bus = event_bus.EventBus([Broken(), jsonl])
    bus.emit(oom_event())
    assert len(list(ev.read_events(jsonl.path))) == 1


def test_parse_since() -> None:
    now = 1_800_000_000.0
    assert parse_since("10m", now) == now - 600
    assert parse_since("2h", now) == now - 7200
    assert parse_since("all", now) == 0.0
    assert parse_since("1700000000", now) == 1_700_000_000.0
    assert parse_since("2026-01-01T00:00:00Z", now) == 1_767_225_600.0
    with pytest.raises(Exception, match="--since"):
        parse_since("yesterday-ish", now)


def test_events_command(tmp_path: Path) -> None:
    sink = ev.JsonlSink(str(tmp_path))
    sink.emit(oom_event("old", t=time.time() - 7200))
    sink.emit(oom_event("new", worker=True))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "events", "--state-dir", str(tmp_path), "--since", "1h", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [d["key"] for d in data] == ["new"] and data[0]["worker"] and data[0]["job_id"] == "llm-7"
    table = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "events", "--state-dir", str(tmp_path), "--since", "all"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["TIME", "KIND", "BY", "JOB_ID"] and len(lines) == 3
    assert "oom_kill (worker)" in lines[2] and "llm-7" in lines[2]
    assert render([]) == "no events"
