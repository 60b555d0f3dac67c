"""Real Prometheus / Alertmanager servers on loopback for the alerting tests, plus the small HTTP
pieces around them: a /metrics server that serves text we control (a stand-in node until a test
runs the real daemon) and a webhook receiver that records what Alertmanager sends.

Every server binds 127.0.0.1 on a free port, lives in a temp dir and is stopped by its context
manager; nothing here reaches beyond loopback.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
ALERTMANAGER = (
    shutil.which("prometheus-alertmanager") or shutil.which("alertmanager") or "/usr/bin/prometheus-alertmanager"
)
AMTOOL = shutil.which("amtool") or "/usr/bin/amtool"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get_json(url: str, params: dict[str, str] | None = None, timeout: float = 5.0) -> Any:
    if params:
        url = url + "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def wait_until(pred: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    """Poll ``pred()`` until it returns something truthy; bounded by ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class _Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def wait_ready(self, path: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.log.name} exited:\n{self.log.read_text()[-3000:]}")
            if _ready(self.url + path):
                return
            time.sleep(0.1)
        raise AssertionError(f"{self.url} not ready:\n{self.log.read_text()[-3000:]}")


class Prometheus(_Server):
    config: Path

    def send_alerts_to(self, alertmanager_url: str) -> None:
        """Add an Alertmanager to the running server's config and reload it (SIGHUP)."""
        cfg = yaml.safe_load(self.config.read_text())
        hostport = alertmanager_url.split("://", 1)[1]
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [hostport]}]}]}
        self.config.write_text(yaml.safe_dump(cfg))
        self.proc.send_signal(signal.SIGHUP)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = http_get_json(self.url + "/api/v1/query", params)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(http_get_json(self.url + "/api/v1/alerts")["data"]["alerts"])

    def targets_up(self) -> list[dict[str, Any]]:
        return [t for t in http_get_json(self.url + "/api/v1/targets")["data"]["activeTargets"] if t["health"] == "up"]


@contextlib.contextmanager
def prometheus(
    tmp: Path,
    targets: list[str],
    *,
    rule_files: list[Path] | None = None,
    alertmanager_url: str | None = None,
    interval: str = "1s",
    job_name: str = "gpuwatchd",
) -> Iterator[Prometheus]:
    """A real Prometheus scraping ``targets`` (host:port) every ``interval``."""
    port = free_port()
    cfg: dict[str, Any] = {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "scrape_timeout": interval,
        },
        "scrape_configs": [{"job_name": job_name, "static_configs": [{"targets": targets}]}],
    }
    if rule_files:
        cfg["rule_files"] = [str(p) for p in rule_files]
    if alertmanager_url:
        hostport = alertmanager_url.split("://", 1)[1]
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [hostport]}]}]}
    d = tmp / f"prometheus-{port}"
    d.mkdir()
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = d / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={d / 'prometheus.yml'}",
                f"--storage.tsdb.path={d / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                # firing alerts are re-sent every evaluation (default: at most once a minute)
                "--rules.alert.resend-delay=1s",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=d,
        )
    srv = Prometheus(proc, f"http://127.0.0.1:{port}", log)
    srv.config = d / "prometheus.yml"
    try:
        srv.wait_ready("/-/ready")
        yield srv
    finally:
        srv.stop()


class Alertmanager(_Server):
    def alerts(self) -> list[dict[str, Any]]:
        return list(http_get_json(self.url + "/api/v2/alerts"))

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        req = urllib.request.Request(
            self.url + "/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200


def shipped_alertmanager_config(webhook_url: str, group_wait: str = "1s") -> dict[str, Any]:
    """deploy/alertmanager/alertmanager.yml with its receivers pointed at ``webhook_url`` (path
    /page or /ticket kept) and short waits, everything else (routes, inhibitions) as shipped."""
    cfg: dict[str, Any] = yaml.safe_load((REPO / "deploy/alertmanager/alertmanager.yml").read_text())
    for rcv in cfg["receivers"]:
        for wh in rcv.get("webhook_configs", []):
            wh["url"] = webhook_url.rstrip("/") + "/" + rcv["name"]

    def shorten(route: dict[str, Any]) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route:
                route[key] = group_wait
        for sub in route.get("routes", []):
            shorten(sub)

    shorten(cfg["route"])
    cfg["route"]["group_wait"] = group_wait
    cfg["route"]["group_interval"] = group_wait
    return cfg


@contextlib.contextmanager
def alertmanager(tmp: Path, config: dict[str, Any]) -> Iterator[Alertmanager]:
    port = free_port()
    d = tmp / f"alertmanager-{port}"
    d.mkdir()
    (d / "alertmanager.yml").write_text(yaml.safe_dump(config))
    log = d / "alertmanager.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                ALERTMANAGER,
                f"--config.file={d / 'alertmanager.yml'}",
                f"--storage.path={d / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",  # no gossip port: a single loopback instance
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=d,
        )
    srv = Alertmanager(proc, f"http://127.0.0.1:{port}", log)
    try:
        srv.wait_ready("/-/ready")
        yield srv
    finally:
        srv.stop()


_S = TypeVar("_S", bound="_LoopbackServer")


class _LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 (any free port), served while in a ``with`` block."""

    def _serve(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self: _S) -> _S:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class Webhook(_LoopbackServer):
    """Records Alertmanager webhook notifications: (monotonic receive time, path, payload)."""

    def __init__(self) -> None:
        self.received: list[tuple[float, str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"{}")
                with outer.lock:
                    outer.received.append((time.monotonic(), self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._serve(Handler)
        self.url = f"http://{self.address}"

    def alerts(self, path: str | None = None) -> list[tuple[float, str, dict[str, Any]]]:
        """Every alert of every notification so far: (receive time, path, alert)."""
        with self.lock:
            return [
                (t, p, a) for t, p, body in self.received if path is None or p == path for a in body.get("alerts", [])
            ]


class MetricsServer(_LoopbackServer):
    """Serves ``self.text`` at /metrics in the Prometheus text format (a stand-in node)."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._serve(Handler)


def run(cmd: list[str], cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


# --- a stand-in node ---------------------------------------------------------------------------
# Until a test runs the real daemon, MetricsServer serves text built here from DESIGN §4's names
# and labels (the contract the core's exporter implements); test_dashboards.py checks that every
# name used here and in the dashboards/rules is one the real daemon exports.


def _fmt_labels(labels: dict[str, str]) -> str:
    body = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
    return "{" + body + "}" if body else ""


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class NodeRank:
    """One rank on a stand-in node (mutable: tests flip ``up``, ``stalled``, ``oom_kills``)."""

    def __init__(self, job_id: str, rank: int, pid: int, world_size: int, gpu: int = 0) -> None:
        self.job_id = job_id
        self.rank = rank
        self.pid = pid
        self.world_size = world_size
        self.gpu = gpu
        self.up = True
        self.stalled = False
        self.oom_kills = 0
        self.gil_samples = 0
        self.gil_held = 0
        self.exit_cause = ""  # gpuwatch_rank_exits_total{cause} at 1 once set
        self.listed = True  # False: a discovered rank gone with its process (no rank series)


def node_exposition(ranks: list[NodeRank], now: float | None = None) -> str:
    """The exposition of a node with one GPU per rank, following DESIGN §4."""
    now = time.time() if now is None else now
    fams: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}

    def add(name: str, typ: str, labels: dict[str, str], value: float) -> None:
        fams.setdefault(name, (typ, []))[1].append((labels, value))

    add("gpuwatch_build_info", "gauge", {"version": "0.1.0"}, 1)
    add("gpuwatch_cycle_duration_seconds", "gauge", {}, 0.004)
    add("gpuwatch_last_cycle_timestamp_seconds", "gauge", {}, now)
    add("gpuwatch_kernel_log_overruns_total", "counter", {}, 0)
    add("gpuwatch_web_connections_dropped_total", "counter", {"reason": "limit"}, 0)
    for f in ("state.json", "events.jsonl"):
        add("gpuwatch_state_write_errors_total", "counter", {"file": f}, 0)
    for probe in ("threads", "dump"):
        add("gpuwatch_cycle_deferred_probes_total", "counter", {"probe": probe}, 0)
    add("gpuwatch_process_oom_score_adj", "gauge", {}, -900)
    add("gpuwatch_config_last_reload_successful", "gauge", {}, 1)
    add("gpuwatch_config_last_reload_success_timestamp_seconds", "gauge", {}, now - 3600)
    add("gpuwatch_process_memory_limit_bytes", "gauge", {}, 256 * 2**20)
    add("process_resident_memory_bytes", "gauge", {}, 40 * 2**20)
    add("process_cpu_seconds_total", "counter", {}, now % 1000 / 100)
    add("process_open_fds", "gauge", {}, 23)
    add("process_start_time_seconds", "gauge", {}, now - 3600)
    add(
        "gpuwatch_finding",
        "gauge",
        {"kind": "bad_rank_file", "severity": "warning", "job_id": "", "rank": "", "pid": ""},
        1,
    )
    for c in ("procfs", "rankfiles", "nvml", "kernel_log", "pyspy"):
        add("gpuwatch_collector_success", "gauge", {"collector": c}, 1)
        add("gpuwatch_collector_duration_seconds", "gauge", {"collector": c}, 0.002)
        add("gpuwatch_collector_last_success_timestamp_seconds", "gauge", {"collector": c}, now)
    for r in ranks:
        jr = {"job_id": r.job_id, "rank": str(r.rank)}
        g = {"gpu": str(r.gpu), "uuid": f"GPU-{r.gpu:04d}"}
        if r.exit_cause:
            add("gpuwatch_rank_exits_total", "counter", {**jr, "cause": r.exit_cause}, 1)
        if not r.listed:
            continue
        add("gpuwatch_gpu_info", "gauge", {**g, "name": "NVIDIA H100", "pci_bus_id": "0000:3b:00.0"}, 1)
        add("gpuwatch_gpu_memory_total_bytes", "gauge", g, 80 * 2**30)
        add("gpuwatch_gpu_memory_used_bytes", "gauge", g, 40 * 2**30 if r.up else 0)
        add("gpuwatch_gpu_utilization_ratio", "gauge", g, 0.5 if r.up else 0)
        add("gpuwatch_gpu_xid_errors_total", "counter", {**g, "xid": "13"}, 0)
        add(
            "gpuwatch_rank_info",
            "gauge",
            {**jr, "local_rank": str(r.gpu), "pid": str(r.pid), "world_size": str(r.world_size)},
            1,
        )
        add("gpuwatch_rank_up", "gauge", jr, 1 if r.up else 0)
        add("gpuwatch_rank_pod_info", "gauge", {**jr, "uid": f"0b8d1c2e-3f4a-4b5c-8d6e-7f8091a2b3c{r.rank}"}, 1)
        add(
            "gpuwatch_oom_kills_total",
            "counter",
            {**jr, "comm": "python" if r.oom_kills else "", "killer": "kernel" if r.oom_kills else ""},
            r.oom_kills,
        )
        add(
            "gpuwatch_finding",
            "gauge",
            {"kind": "nccl_error_handling_off", "severity": "warning", **jr, "pid": str(r.pid)},
            1,
        )
        if not r.up:
            add(
                "gpuwatch_finding",
                "gauge",
                {
                    "kind": "rank_oom_killed" if r.oom_kills else "rank_down",
                    "severity": "page",
                    **jr,
                    "pid": str(r.pid),
                },
                1,
            )
            continue
        add(
            "gpuwatch_gpu_process_memory_bytes",
            "gauge",
            {**g, "pid": str(r.pid), "comm": "python", "user": "root", **jr},
            40 * 2**30,
        )
        add("gpuwatch_rank_gpu_memory_bytes", "gauge", {**jr, "gpu": str(r.gpu)}, 40 * 2**30)
        add("gpuwatch_rank_open_fds", "gauge", jr, 64)
        add("gpuwatch_rank_max_fds", "gauge", jr, 1024)
        add("gpuwatch_rank_cpu_seconds_total", "counter", jr, now % 1000)
        add("gpuwatch_rank_resident_memory_bytes", "gauge", jr, 2 * 2**30)
        add("gpuwatch_rank_threads", "gauge", jr, 12)
        add("gpuwatch_rank_gil_samples_total", "counter", jr, r.gil_samples)
        add("gpuwatch_rank_gil_held_samples_total", "counter", jr, r.gil_held)
        add("gpuwatch_rank_progress_timestamp_seconds", "gauge", jr, now - (600 if r.stalled else 1))
        add("gpuwatch_rank_stalled", "gauge", jr, 1 if r.stalled else 0)
        add("gpuwatch_rank_step", "gauge", jr, int(now * (10 - r.rank)) if not r.stalled else 100)
        add("gpuwatch_rank_collective_last_started_seq", "gauge", {**jr, "pg": "0"}, 4 if r.stalled else 5)
        add("gpuwatch_rank_collective_last_completed_seq", "gauge", {**jr, "pg": "0"}, 4)
        if any(p.stalled for p in ranks if p.job_id == r.job_id):  # NCCL RAS asked: a suspect job
            add("gpuwatch_nccl_ras_rank_operations", "gauge", jr, 10234 if r.stalled else 10239)
            add("gpuwatch_nccl_ras_rank_operations_unchanged_seconds", "gauge", jr, 90.0)
            add("gpuwatch_nccl_ras_missing_ranks", "gauge", {"job_id": r.job_id, "reason": "dead"}, 1)
            add("gpuwatch_nccl_ras_async_error_ranks", "gauge", {"job_id": r.job_id}, 0)
            add(
                "gpuwatch_nccl_ras_culprit",
                "gauge",
                {"job_id": r.job_id, "nccl_rank": "3", "host": "10.1.0.5", "pid": "4104", "reason": "dead"},
                1,
            )
        for reason in ("gpu_idle", "sw_power_cap", "hw_slowdown", "hw_thermal"):
            add("gpuwatch_gpu_clock_throttled", "gauge", {**g, "reason": reason}, 0)
        add("gpuwatch_cuda_oom_errors_total", "counter", {**jr, "gpu": str(r.gpu)}, 0)
        add("gpuwatch_rank_tree_resident_memory_bytes", "gauge", jr, 6 * 2**30)
        add("gpuwatch_rank_memory_cgroup_usage_bytes", "gauge", jr, 70 * 2**30)
        add("gpuwatch_rank_memory_cgroup_working_set_bytes", "gauge", jr, 66 * 2**30)
        add("gpuwatch_rank_memory_cgroup_limit_bytes", "gauge", jr, 80 * 2**30)
        add("gpuwatch_rank_memory_pressure_waiting_seconds_total", "counter", jr, now % 1000 / 10)
        add("gpuwatch_rank_memory_pressure_stalled_seconds_total", "counter", jr, now % 1000 / 100)
    add("gpuwatch_node_memory_total_bytes", "gauge", {}, 2048 * 2**30)
    add("gpuwatch_node_memory_available_bytes", "gauge", {}, 900 * 2**30)
    add("gpuwatch_node_memory_pressure_waiting_seconds_total", "counter", {}, now % 1000 / 10)
    add("gpuwatch_node_memory_pressure_stalled_seconds_total", "counter", {}, now % 1000 / 100)
    add(
        "gpuwatch_orphan_gpu_memory_bytes",
        "gauge",
        {
            "gpu": "7",
            "uuid": "GPU-0007",
            "pid": "11223",
            "comm": "python",
            "user": "alice",
            "reason": "reparented_to_init",
        },
        55 * 2**30,
    )
    out: list[str] = []
    for name, (typ, samples) in fams.items():
        out.append(f"# HELP {name} {name} (stand-in node for tests).")
        out.append(f"# TYPE {name} {typ}")
        seen: set[str] = set()
        for labels, value in samples:
            line = f"{name}{_fmt_labels(labels)} {value}"
            if line.split(" ")[0] not in seen:
                seen.add(line.split(" ")[0])
                out.append(line)
    return "\n".join(out) + "\n"


# --- dashboard and rule expressions --------------------------------------------------------------
DASHBOARDS = REPO / "grafana" / "dashboards"
RULES = REPO / "deploy" / "prometheus" / "gpuwatchd.rules.yml"
# what the Job and Health dashboards read (fleet scale): load it wherever panels are queried
RECORDING_RULES = REPO / "deploy" / "prometheus" / "gpuwatchd.recording.yml"

# Grafana's variables as a query of the e2e tests fills them in.
GRAFANA_VARS = {
    "$__rate_interval": "4s",
    "$__interval": "1s",
    "$__range": "10m",
    "$rank": ".*",  # the Job dashboard's rank variable at "All"
    "$job": "gpuwatchd",  # the Health dashboard's scrape job (prometheus() names it so)
}
# Series a daemon exports only where the node has the thing they describe: panels that read them
# are empty on a node without it (tests/test_e2e_alerting.py's real daemons), and the stand-in
# node of tests/test_dashboards.py has them.
CONDITIONAL_SERIES = {
    "gpuwatch_rank_pod_info": "ranks in Kubernetes pods",
    "gpuwatch_process_memory_limit_bytes": "a daemon with a memory limit (MemoryMax=, a pod's)",
    "gpuwatch_nccl_ras_": "a suspect NCCL job answering on its RAS port (NCCL >= 2.28)",
}


def dashboard_panels() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every query target of every dashboard."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(path.read_text())
        for panel in d["panels"]:
            for t in panel.get("targets", []):
                out.append((path.name, panel["title"], t["expr"]))
    return out


def dashboard_variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, variable name, the PromQL inside label_values(...))."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(path.read_text())
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                inner = q[len("label_values(") : q.rindex(",")]
                out.append((path.name, v["name"], inner))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def fill_vars(expr: str, **values: str) -> str:
    """``expr`` with Grafana's variables replaced (longest names first)."""
    subs = {**GRAFANA_VARS, **{f"${k}": v for k, v in values.items()}}
    for k in sorted(subs, key=len, reverse=True):
        expr = expr.replace(k, subs[k])
    return expr


# --- real gpuwatchd daemons ------------------------------------------------------------------------
H200_RECORDING = REPO / "tests" / "fixtures" / "nvml" / "h200_orphan_dataloader.json"


def derived_nvml_fixture(path: Path, pids: dict[int, int], xid: int | None = None) -> Path:
    """The H200 recording with its recorded PIDs replaced by live ones (``pids``: recorded ->
    live; recorded PIDs not in ``pids`` are dropped), optionally followed by one Xid event:
    the GPU is the only thing this machine lacks. The recording predates clock event reasons:
    they are set to 0 (clocks not held back), what an unthrottled busy GPU reports."""
    doc = json.loads(H200_RECORDING.read_text())
    for cycle in doc["cycles"]:
        for dev in cycle["devices"]:
            dev.setdefault("clocks_event_reasons", 0)
            for key in ("compute", "graphics", "process_utilization"):
                dev[key] = [dict(p, pid=pids[p["pid"]]) for p in dev.get(key, []) if p["pid"] in pids]
        cycle["nvidia_smi_compute_apps"] = [
            dict(p, pid=pids[p["pid"]]) for p in cycle.get("nvidia_smi_compute_apps", []) if p["pid"] in pids
        ]
    if xid is not None:
        doc["xid_events"] = [{"device": 0, "xid": xid}]
    doc["note"] = "DERIVED at test time from h200_orphan_dataloader.json: PIDs of live processes"
    path.write_text(json.dumps(doc))
    return path


class Daemon:
    """``gpuwatchd run`` as a separate node: own port, rank dir and state dir."""

    def __init__(self, tmp: Path, name: str, **config: Any) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dir = tmp / f"node-{name}"
        self.rank_dir = self.dir / "ranks"
        self.state_dir = self.dir / "state"
        self.rank_dir.mkdir(parents=True)
        self.state_dir.mkdir()
        cfg: dict[str, Any] = {
            "web": {"listen_address": self.address},
            "interval_seconds": 0.5,
            "rank_dir": str(self.rank_dir),
            "state_dir": str(self.state_dir),
            "kernel_log": "kmsg",
            "discovery": {"enabled": False},
            "nvml": {"enabled": False},
            "gil": {"enabled": False},
        }
        for k, v in config.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        self.config = self.dir / "config.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = self.dir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.gpuwatchd = str(Path(sys.executable).with_name("gpuwatchd"))

    def register(
        self, job_id: str, rank: int, pid: int, world_size: int, gpus: str | None = None, heartbeat: Path | None = None
    ) -> None:
        cmd = [
            self.gpuwatchd,
            "register",
            "--job-id",
            job_id,
            "--rank",
            str(rank),
            "--pid",
            str(pid),
            "--world-size",
            str(world_size),
            "--local-rank",
            str(rank),
            "--rank-dir",
            str(self.rank_dir),
        ]
        if gpus is not None:
            cmd += ["--gpus", gpus]
        if heartbeat is not None:
            heartbeat.touch()
            cmd += ["--heartbeat", str(heartbeat)]
        p = run(cmd)
        assert p.returncode == 0, p.stderr

    def start(self) -> Daemon:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [self.gpuwatchd, "run", "--config.file", str(self.config)], stdout=out, stderr=subprocess.STDOUT
            )
        wait_until(lambda: _ready(f"http://{self.address}/metrics") or self._died(), 30, f"daemon {self.address}")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return self

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


FR_RECORDING = REPO / "tests" / "fixtures" / "hang" / "fr_gloo_rank0.json"


def sleeper(
    flight_recorder: tuple[Path, str, int] | None = None, on_cpu: bool = False, until: Path | None = None
) -> subprocess.Popen[bytes]:
    """A live rank that just waits (as a peer blocked in a collective would). With
    ``flight_recorder`` (rank_dir, job_id, rank) it also answers the daemon's flight-recorder
    requests, as a registered rank's thread does, with the dump recorded on the H200 of a rank
    waiting in collective #5 (tests/fixtures/hang/README.md). ``on_cpu``: it spends about half a
    core meanwhile (the GIL sampler skips a rank below 0.3 of a core: daemon/gil.py), until the
    file ``until`` exists: then it waits at 0 % CPU, as a peer blocked in a collective does (a
    heartbeat rank that works on its CPU is progressing, not stalled: join/stall.py)."""
    stop = f"os.path.exists({str(until)!r})" if until is not None else "False"
    wait = (
        "import os\nt0 = time.monotonic()\nwhile time.monotonic() - t0 < 600:\n"
        f"    if {stop}:\n        time.sleep(600)\n"
        "    t = time.monotonic()\n"
        "    while time.monotonic() - t < 0.01:\n        pass\n    time.sleep(0.01)\n"
        if on_cpu
        else "time.sleep(600)\n"
    )
    if flight_recorder is None:
        return subprocess.Popen([sys.executable, "-c", "import time\n" + wait])
    rank_dir, job_id, rank = flight_recorder
    code = (
        "import json, sys, time\nfrom gpuwatchd.rank import flight_recorder as fr\n"
        "rec = json.load(open(sys.argv[1]))['trace']\n"
        "fr.start(sys.argv[2], sys.argv[3], int(sys.argv[4]), dump=lambda: rec)\n" + wait
    )
    return subprocess.Popen([sys.executable, "-c", code, str(FR_RECORDING), str(rank_dir), job_id, str(rank)])
