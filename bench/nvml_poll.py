#!/usr/bin/env python3
"""Benchmark on a GPU node: NVML poll cost per cycle, and daemon CPU next to nvitop-exporter.

    python3 bench/nvml_poll.py --procs 9 --gib 1 --seconds 60 --out bench.json

1. Starts ``--procs`` torch processes that each hold ``--gib`` GiB (tests/gpu/holder.py) and
   registers them as ranks of one job (so the daemon does its whole per-rank work on them).
2. Poll cost: ``NvmlSource.read()`` (devices + compute/graphics processes + per-process
   utilisation) timed over ``--polls`` cycles; ``nvidia-smi --query-compute-apps`` timed for scale.
3. CPU: ``gpuwatchd run`` and ``nvitop-exporter`` side by side, both at ``--interval`` seconds and
   both scraped every ``--interval`` seconds over loopback, watching the same processes for
   ``--seconds``; CPU = utime+stime (+ reaped children) from /proc/PID/stat. Reports the ratio.
GIL sampling is off for the daemon here (nvitop has no equivalent); everything else is on.
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
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuwatchd.sources.nvml import NvmlSource  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / tick  # utime stime cutime cstime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read()
    return time.perf_counter() - t0, len(body)


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            scrape(url)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=9)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--polls", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--record", default="", help="also record the NVML readings to this JSON")
    ap.add_argument("--baseline", action="store_true",
                    help="also run a third process: gpuwatchd with nvml.enabled false, to "
                    "attribute the daemon's CPU to its GPU part")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatch-bench-"))
    rank_dir = tmp / "ranks"
    rank_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holders: list[subprocess.Popen[bytes]] = []
    servers: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"procs": args.procs, "gib_each": args.gib}
    logs = contextlib.ExitStack()
    try:
        for i in range(args.procs):
            holders.append(subprocess.Popen(
                [sys.executable, str(REPO / "tests/gpu/holder.py"), "--gib", str(args.gib),
                 "--ready-file", str(tmp / f"h{i}.pid")]))
        deadline = time.monotonic() + 180
        while not all((tmp / f"h{i}.pid").exists() for i in range(args.procs)):
            assert time.monotonic() < deadline, "holders did not start"
            time.sleep(0.2)
        for i in range(args.procs):
            pid = int((tmp / f"h{i}.pid").read_text())
            subprocess.run([sys.executable, "-m", "gpuwatchd", "register", "--job-id", "bench",
                            "--rank", str(i), "--pid", str(pid), "--rank-dir", str(rank_dir)],
                           check=True, env=env, cwd=str(REPO), capture_output=True)

        # --- 1. NVML poll cost -------------------------------------------------------------
        src = NvmlSource()
        devices, procs = src.read()
        samples = []
        for _ in range(args.polls):
            t0 = time.perf_counter()
            devices, procs = src.read()
            samples.append(time.perf_counter() - t0)
        src.close()
        smi = []
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader"], capture_output=True, check=True)
            smi.append(time.perf_counter() - t0)
        samples.sort()
        result["poll"] = {
            "gpus": len(devices),
            "gpu_processes": len(procs),
            "polls": len(samples),
            "mean_ms": statistics.mean(samples) * 1e3,
            "p50_ms": samples[len(samples) // 2] * 1e3,
            "p99_ms": samples[int(len(samples) * 0.99) - 1] * 1e3,
            "max_ms": samples[-1] * 1e3,
            "nvidia_smi_query_mean_ms": statistics.mean(smi) * 1e3,
        }
        print(f"NVML poll: {len(procs)} GPU processes on {len(devices)} GPU(s): "
              f"mean {result['poll']['mean_ms']:.2f} ms, p50 {result['poll']['p50_ms']:.2f} ms, "
              f"p99 {result['poll']['p99_ms']:.2f} ms per cycle "
              f"(nvidia-smi --query-compute-apps: {result['poll']['nvidia_smi_query_mean_ms']:.0f}"
              f" ms)", flush=True)

        if args.record:
            subprocess.run([sys.executable, str(REPO / "tools/record_nvml.py"), "--cycles", "2",
                            "--out", args.record, "--note",
                            f"H200: {args.procs} torch processes holding {args.gib} GiB each, "
                            "registered as ranks 0..N-1 of job 'bench' (bench/nvml_poll.py)"],
                           check=True)

        # --- 2. daemon vs nvitop-exporter ---------------------------------------------------
        daemons: dict[str, subprocess.Popen[bytes]] = {}
        variants = [("gpuwatchd", 19863, "")]
        if args.baseline:
            variants.append(("gpuwatchd-nvml-off", 19865, "nvml:\n  enabled: false\n"))
        for name, port, extra in variants:
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(f"rank_dir: {rank_dir}\nstate_dir: {tmp / name}\ninterval_seconds: "
                           f"{args.interval}\nkernel_log: 'off'\ngil:\n  enabled: false\n"
                           f"web:\n  listen_address: '127.0.0.1:{port}'\n{extra}")
            daemons[name] = subprocess.Popen(
                [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)], env=env,
                cwd=str(REPO), stdout=subprocess.DEVNULL,
                stderr=logs.enter_context((tmp / f"{name}.log").open("wb")))
            servers.append(daemons[name])
        daemon = daemons["gpuwatchd"]
        exporter_bin = shutil.which("nvitop-exporter")
        exporter_cmd = [exporter_bin] if exporter_bin else [sys.executable, "-m",
                                                            "nvitop_exporter"]
        nvitop = subprocess.Popen([*exporter_cmd, "--bind-address", "127.0.0.1", "--port",
                                   "19864", "--interval", str(args.interval)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=logs.enter_context((tmp / "n.log").open("wb")))
        servers.append(nvitop)
        urls = {"gpuwatchd": "http://127.0.0.1:19863/metrics",
                "nvitop-exporter": "http://127.0.0.1:19864/metrics"}
        if args.baseline:
            urls["gpuwatchd-nvml-off"] = "http://127.0.0.1:19865/metrics"
        for u in urls.values():
            wait_http(u)
        time.sleep(args.interval)  # warm-up: one full cycle each
        pids = {**{k: p.pid for k, p in daemons.items()}, "nvitop-exporter": nvitop.pid}
        start = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.monotonic()
        scrapes: dict[str, list[float]] = {k: [] for k in urls}
        sizes: dict[str, int] = {}
        while time.monotonic() - t0 < args.seconds:
            for k, u in urls.items():
                dt, n = scrape(u)
                scrapes[k].append(dt)
                sizes[k] = n
            time.sleep(args.interval)
        wall = time.monotonic() - t0
        cpu = {k: cpu_seconds(p) - start[k] for k, p in pids.items()}
        body = urllib.request.urlopen(urls["gpuwatchd"], timeout=10).read().decode()
        result["cpu"] = {
            "seconds": wall,
            "interval_seconds": args.interval,
            "gpuwatchd_cpu_seconds": cpu["gpuwatchd"],
            "nvitop_exporter_cpu_seconds": cpu["nvitop-exporter"],
            "gpuwatchd_cpu_percent_of_core": 100 * cpu["gpuwatchd"] / wall,
            "nvitop_exporter_cpu_percent_of_core": 100 * cpu["nvitop-exporter"] / wall,
            "cpu_seconds_all": cpu,
            "ratio_gpuwatchd_over_nvitop": cpu["gpuwatchd"] / cpu["nvitop-exporter"]
            if cpu["nvitop-exporter"] else None,
            "gpuwatchd_rss_mib": rss_mib(daemon.pid),
            "nvitop_exporter_rss_mib": rss_mib(nvitop.pid),
            "scrape_ms_mean": {k: statistics.mean(v) * 1e3 for k, v in scrapes.items()},
            "exposition_bytes": sizes,
            "gpuwatchd_process_series": sum(
                1 for line in body.splitlines()
                if line.startswith("gpuwatch_gpu_process_memory_bytes{")),
            "gpuwatchd_nvml_collector_line": next(
                (line for line in body.splitlines()
                 if line.startswith('gpuwatch_collector_duration_seconds{collector="nvml"}')), ""),
        }
        c = result["cpu"]
        print(f"CPU over {wall:.0f} s at {args.interval:g} s interval, scraped every "
              f"{args.interval:g} s: gpuwatchd {c['gpuwatchd_cpu_seconds']:.2f} s "
              f"({c['gpuwatchd_cpu_percent_of_core']:.2f} % of a core, RSS "
              f"{c['gpuwatchd_rss_mib']:.0f} MiB), nvitop-exporter "
              f"{c['nvitop_exporter_cpu_seconds']:.2f} s "
              f"({c['nvitop_exporter_cpu_percent_of_core']:.2f} %, RSS "
              f"{c['nvitop_exporter_rss_mib']:.0f} MiB); ratio gpuwatchd/nvitop = "
              f"{c['ratio_gpuwatchd_over_nvitop']:.2f}", flush=True)
        print(f"CPU seconds of each process in the same window: {c['cpu_seconds_all']}",
              flush=True)
        print(f"scrape mean ms: {c['scrape_ms_mean']}; gpuwatchd process series "
              f"{c['gpuwatchd_process_series']}; {c['gpuwatchd_nvml_collector_line']}", flush=True)
    finally:
        for p in servers + holders:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in servers + holders:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        logs.close()
        for name in ("gpuwatchd.log", "gpuwatchd-nvml-off.log", "n.log"):
            log = tmp / name
            if log.exists() and log.stat().st_size:
                print(f"--- {name} (tail)\n{log.read_text()[-1500:]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
