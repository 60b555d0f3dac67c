"""Kernel OOM kill -> metric and -> Alertmanager latency, over real kills.

Starts a real Alertmanager (``prometheus-alertmanager``) and the real daemon (``gpuwatchd run``,
kernel_log=kmsg, direct push to that Alertmanager) on loopback with unique ports, then N times:
start a rank process in a 64 MiB memory cgroup, register it, wait until the daemon has seen it
(its ``gpuwatch_oom_kills_total`` series exists at 0), let it allocate 256 MiB, and measure from
the kernel's own timestamp of the ``Killed process`` line to

- the first ``/metrics`` scrape showing the rank's counter at 1 (target p99 <= 1 s), and
- the first ``GET /api/v2/alerts`` of Alertmanager listing ``GPURankOOMKilled`` for that rank
  (target p99 <= 2 s).

The kernel's timestamp (printk's local_clock, µs since boot; stored by the daemon as
``fields.monotonic_usec`` of the event) is compared with CLOCK_MONOTONIC, which is the same clock
here up to a few µs; the latency from the parent's waitpid() return is printed as well.

Run as root: ``.venv/bin/python -m bench.oom_latency [--kills 20] [--interval 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.benchlib import REPO, free_port, pct
from tests.daemonutil import DaemonProc, write_config
from tests.kernel_oom_helpers import MemCgroup, go


def start_alertmanager(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = tmp / "am.yml"
    cfg.write_text(yaml.safe_dump({"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}))
    proc = subprocess.Popen(
        [
            "prometheus-alertmanager",
            f"--config.file={cfg}",
            f"--storage.path={tmp / 'am'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/-/ready", timeout=1).read()
            return proc, url
        except OSError:
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError("alertmanager did not start") from None
            time.sleep(0.1)


def am_has(url: str, job: str, rank: str) -> bool:
    with urllib.request.urlopen(url + "/api/v2/alerts?filter=alertname%3D%22GPURankOOMKilled%22", timeout=2) as r:
        alerts: list[dict[str, Any]] = json.load(r)
    return any(a["labels"].get("job_id") == job and a["labels"].get("rank") == rank for a in alerts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--interval", type=float, default=5.0, help="daemon interval_seconds")
    ap.add_argument("--poll", type=float, default=0.01, help="scrape/query period in seconds")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gw_h4_bench_"))
    am, am_url = start_alertmanager(tmp)
    path, cfg = write_config(tmp, kernel_log="kmsg", interval_seconds=args.interval, alertmanager={"url": am_url})
    d = DaemonProc(path, cfg)
    job = f"bench-{os.getpid()}"
    to_metric: list[float] = []
    to_alert: list[float] = []
    from_wait: list[float] = []
    try:
        for i in range(args.kills):
            cg = MemCgroup("bench")
            try:
                rank = cg.spawn()
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "gpuwatchd",
                        "register",
                        "--rank-dir",
                        cfg["rank_dir"],
                        "--job-id",
                        job,
                        "--rank",
                        str(i),
                        "--pid",
                        str(rank.pid),
                    ],
                    check=True,
                    capture_output=True,
                    cwd=REPO,
                )
                d.wait_for(
                    lambda i=i: d.value("gpuwatch_oom_kills_total", job_id=job, rank=str(i)) == 0.0,
                    timeout=3 * args.interval + 10,
                    what=f"rank {i} observed",
                )
                go(rank)
                rank.wait(30)
                t_wait = time.monotonic()
                t_metric = t_alert = None
                while t_metric is None or t_alert is None:
                    now = time.monotonic()
                    if now - t_wait > 30:
                        raise RuntimeError(f"kill {i}: metric={t_metric} alert={t_alert}\n{d.log()}")
                    if t_metric is None and d.value("gpuwatch_oom_kills_total", job_id=job, rank=str(i)) == 1.0:
                        t_metric = time.monotonic()
                    if t_alert is None and am_has(am_url, job, str(i)):
                        t_alert = time.monotonic()
                    time.sleep(args.poll)
                ev = [json.loads(x) for x in (Path(cfg["state_dir"]) / "events.jsonl").read_text().splitlines()]
                (e,) = [e for e in ev if e["job_id"] == job and e["rank"] == str(i)]
                t_kill = e["fields"]["monotonic_usec"] / 1e6
                to_metric.append(t_metric - t_kill)
                to_alert.append(t_alert - t_kill)
                from_wait.append(t_metric - t_wait)
                print(
                    f"kill {i + 1:2d}/{args.kills}: pid {rank.pid} -> metric {to_metric[-1] * 1e3:7.1f} ms,"
                    f" alertmanager {to_alert[-1] * 1e3:7.1f} ms",
                    flush=True,
                )
            finally:
                cg.remove()
    finally:
        d.stop()
        am.terminate()
        am.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)

    def line(name: str, xs: list[float], target: float) -> str:
        p99 = pct(xs, 0.99)
        return (
            f"{name:<28} n={len(xs)} p50={pct(xs, 0.5) * 1e3:7.1f} ms  p99={p99 * 1e3:7.1f} ms  "
            f"max={max(xs) * 1e3:7.1f} ms  mean={statistics.mean(xs) * 1e3:7.1f} ms  "
            f"target p99 <= {target:.0f} s: {'PASS' if p99 <= target else 'FAIL'}"
        )

    print()
    print(
        f"daemon interval_seconds={args.interval:g}, poll every {args.poll * 1e3:.0f} ms, kernel {os.uname().release}"
    )
    print(line("kill -> /metrics", to_metric, 1.0))
    print(line("kill -> Alertmanager (push)", to_alert, 2.0))
    print(line("waitpid -> /metrics", from_wait, 1.0))
    ok = pct(to_metric, 0.99) <= 1.0 and pct(to_alert, 0.99) <= 2.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
