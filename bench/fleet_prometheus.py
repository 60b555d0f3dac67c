#!/usr/bin/env python3
"""Fleet scale in a real Prometheus: every shipped alert rule and dashboard panel against a
backfilled fleet of gpuwatchd nodes (issue 14, goal 4).

    .venv/bin/python -m bench.fleet_prometheus                     # 1,250 nodes x 8 GPUs, 6 h
    .venv/bin/python -m bench.fleet_prometheus--nodes 50 --hours 1 # a quick run

1. One real node: `gpuwatchd run` with 8 real ranks, 16 DataLoader-style worker children and the
   8-GPU NVML fixture (bench/fleet_node.py); its /metrics is counted and becomes the template.
2. The fleet: `--nodes` copies of that node (own instance, jobs, ranks, pids, UUIDs; values move
   over time; small jobs churn; a few OOM kills, stalls and Xids), one sample per `--interval`
   over `--hours`, streamed as OpenMetrics (bench/fleet_openmetrics.py) into a file, then
   `promtool tsdb create-blocks-from openmetrics` (one block) and the file is deleted. The data
   run `--margin-minutes` into the future so that the rules, evaluated at the real "now", see it.
3. A real Prometheus on 127.0.0.1 (query concurrency 2, no scrape jobs) loads the blocks and the
   shipped rule files. Recording rules (of both files: gpuwatchd.rules.yml records a few beside
   the alerts that use them) are backfilled over the same range with `promtool tsdb
   create-blocks-from rules` (as one would after adding them to a running fleet), then Prometheus
   restarts with those blocks as well.
4. Every dashboard panel query (variables filled as Grafana does for the default 3 h range:
   step = $__interval = the scrape interval, $__rate_interval = 4 x scrape interval) runs
   `--runs` times: p50/p99 wall time per panel, client side, response read in full. Then each
   rule group's evaluationTime (Prometheus's /api/v1/rules) over `--evals` evaluations, and the
   alerts that fire.

Needs the Debian prometheus package (prometheus, promtool) and the repo's venv. Disk: the
OpenMetrics file (~140 B per sample: ~21 GB at full scale, estimated and checked before writing)
plus the blocks (~1.3 B per sample). Everything runs under `nice`; Prometheus is stopped and the
work directory deleted at the end (--keep keeps it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from bench.benchlib import REPO, free_port, pct
from bench.fleet_node import FIXTURE, node_exposition
from bench.fleet_openmetrics import SCRAPE_SERIES, Fleet, default_incidents, parse_exposition

PROM_DIR = REPO / "deploy" / "prometheus"
ALERT_RULES = PROM_DIR / "gpuwatchd.rules.yml"
RECORDING_RULES = PROM_DIR / "gpuwatchd.recording.yml"
DASHBOARDS = REPO / "grafana" / "dashboards"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
NICE = ["nice", "-n", "10"]
BYTES_PER_SAMPLE = 140  # measured on the generator's output (labels of a gpuwatchd node)


def say(*a: object) -> None:
    print(*a, flush=True)


# --- Prometheus ----------------------------------------------------------------------------------
class Prom:
    def __init__(self, workdir: Path, rule_files: list[Path], eval_interval: str) -> None:
        self.dir = workdir
        self.data = workdir / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {
            "global": {"scrape_interval": "30s", "evaluation_interval": eval_interval},
            "rule_files": [str(p) for p in rule_files],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600) -> float:
        t0 = time.monotonic()
        log = (self.dir / "prometheus.log").open("ab")
        # not niced (unlike the generator and promtool): its timings are the measurement
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.data}",
                "--storage.tsdb.retention.time=30d",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--query.max-concurrency=2",
                "--query.timeout=2m",
                "--log.level=error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GOMAXPROCS": "2"},
        )
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError((self.dir / "prometheus.log").read_text()[-3000:])
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError("Prometheus not ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str, params: dict[str, str]) -> tuple[float, bytes]:
        url = self.url + path + "?" + urllib.parse.urlencode(params)
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=180) as r:
            body = r.read()
        return time.perf_counter() - t0, body

    def query(self, expr: str) -> list[dict[str, Any]]:
        _, body = self.get("/api/v1/query", {"query": expr})
        return list(json.loads(body)["data"]["result"])


# --- what to run ---------------------------------------------------------------------------------
def panel_queries() -> list[tuple[str, str, dict[str, Any]]]:
    """(dashboard, panel title, target) for every target of every panel."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for p in json.loads(path.read_text())["panels"]:
            for t in p.get("targets", []):
                out.append((path.stem.removeprefix("gpuwatchd-"), p["title"], t))
    return out


def variable_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, metric selector, label) of every label_values(...) variable."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for v in json.loads(path.read_text())["templating"]["list"]:
            if v["type"] == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                inner = q[len("label_values(") : -1]
                sel, _, label = inner.rpartition(",")
                out.append((path.stem.removeprefix("gpuwatchd-"), v["name"], sel.strip(), label.strip()))
    return out


def fill(expr: str, subs: dict[str, str]) -> str:
    for k in sorted(subs, key=len, reverse=True):
        expr = expr.replace(k, subs[k])
    return expr


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the phases ----------------------------------------------------------------------------------
def measure_node() -> str:
    say("== 1. one real node: gpuwatchd run, 8 ranks + 16 DataLoader workers, 8 fixture GPUs")
    say(f"   NVML fixture: {FIXTURE.relative_to(REPO)} (derived from the H200 recording)")
    t0 = time.monotonic()
    text = node_exposition()
    tpl = parse_exposition(text)
    fams = Counter(s.name for s in tpl)
    say(
        f"   /metrics after {time.monotonic() - t0:.1f} s: {len(tpl)} series from gpuwatchd "
        f"in {len(fams)} families, + {len(SCRAPE_SERIES)} Prometheus adds per target "
        f"= {len(tpl) + len(SCRAPE_SERIES)} series per node ({len(text)} bytes)"
    )
    per_gpu = {n: c for n, c in fams.items() if c >= 8}
    say(
        f"   per GPU/rank (x8): {sum(per_gpu.values())} series in {len(per_gpu)} families; "
        f"per node: {len(tpl) - sum(per_gpu.values())}"
    )
    for name, c in sorted(fams.items(), key=lambda x: (-x[1], x[0])):
        say(f"     {c:4d}  {name}")
    return text


def generate(fleet: Fleet, path: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    n = 0
    with path.open("w", buffering=8 << 20) as f:
        for chunk in fleet.lines():
            f.write(chunk)
            n += len(chunk)
    return n, time.monotonic() - t0


def run_timed(cmd: list[str], cwd: Path | None = None) -> tuple[float, str]:
    t0 = time.monotonic()
    p = subprocess.run([*NICE, *cmd], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return time.monotonic() - t0, p.stdout


def wait_compacted(prom: Prom, timeout: float = 900) -> float:
    """Prometheus merges the recorded blocks into the fleet block (they overlap in time) at its
    first compaction, a minute after start: wait for it, so that it does not run during the
    timings."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        blocks = [d for d in prom.data.iterdir() if (d / "meta.json").exists()]
        if len(blocks) == 1:
            return time.monotonic() - t0
        time.sleep(5)
    raise RuntimeError("blocks not compacted")


def bench_panels(
    prom: Prom, fleet: Fleet, args: argparse.Namespace, node: str, job: str
) -> list[tuple[str, str, float, float, int]]:
    iv = int(args.interval)
    subs = {
        "$__rate_interval": f"{4 * iv}s",
        "$__interval": f"{iv}s",
        "$__range": f"{int(args.range_hours * 3600)}s",
        "$instance": node,
        "$job_id": job,
    }
    rows = []
    for dash, title, t in panel_queries():
        expr = fill(t["expr"], subs)
        times: list[float] = []
        body = b""
        for _ in range(args.runs):
            now = time.time()
            if t.get("instant"):
                dt, body = prom.get("/api/v1/query", {"query": expr, "time": f"{now:.3f}"})
            else:
                dt, body = prom.get(
                    "/api/v1/query_range",
                    {
                        "query": expr,
                        "start": f"{now - args.range_hours * 3600:.0f}",
                        "end": f"{now:.0f}",
                        "step": f"{iv}s",
                    },
                )
            times.append(dt)
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise RuntimeError(f"{dash}/{title}: {doc}")
        kind = "instant" if t.get("instant") else "range"
        rows.append(
            (
                f"{dash} / {title} [{t['refId']}] ({kind})",
                expr,
                pct(times, 0.5),
                pct(times, 0.99),
                len(doc["data"]["result"]),
            )
        )
    for dash, name, sel, label in variable_queries():
        times = []
        for _ in range(args.runs):
            now = time.time()
            dt, body = prom.get(
                f"/api/v1/label/{label}/values",
                {"match[]": sel, "start": f"{now - args.range_hours * 3600:.0f}", "end": f"{now:.0f}"},
            )
            times.append(dt)
        rows.append(
            (
                f"{dash} / variable ${name} (label values)",
                sel,
                pct(times, 0.5),
                pct(times, 0.99),
                len(json.loads(body)["data"]),
            )
        )
    return rows


def bench_rules(prom: Prom, evals: int, interval: float, per_rule: dict[str, list[float]]) -> dict[str, list[float]]:
    """evaluationTime of each rule group (and of each rule, into `per_rule`) after each of
    `evals` evaluations."""
    seen: dict[str, list[tuple[str, float]]] = {}
    deadline = time.monotonic() + interval * (evals + 3) + 60
    while time.monotonic() < deadline:
        _, body = prom.get("/api/v1/rules", {})
        for g in json.loads(body)["data"]["groups"]:
            key = f"{Path(g['file']).name}: {g['name']}"
            runs = seen.setdefault(key, [])
            if g.get("lastEvaluation", "").startswith("0001") or g["evaluationTime"] == 0:
                continue
            if not runs or runs[-1][0] != g["lastEvaluation"]:
                runs.append((g["lastEvaluation"], float(g["evaluationTime"])))
                if len(runs) > 1:
                    for r in g["rules"]:
                        per_rule.setdefault(r["name"], []).append(float(r["evaluationTime"]))
        if seen and all(len(r) >= evals + 1 for r in seen.values()):
            break
        time.sleep(1)
    # the first evaluation after a (re)start is dropped: caches are cold
    return {k: [t for _, t in r[1:]] or [t for _, t in r] for k, r in seen.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--hours", type=float, default=6.0, help="time span of the backfilled data")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    ap.add_argument(
        "--margin-minutes",
        type=float,
        default=60.0,
        help="how far the data run past the start time (covers the run itself)",
    )
    ap.add_argument("--eval-interval", default="15s", help="rule evaluation_interval (shipped: 15s)")
    ap.add_argument("--range-hours", type=float, default=3.0, help="dashboard time range")
    ap.add_argument("--runs", type=int, default=10, help="runs per panel query")
    ap.add_argument("--evals", type=int, default=5, help="rule evaluations to time")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)

    say(
        f"== 0. machine: {os.cpu_count()} cores, load average {_load()} at the start (1, 5, 15 min;"
        " other work on the machine shares the cores: every timing below is an upper bound)\n"
    )
    text = measure_node()
    tpl = parse_exposition(text)
    now = time.time()
    end = now + args.margin_minutes * 60
    fleet = Fleet(tpl, nodes=args.nodes, start=end - args.hours * 3600, end=end, interval=args.interval)
    fleet.incidents = default_incidents(fleet, now)
    est = fleet.samples_estimate()
    say(
        f"\n== 2. fleet: {args.nodes} nodes x {fleet.gpus} GPUs = {args.nodes * fleet.gpus} GPUs, "
        f"{len(fleet.jobs)} jobs (largest {fleet.jobs[0][1]} nodes), "
        f"{args.nodes * fleet.per_node} live series, one sample per {args.interval:g} s over "
        f"{args.hours:g} h (to {args.margin_minutes:g} min past now)"
    )
    say(
        "   incidents: " + ", ".join(f"{i.kind} node {i.node} at now{(i.at - now) / 60:+.0f}m" for i in fleet.incidents)
    )
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gwfleet-prom-"))
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    need = est * BYTES_PER_SAMPLE
    say(
        f"   estimate: {est / 1e6:.1f} M samples, {need / 2**30:.1f} GiB of OpenMetrics "
        f"(free on {work}: {free / 2**30:.1f} GiB)"
    )
    if need * 1.2 > free:
        say("   not enough disk: use --nodes/--hours/--interval to shrink the run")
        return 2
    prom: Prom | None = None
    try:
        om = work / "fleet.om"
        nbytes, dt = generate(fleet, om)
        say(f"   generated {nbytes / 2**30:.2f} GiB in {dt:.0f} s ({est / dt / 1e6:.2f} M samples/s)")
        dt, out = run_timed(
            [
                PROMTOOL,
                "tsdb",
                "create-blocks-from",
                "openmetrics",
                "--max-block-duration=54h",
                str(om),
                str(work / "data"),
            ]
        )
        om.unlink()
        say(f"   promtool create-blocks-from openmetrics: {dt:.0f} s ({est / dt / 1e6:.2f} M samples/s)")
        for line in out.splitlines():
            say("     " + line)

        say(
            "\n== 3. Prometheus "
            + subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        )
        rules = [ALERT_RULES] + ([RECORDING_RULES] if RECORDING_RULES.exists() else [])
        prom = Prom(work, rules, args.eval_interval)
        say(f"   ready in {prom.start():.1f} s; rule files: {', '.join(p.name for p in rules)}")
        if RECORDING_RULES.exists():
            rec_dir = work / "recorded"
            dt, out = run_timed(
                [
                    PROMTOOL,
                    "tsdb",
                    "create-blocks-from",
                    "rules",
                    f"--start={int(fleet.start)}",
                    f"--end={int(fleet.end)}",
                    f"--url={prom.url}",
                    f"--eval-interval={int(args.interval)}s",
                    f"--output-dir={rec_dir}",
                    *map(str, rules),
                ]
            )
            say(f"   promtool create-blocks-from rules (backfill of the recording rules): {dt:.0f} s")
            prom.stop()
            for b in rec_dir.iterdir():
                if b.is_dir():
                    shutil.move(str(b), work / "data" / b.name)
            say(f"   restarted with the recorded blocks, ready in {prom.start():.1f} s")
            dt = wait_compacted(prom)
            say(f"   overlapping blocks vertically compacted into one after {dt:.0f} s")
        _, body = prom.get("/api/v1/status/tsdb", {})
        head = json.loads(body)["data"]["headStats"]
        say(f"   TSDB head: {head['numSeries']} series (the blocks hold the backfill)")
        size = sum(p.stat().st_size for p in (work / "data").rglob("*") if p.is_file())
        say(f"   data directory: {size / 2**20:.0f} MiB")

        node = fleet.instance(fleet.incidents[0].node if fleet.incidents else 0)
        job = fleet.largest_job()
        say(
            f"\n== 4. dashboard panels: {args.runs} runs each, range {args.range_hours:g} h, "
            f"step {args.interval:g} s; $instance={node}, $job_id={job} "
            f"({fleet.jobs[0][1] * fleet.gpus} ranks)"
        )
        say(f"   load average before: {_load()} (the 2 cores are shared)")
        rows = bench_panels(prom, fleet, args, node, job)
        w = max(len(r[0]) for r in rows)
        say(f"   {'panel':<{w}}  {'p50 s':>7} {'p99 s':>7} {'series':>7}")
        for name, _, p50, p99, n in rows:
            flag = "  <-- over 1 s" if p99 >= 1 else ""
            say(f"   {name:<{w}}  {p50:7.3f} {p99:7.3f} {n:7d}{flag}")
        slow = [r for r in rows if r[3] >= 1]
        say(
            f"   {len(rows)} queries; slowest p99 {max(r[3] for r in rows):.3f} s "
            f"({max(rows, key=lambda r: r[3])[0]}); {len(slow)} over 1 s"
        )
        say(f"   load average after: {_load()}")

        say(
            f"\n== 5. rule groups: evaluationTime over {args.evals} evaluations "
            f"(evaluation_interval {args.eval_interval})"
        )
        sec = float(args.eval_interval.rstrip("s"))
        say(f"   load average before: {_load()}")
        per_rule: dict[str, list[float]] = {}
        groups = bench_rules(prom, args.evals, sec, per_rule)
        total_p50 = total_max = 0.0
        for g, ts in sorted(groups.items()):
            total_p50 += statistics.median(ts)
            total_max += max(ts)
            say(f"   {g:<45} p50 {statistics.median(ts):.3f} s  max {max(ts):.3f} s  ({len(ts)} evaluations)")
        say(f"   whole rule set (sum of the groups): p50 {total_p50:.3f} s, max {total_max:.3f} s")
        for name, ts in sorted(per_rule.items(), key=lambda x: -statistics.median(x[1])):
            say(f"     rule {name:<55} p50 {statistics.median(ts):.3f} s  max {max(ts):.3f} s")
        say(f"   load average after: {_load()}")
        _, body = prom.get("/api/v1/alerts", {})
        alerts = Counter((a["labels"]["alertname"], a["state"]) for a in json.loads(body)["data"]["alerts"])
        say("   alerts: " + (", ".join(f"{n} {s} x{c}" for (n, s), c in sorted(alerts.items())) or "none"))
    finally:
        if prom is not None:
            prom.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
