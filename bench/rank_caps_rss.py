#!/usr/bin/env python3
"""The daemon's memory at the rank caps (issue 23 N11): VmRSS and its peak, the cycle time and the
number of series with N root-owned rank files (one rank each, 256 ranks a job, naming 64 live
processes), for several N, each run of ``gpuwatchd run`` with the shipped defaults (GIL sampling
and discovery on; kernel log and NVML off: no GPU here) for ``--seconds``.

    python3 -m bench.rank_caps_rss [--ranks 0,1000,2000,4096] [--seconds 60] [--before PATH]

Prints one line per N, and RSS per 1,000 ranks over the N=0 run; with ``--before`` the same runs
of another checkout (the code before a change, with this one's interpreter) come first, in the
same invocation. Root-owned files are the worst case: the
per-owner caps do not apply to root, only the file cap (4096) and the node cap.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.benchlib import REPO, free_port, proc_status

SLEEP = "import time\nwhile True:\n    time.sleep(1)\n"


def _status(pid: int) -> dict[str, int]:
    return {k: v // 1024 for k, v in proc_status(pid, ("VmRSS", "VmHWM")).items()}  # MiB


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def run(n: int, pids: list[int], seconds: float, repo: Path) -> dict[str, float]:
    world = Path(tempfile.mkdtemp(prefix="gw-capsrss-"))
    ranks = world / "ranks"
    ranks.mkdir()
    for i in range(n):
        (ranks / f"r{i:05d}.json").write_text(
            json.dumps(
                {"version": 1, "job_id": f"job{i // 256}", "ranks": [{"rank": i % 256, "pid": pids[i % len(pids)]}]}
            )
        )
    port = free_port()
    cfg = world / "config.yaml"
    cfg.write_text(
        f'web: {{listen_address: "127.0.0.1:{port}"}}\nrank_dir: {ranks}\n'
        f'state_dir: {world / "state"}\nkernel_log: "off"\nnvml: {{enabled: false}}\n'
        f"gil: {{pyspy_path: {Path(sys.executable).parent / 'py-spy'}}}\n"
    )
    d = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        t0 = time.monotonic()
        text = ""
        while "gpuwatch_last_cycle_timestamp_seconds" not in text and time.monotonic() - t0 < 120:
            time.sleep(0.5)
            text = _metrics(port)
        start = _status(d.pid)["VmRSS"]
        while time.monotonic() - t0 < seconds:
            time.sleep(5)
            text = _metrics(port) or text
        st = _status(d.pid)
        series = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
        cycle = next(
            (float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("gpuwatch_cycle_duration_seconds ")),
            float("nan"),
        )
        up = sum(1 for ln in text.splitlines() if ln.startswith("gpuwatch_rank_up{"))
        return {
            "n": n,
            "rss_start": start,
            "rss": st["VmRSS"],
            "hwm": st["VmHWM"],
            "series": series,
            "cycle": cycle,
            "ranks_up": up,
        }
    finally:
        d.terminate()
        d.wait(20)
        shutil.rmtree(world, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="0,1000,2000,4096")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--before", type=Path, default=None)
    args = ap.parse_args()
    procs = [subprocess.Popen([sys.executable, "-c", SLEEP]) for _ in range(64)]
    repos = [*([args.before] if args.before else []), REPO]
    try:
        table = {
            repo: [run(int(n), [p.pid for p in procs], args.seconds, repo) for n in args.ranks.split(",")]
            for repo in repos
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print(
        f"# {sys.version.split()[0]}, {args.seconds:.0f} s each, 64 live processes, root-owned files of one rank each"
    )
    print(
        f"{'checkout':<16} {'files':>6} {'ranks up':>8} {'RSS start':>9} {'RSS end':>8} "
        f"{'peak':>6} {'MB/1000 ranks':>13} {'cycle s':>8} {'series':>7}"
    )
    for repo, rows in table.items():
        base = rows[0]["rss"]
        for r in rows:
            per = (r["rss"] - base) / r["ranks_up"] * 1000 if r["ranks_up"] else 0.0
            print(
                f"{str(repo)[-16:]:<16} {r['n']:>6} {r['ranks_up']:>8} {r['rss_start']:>7} MB "
                f"{r['rss']:>5} MB {r['hwm']:>3} MB {per:>10.1f} MB {r['cycle']:>8.2f} "
                f"{r['series']:>7}"
            )


if __name__ == "__main__":
    main()
