#!/usr/bin/env python3
"""Benchmark of the per-cycle cost (issue 2, DESIGN §7), side by side with process-exporter.

For N in (16, 64, 256): starts N real processes holding ~1000 open fds each, registers them as
ranks, then measures
  * gpuwatchd: CPU seconds per cycle (the real Daemon.cycle(): rank files, /proc, join), in-process
    with nothing else running in this process;
  * /metrics latency p50/p99 of a real `gpuwatchd run` scraped over loopback, and its RSS;
  * Debian's prometheus-process-exporter watching exactly the same processes (matched by a marker in
    their command line): CPU seconds per scrape, from its /proc/PID/stat utime+stime;
and prints the ratio. Also the /metrics latency for a synthetic 8 GPU x 64 process state.

    .venv/bin/python -m bench.bench_daemon [--sizes 16,64,256] [--cycles 50]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.benchlib import REPO, cpu_seconds, free_port, pct, rss_kib
from gpuwatchd.config.schema import Config, DiscoveryConfig, GilConfig, NvmlConfig, WebConfig
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.wiring import build_parts, no_parts
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.model import GpuDevice, GpuProcessRow, NodeState, ProcessInfo, RankState
from gpuwatchd.rank.rankfile import write_rank_file

MARKER = "gpuwatchd-bench-rank"
CHILD = (
    "import os, resource, sys, threading, time\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))\n"
    "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(1000)]\n"
    "idle = threading.Event()\n"
    "for _ in range(int(os.environ.get('BENCH_THREADS', '1')) - 1):\n"
    "    threading.Thread(target=idle.wait, daemon=True).start()  # a torch rank has dozens\n"
    "sys.stdout.write('ok\\n'); sys.stdout.flush()\n"
    "hb = sys.argv[2] if len(sys.argv) > 2 else ''\n"
    "while True:\n"
    "    if hb:\n"
    "        open(hb, 'w').close()  # what gpuwatchd.heartbeat(step) does, once a second\n"
    "    time.sleep(1)\n"
)


def start_ranks(n: int, hb_dir: str | None = None, threads: int = 1) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "BENCH_THREADS": str(threads)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, MARKER, *([f"{hb_dir}/{i}.hb"] if hb_dir else [])],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
    return procs


def scrape_latencies(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()
        out.append(time.perf_counter() - t0)
    return out


def bench_gpuwatchd(
    n: int, rank_dir: str, state_dir: str, cycles: int, stall: bool = False, interval: float = 5.0
) -> dict[str, float]:
    """CPU per cycle of the real Daemon.cycle(). ``stall``: with the default subsystems (GIL
    sampling and NVML off), i.e. with the stall tracker, cycles paced at ``interval`` as the
    daemon paces them, so that its per-look cadence is what it is in production."""
    cfg = Config(
        rank_dir=rank_dir,
        state_dir=state_dir,
        interval_seconds=interval,
        kernel_log="off",
        gil=GilConfig(enabled=False),
        nvml=NvmlConfig(enabled=False),
        discovery=DiscoveryConfig(enabled=False),
        web=WebConfig(listen_address="127.0.0.1:0"),
    )
    d = Daemon(cfg, parts=build_parts if stall else no_parts)
    d.cycle()  # warm: rank files parsed, environ read once per rank
    t0 = time.process_time()
    w0 = time.perf_counter()
    for _ in range(cycles):
        c0 = time.perf_counter()
        state = d.cycle()
        if stall:
            time.sleep(max(0.0, interval - (time.perf_counter() - c0)))
    cpu = (time.process_time() - t0) / cycles
    wall = (time.perf_counter() - w0) / cycles
    assert sum(r.alive for r in state.ranks) == n, "every rank must be seen alive"
    assert all(r.process and r.process.open_fds and r.process.open_fds >= 1000 for r in state.ranks)
    return {"cpu_per_cycle_s": cpu, "wall_per_cycle_s": wall}


def bench_daemon_process(
    rank_dir: str, state_dir: str, scrapes: int, window: float, full: bool = False
) -> dict[str, float]:
    """The real daemon. ``full``: the shipped defaults (GIL sampling on, kernel log, NVML where
    present, discovery), CPU counted with its py-spy children."""
    port = free_port()
    cfg_path = Path(state_dir) / "bench.yaml"
    os.makedirs(state_dir, exist_ok=True)
    extra = (
        ""
        if full
        else ("kernel_log: 'off'\ngil: {enabled: false}\nnvml: {enabled: false}\ndiscovery: {enabled: false}\n")
    )
    cfg_path.write_text(
        f"web: {{listen_address: '127.0.0.1:{port}'}}\ninterval_seconds: 5\nrank_dir: {rank_dir}\n"
        f"state_dir: {state_dir}\n" + extra
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg_path)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if b"gpuwatch_rank_up" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("daemon did not come up")
            time.sleep(0.2)
        lat = scrape_latencies(url, scrapes)
        c0, k0, t0 = cpu_seconds(p.pid, children=False), cpu_seconds(p.pid, children=True), time.monotonic()
        time.sleep(window)  # cycles at 5 s, no scrapes: the steady-state cost of watching
        elapsed = time.monotonic() - t0
        share = (cpu_seconds(p.pid, children=False) - c0) / elapsed
        with_children = (cpu_seconds(p.pid, children=True) - k0) / elapsed
        return {
            "p50_ms": pct(lat, 0.5) * 1e3,
            "p99_ms": pct(lat, 0.99) * 1e3,
            "rss_mb": rss_kib(p.pid) * 1024 / 1e6,
            "cpu_share_at_5s": share,
            "cpu_share_with_pyspy": with_children,
        }
    finally:
        p.terminate()
        p.wait(10)


def bench_process_exporter(n: int, scrapes: int) -> dict[str, float] | None:
    exe = shutil.which("prometheus-process-exporter") or shutil.which("process-exporter")
    if exe is None:
        print("  process-exporter not installed (apt install prometheus-process-exporter): skipped")
        return None
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        f.write("process_names:\n  - name: '{{.PID}}'\n    cmdline:\n    - '" + MARKER + "'\n")
        cfg = f.name
    p = subprocess.Popen(
        [exe, "-config.path", cfg, "-web.listen-address", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    body = r.read().decode()
                groups = body.count("namedprocess_namegroup_num_procs{")
                if groups >= n:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"process-exporter saw {groups} of {n} processes")
            time.sleep(0.2)
        assert "namedprocess_namegroup_open_filedesc" in body
        c0 = cpu_seconds(p.pid, children=False)
        lat = scrape_latencies(url, scrapes)
        return {
            "cpu_per_scrape_s": (cpu_seconds(p.pid, children=False) - c0) / scrapes,
            "p50_ms": pct(lat, 0.5) * 1e3,
            "p99_ms": pct(lat, 0.99) * 1e3,
        }
    finally:
        p.terminate()
        p.wait(10)
        os.unlink(cfg)


def bench_synthetic_scrape(scrapes: int) -> dict[str, float]:
    """/metrics for 8 GPUs x 64 processes (64 ranks, one GPU process each plus workers)."""
    from gpuwatchd.web import server as web

    proc = ProcessInfo(1, 1, "python", "S", 0, "root", 1, 1.0, 1.0, 1 << 30, 40, 1000, 2048, 2048)
    gpus = tuple(
        GpuDevice(i, f"GPU-{i:08x}", "NVIDIA H200", f"0000:{i:02x}:00.0", 150 << 30, 90 << 30, 0.9) for i in range(8)
    )
    ranks = tuple(RankState("bench", r, 1000 + r, r % 8, 64, True, proc, (1000 + r,)) for r in range(64))
    rows = tuple(
        GpuProcessRow(r % 8, f"GPU-{r % 8:08x}", 1000 + r, 10 << 30, "python", "root", "bench", str(r))
        for r in range(64)
    )
    state = NodeState(timestamp=time.time(), ranks=ranks, gpus=gpus, gpu_processes=rows)
    counters = CounterStore()
    server = web.serve(make_registry(lambda: state, counters), "127.0.0.1:0", None)
    host, port = server.address[:2]
    try:
        lat = scrape_latencies(f"http://{host}:{port}/metrics", scrapes)
    finally:
        server.close()
    return {"p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--window", type=float, default=30.0, help="seconds over which daemon CPU is measured")
    ap.add_argument(
        "--no-heartbeat",
        action="store_true",
        help="ranks send no heartbeats (stall detection then samples their stacks)",
    )
    ap.add_argument("--threads", type=int, default=1, help="threads per rank process (torch: dozens)")
    ap.add_argument(
        "--stall-only",
        action="store_true",
        help="only the in-process CPU per cycle with the stall tracker, cycles paced at "
        "--interval (the issue-14 profile: 32 ranks x 48 threads at 1 s)",
    )
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument(
        "--full",
        action="store_true",
        help="also run the daemon with the shipped defaults (GIL sampling on) at each size",
    )
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    print(f"host: {os.cpu_count()} CPUs, kernel {os.uname().release}, python {sys.version.split()[0]}")
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            rank_dir, state_dir = f"{tmp}/ranks", f"{tmp}/state"
            os.makedirs(rank_dir)
            procs = start_ranks(n, None if args.no_heartbeat else rank_dir, args.threads)
            for i, p in enumerate(procs):
                entry: dict[str, object] = {"rank": i, "pid": p.pid}
                if not args.no_heartbeat:
                    entry["heartbeat"] = f"{rank_dir}/{i}.hb"
                write_rank_file(
                    rank_dir, {"version": 1, "job_id": "bench", "world_size": n, "ranks": [entry]}, f"bench.{i}.json"
                )
            if args.stall_only:
                try:
                    g = bench_gpuwatchd(n, rank_dir, state_dir, args.cycles, stall=True, interval=args.interval)
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                print(
                    f"N={n:4d} x {args.threads} threads, heartbeats "
                    f"{'off' if args.no_heartbeat else 'on'}, {args.interval:g} s cycles with the "
                    f"stall tracker: {g['cpu_per_cycle_s'] * 1e3:.2f} ms CPU/cycle"
                )
                continue
            try:
                g = bench_gpuwatchd(n, rank_dir, state_dir, args.cycles)
                dp = bench_daemon_process(rank_dir, state_dir, args.scrapes, args.window)
                full = (
                    bench_daemon_process(rank_dir, f"{tmp}/state-full", args.scrapes // 4, 2 * args.window, full=True)
                    if args.full
                    else None
                )
                pe = bench_process_exporter(n, max(20, args.scrapes // 10))
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        ratio = pe["cpu_per_scrape_s"] / g["cpu_per_cycle_s"] if pe else float("nan")
        rows.append((n, g, dp, pe, ratio))
        print(
            f"N={n:4d}: gpuwatchd {g['cpu_per_cycle_s'] * 1e3:7.2f} ms CPU/cycle "
            f"({g['cpu_per_cycle_s'] / n * 1e6:6.1f} us/process), /metrics p50 {dp['p50_ms']:.2f} ms "
            f"p99 {dp['p99_ms']:.2f} ms, RSS {dp['rss_mb']:.1f} MB, CPU share at 5 s cycle "
            f"{dp['cpu_share_at_5s'] * 100:.3f} % of a core"
            + (
                f" | process-exporter {pe['cpu_per_scrape_s'] * 1e3:7.2f} ms CPU/scrape "
                f"(p99 {pe['p99_ms']:.1f} ms) -> process-exporter/gpuwatchd = {ratio:.1f}x"
                if pe
                else ""
            )
        )
        if full:
            print(
                f"        shipped defaults (GIL sampling on, kernel log, discovery): daemon "
                f"{full['cpu_share_at_5s'] * 100:.2f} % of a core, with its py-spy runs "
                f"{full['cpu_share_with_pyspy'] * 100:.2f} %, RSS {full['rss_mb']:.1f} MB"
            )
    if args.stall_only:
        return
    s = bench_synthetic_scrape(args.scrapes)
    print(
        f"synthetic 8 GPUs x 64 processes: /metrics p50 {s['p50_ms']:.2f} ms p99 {s['p99_ms']:.2f} ms "
        "(budget p99 <= 5 ms)"
    )
    if len(rows) >= 2:
        (n0, g0, *_), (n1, g1, *_) = rows[0], rows[-1]
        print(f"scaling: {n1 / n0:.0f}x processes -> {g1['cpu_per_cycle_s'] / g0['cpu_per_cycle_s']:.1f}x CPU/cycle")


if __name__ == "__main__":
    main()
