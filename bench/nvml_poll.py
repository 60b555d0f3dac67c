#!/usr/bin/env python3
"""Benchmark on a GPU node: NVML poll cost per cycle, and daemon CPU next to nvitop-exporter.

    python3 -m bench.nvml_poll --sizes 32,64 --gib 1 --seconds 60 --out bench.json \
        [--pyspy PATH] [--main-repo PATH] [--defaults]

1. Starts torch processes that each hold ``--gib`` GiB (tests/gpu/holder.py) and beat a heartbeat
   file once a second, ``--sizes`` of them in steps (32, then 32 more to 64), and registers them
   as ranks of one job twice: in a rank directory with their heartbeats and in one without (so
   stall detection has to look at their threads / stacks), see ``variants``.
2. Poll cost: ``NvmlSource.read()`` (devices + compute/graphics processes + per-process
   utilisation) timed over ``--polls`` cycles; ``nvidia-smi --query-compute-apps`` timed for scale.
3. CPU: at each size, side by side in one window, all at ``--interval`` seconds and all scraped
   every ``--interval`` seconds over loopback, watching the same processes for ``--seconds``:
   the daemon variants of ``variants`` (every feature but GIL sampling: NVML, /proc, stall
   detection, kernel log off as nvitop has none; with and without heartbeats and py-spy),
   ``nvitop-exporter``, with ``--main-repo`` the same run from another checkout ("before"), and
   with ``--defaults`` the shipped defaults (GIL sampling, kernel log, discovery) of both. CPU = utime+stime
   of the process ("own") and with its reaped children (py-spy runs) from /proc/PID/stat; RSS
   from /proc/PID/status. Prints the ratios to nvitop-exporter.

The holders sleep a second at a time (the shape of a blocked rank: without a heartbeat it is
dumped once per ``stall.after_seconds``), or with ``--work-ms N`` use N ms of CPU every 50 ms (the
CPU side of a training loop: a heartbeat-less rank that works is never dumped). With
``--pyspy bench/pyspy_counting.sh`` every py-spy run is logged with its time and CPU, and
``--keep DIR`` keeps each daemon's log, final /metrics and events.jsonl.
"""

from __future__ import annotations

import argparse
import collections
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

from bench.benchlib import CLK, REPO, cpu_seconds, rss_kib, scrape, task_ticks, wait_http
from gpuwatchd.sources.nvml import NvmlSource


def start_holders(
    args: argparse.Namespace,
    tmp: Path,
    first: int,
    last: int,
    holders: list[subprocess.Popen[bytes]],
    env: dict[str, str],
) -> None:
    """Holders ``first..last-1``: started together, then registered as ranks of job 'bench'."""
    for i in range(first, last):
        hb = ["--heartbeat", str(tmp / f"h{i}.hb")]
        work = ["--work-ms", str(args.work_ms)] if args.work_ms else []
        holders.append(
            subprocess.Popen(
                [
                    sys.executable,
                    args.holder,
                    "--gib",
                    str(args.gib),
                    "--ready-file",
                    str(tmp / f"h{i}.pid"),
                    *hb,
                    *work,
                ]
            )
        )
    deadline = time.monotonic() + 240
    while not all((tmp / f"h{i}.pid").exists() for i in range(first, last)):
        assert time.monotonic() < deadline, "holders did not start"
        assert all(h.poll() is None for h in holders), "a holder died"
        time.sleep(0.2)
    for i in range(first, last):
        pid = int((tmp / f"h{i}.pid").read_text())
        for rank_dir, hb in (("ranks", []), ("ranks-hb", ["--heartbeat", str(tmp / f"h{i}.hb")])):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpuwatchd",
                    "register",
                    "--job-id",
                    "bench",
                    "--rank",
                    str(i),
                    "--pid",
                    str(pid),
                    "--rank-dir",
                    str(tmp / rank_dir),
                    *hb,
                ],
                check=True,
                env=env,
                cwd=str(REPO),
                capture_output=True,
            )


def poll_cost(args: argparse.Namespace) -> dict[str, Any]:
    src = NvmlSource()
    devices, procs = src.read()
    samples = []
    for _ in range(args.polls):
        t0 = time.perf_counter()
        devices, procs = src.read()
        samples.append(time.perf_counter() - t0)
    src.close()
    calls = nvml_call_costs(args.polls)
    smi = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            check=True,
        )
        smi.append(time.perf_counter() - t0)
    samples.sort()
    poll = {
        "gpus": len(devices),
        "gpu_processes": len(procs),
        "polls": len(samples),
        "mean_ms": statistics.mean(samples) * 1e3,
        "p50_ms": samples[len(samples) // 2] * 1e3,
        "p99_ms": samples[int(len(samples) * 0.99) - 1] * 1e3,
        "max_ms": samples[-1] * 1e3,
        "nvidia_smi_query_mean_ms": statistics.mean(smi) * 1e3,
    }
    print(
        f"NVML poll: {len(procs)} GPU processes on {len(devices)} GPU(s): "
        f"mean {poll['mean_ms']:.2f} ms, p50 {poll['p50_ms']:.2f} ms, p99 {poll['p99_ms']:.2f} ms "
        f"per cycle (nvidia-smi --query-compute-apps: {poll['nvidia_smi_query_mean_ms']:.0f} ms)",
        flush=True,
    )
    print("NVML calls on GPU 0, CPU µs each: " + ", ".join(f"{k} {v:.0f}" for k, v in calls.items()), flush=True)
    poll["calls_us"] = calls
    return poll


def nvml_call_costs(n: int) -> dict[str, float]:
    """CPU time (µs, this thread) of each NVML call a poll makes, on GPU 0: which to cache."""
    import pynvml as nv

    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        todo = {
            "GetHandleByIndex": lambda: nv.nvmlDeviceGetHandleByIndex(0),
            "GetUUID": lambda: nv.nvmlDeviceGetUUID(h),
            "GetName": lambda: nv.nvmlDeviceGetName(h),
            "GetPciInfo": lambda: nv.nvmlDeviceGetPciInfo(h),
            "GetMemoryInfo": lambda: nv.nvmlDeviceGetMemoryInfo(h),
            "GetUtilizationRates": lambda: nv.nvmlDeviceGetUtilizationRates(h),
            "GetClocksEventReasons": lambda: reasons(h),
            "GetProcessUtilization": lambda: nv.nvmlDeviceGetProcessUtilization(h, 0),
            "GetComputeRunningProcesses": lambda: nv.nvmlDeviceGetComputeRunningProcesses(h),
            "GetGraphicsRunningProcesses": lambda: nv.nvmlDeviceGetGraphicsRunningProcesses(h),
        }
        out = {}
        for name, fn in todo.items():
            t0 = time.thread_time()
            for _ in range(n):
                with contextlib.suppress(nv.NVMLError):
                    fn()
            out[name] = (time.thread_time() - t0) / n * 1e6
        return out
    finally:
        nv.nvmlShutdown()


IDLE_LEAVES = (
    "wait (threading.py",
    "select (selectors.py",
    "sleep",
    "_wait_for_tstate_lock",
    "accept (socket.py",
    "get (queue.py",
    "poll (selectors.py",
)


def print_profile(path: Path, n: int, top: int = 25) -> None:
    """Active samples of the daemon (leaves that only wait dropped): self and inclusive."""
    if not path.exists():
        print(f"  {n} ranks: no profile written", flush=True)
        return
    self_c: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")[1:]  # [0] is the thread
        if not frames or any(w in frames[-1] for w in IDLE_LEAVES):
            continue
        total += int(count)
        self_c[frames[-1]] += int(count)
        for f in set(frames):
            incl[f] += int(count)
    print(f"  {n} ranks: py-spy on gpuwatchd, {total} active samples at 100 Hz; self:", flush=True)
    for f, c in self_c.most_common(top):
        print(f"    {100 * c / max(total, 1):5.1f} % {f}")
    print("  inclusive:")
    for f, c in incl.most_common(top + 10):
        print(f"    {100 * c / max(total, 1):5.1f} % {f}")


def variants(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(name, code checkout, extra config, rank dir) of each daemon in the window.

    Two rank directories name the same holders: ``ranks-hb`` with heartbeat files (what
    ``gpuwatchd.heartbeat`` gives), ``ranks`` without (stall detection then looks at threads and,
    with py-spy, dumps stacks). Without ``pyspy_path`` and with none on PATH, py-spy is absent."""
    pyspy = f"  pyspy_path: {args.pyspy}\n" if args.pyspy else ""
    no_gil = "kernel_log: 'off'\ngil:\n  enabled: false\n"
    here, before = str(REPO), args.main_repo
    out = [("gpuwatchd", here, no_gil, "ranks")]
    if before:
        out.append(("gpuwatchd-before", before, no_gil, "ranks"))
    if args.pyspy:
        out.append(("gpuwatchd-hb-pyspy", here, no_gil + pyspy, "ranks-hb"))
        out.append(("gpuwatchd-pyspy", here, no_gil + pyspy, "ranks"))
    if args.defaults:  # shipped defaults: GIL sampling, kernel log, discovery, NVML
        out.append(("gpuwatchd-defaults-hb", here, f"gil:\n{pyspy}" if pyspy else "", "ranks-hb"))
        # the same ranks without heartbeats (discovered or registered without heartbeat(): stall
        # detection from /proc, dumps and NVML; issue 22)
        out.append(("gpuwatchd-defaults-nohb", here, f"gil:\n{pyspy}" if pyspy else "", "ranks"))
        if before:
            out.append(("gpuwatchd-before-defaults-hb", before, f"gil:\n{pyspy}" if pyspy else "", "ranks-hb"))
    if args.only:
        out = [v for v in out if v[0] in args.only.split(",")]
    return out


def cpu_window(
    args: argparse.Namespace, tmp: Path, n: int, logs: contextlib.ExitStack, servers: list[subprocess.Popen[bytes]]
) -> dict[str, Any]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    for k, (name, repo, extra, ranks) in enumerate(variants(args)):
        port = 19870 + 10 * len(servers) + k
        cfg = tmp / f"{name}-{n}.yaml"
        cfg.write_text(
            f"rank_dir: {tmp / ranks}\nstate_dir: {tmp / name}-{n}\ninterval_seconds: "
            f"{args.interval}\nweb:\n  listen_address: '127.0.0.1:{port}'\n{extra}"
        )
        env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        procs[name] = subprocess.Popen(  # under the shim that names each thread (comm)
            [sys.executable, str(REPO / "bench/thread_names.py"), "run", "--config.file", str(cfg)],
            env=env,
            cwd=repo,
            stdout=subprocess.DEVNULL,
            stderr=logs.enter_context((tmp / f"{name}-{n}.log").open("wb")),
        )
        urls[name] = f"http://127.0.0.1:{port}/metrics"
    servers.extend(procs.values())
    if not args.no_nvitop:
        port = 19869 + 10 * len(servers)
        exporter_bin = shutil.which("nvitop-exporter")
        cmd = [exporter_bin] if exporter_bin else [sys.executable, "-m", "nvitop_exporter"]
        procs["nvitop-exporter"] = subprocess.Popen(
            [*cmd, "--bind-address", "127.0.0.1", "--port", str(port), "--interval", str(args.interval)],
            stdout=subprocess.DEVNULL,
            stderr=logs.enter_context((tmp / f"nvitop-{n}.log").open("wb")),
        )
        servers.append(procs["nvitop-exporter"])
        urls["nvitop-exporter"] = f"http://127.0.0.1:{port}/metrics"
    for u in urls.values():
        wait_http(u)
    time.sleep(args.warmup)  # warm-up: first cycles, rank files parsed, environ read
    prof = None
    profiled = args.profile_variant
    if args.profile and args.pyspy and profiled in procs:  # py-spy on the daemon itself
        prof = subprocess.Popen(
            [
                args.pyspy,
                "record",
                "--nonblocking",
                "--threads",
                "-r",
                "100",
                "-d",
                str(int(args.seconds)),
                "--format",
                "raw",
                "-o",
                str(tmp / f"prof-{n}.raw"),
                "-p",
                str(procs[profiled].pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    tasks0 = task_ticks(procs[profiled].pid) if profiled in procs else {}
    own0 = {k: cpu_seconds(p.pid, children=False) for k, p in procs.items()}
    all0 = {k: cpu_seconds(p.pid, children=True) for k, p in procs.items()}
    t0 = time.monotonic()
    print(
        f"  {n} ranks, window from epoch {time.time():.1f} for {args.seconds:.0f} s; daemon pids "
        + ", ".join(f"{k} {p.pid}" for k, p in procs.items()),
        flush=True,
    )
    sizes: dict[str, int] = {}
    scrapes: dict[str, list[float]] = {k: [] for k in urls}
    while time.monotonic() - t0 < args.seconds:
        for k, u in urls.items():
            dt, size = scrape(u)
            scrapes[k].append(dt)
            sizes[k] = size
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    if profiled in procs:
        tasks1 = task_ticks(procs[profiled].pid)
        by_comm: dict[str, float] = {}
        for t, (comm, ticks, _) in tasks1.items():
            name = "main" if t == procs[profiled].pid else comm
            by_comm[name] = by_comm.get(name, 0.0) + (ticks - tasks0.get(t, (comm, 0, 0))[1]) / CLK
        rows = ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_comm.items(), key=lambda kv: -kv[1]) if v > 0)
        print(f"  {n} ranks, {profiled} CPU s in the window by thread (alive at the end): {rows}", flush=True)
    if prof is not None:
        prof.wait(30)
        print_profile(tmp / f"prof-{n}.raw", n)
    own = {k: cpu_seconds(p.pid, children=False) - own0[k] for k, p in procs.items()}
    tot = {k: cpu_seconds(p.pid, children=True) - all0[k] for k, p in procs.items()}
    rss = {k: rss_kib(p.pid) / 1024 for k, p in procs.items()}
    bodies = {
        k: urllib.request.urlopen(u, timeout=10).read().decode() for k, u in urls.items() if k.startswith("gpuwatchd")
    }
    for k, body in bodies.items():  # kept with --keep: what each daemon said at the end
        (tmp / f"{k}-{n}.metrics").write_text(body)
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    res: dict[str, Any] = {"ranks": n, "seconds": wall, "interval_seconds": args.interval, "processes": {}}
    ref = tot.get("nvitop-exporter")
    for k in procs:
        row = {
            "cpu_percent_own": 100 * own[k] / wall,
            "cpu_percent_with_children": 100 * tot[k] / wall,
            "rss_mib": rss[k],
            "scrape_ms_mean": statistics.mean(scrapes[k]) * 1e3,
            "exposition_bytes": sizes.get(k, 0),
        }
        if ref:
            row["ratio_to_nvitop"] = tot[k] / ref
        if k in bodies:
            row["ranks_up"] = sum(
                1 for line in bodies[k].splitlines() if line.startswith("gpuwatch_rank_up{") and line.endswith(" 1.0")
            )
            row["cycle_line"] = next(
                (line for line in bodies[k].splitlines() if line.startswith("gpuwatch_cycle_duration_seconds ")), ""
            )
        res["processes"][k] = row
        print(
            f"  {n} ranks, {k:26s} CPU {row['cpu_percent_own']:.3f} % own, "
            f"{row['cpu_percent_with_children']:.3f} % with py-spy children, RSS "
            f"{rss[k]:.0f} MiB"
            + (f", ratio to nvitop-exporter {row['ratio_to_nvitop']:.2f}" if ref else "")
            + (f", ranks up {row['ranks_up']}" if "ranks_up" in row else ""),
            flush=True,
        )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=9, help="one size (see --sizes)")
    ap.add_argument("--sizes", default="", help="e.g. 32,64: a CPU window at each")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--polls", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--record", default="", help="also record the NVML readings to this JSON")
    ap.add_argument("--pyspy", default="", help="py-spy binary for the daemons (gil.pyspy_path)")
    ap.add_argument("--main-repo", default="", help="checkout whose daemon runs as 'before'")
    ap.add_argument("--defaults", action="store_true", help="also the shipped defaults (GIL on)")
    ap.add_argument("--no-nvitop", action="store_true", help="(dry runs without a GPU)")
    ap.add_argument("--no-poll", action="store_true", help="skip the NVML poll timing")
    ap.add_argument("--holder", default=str(REPO / "tests/gpu/holder.py"))
    ap.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="holders work: N ms of CPU every 50 ms (a training loop's CPU side), "
        "instead of sleeping a second at a time",
    )
    ap.add_argument(
        "--keep", default="", help="copy the daemons' logs, final /metrics and events.jsonl into this directory"
    )
    ap.add_argument("--only", default="", help="comma-separated daemon variants to run")
    ap.add_argument(
        "--profile-variant", default="gpuwatchd", help="the daemon variant --profile and the per-thread CPU look at"
    )
    ap.add_argument(
        "--profile", action="store_true", help="py-spy record the 'gpuwatchd' variant during the window (needs --pyspy)"
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [args.procs]
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatch-bench-"))
    (tmp / "ranks").mkdir()
    (tmp / "ranks-hb").mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holders: list[subprocess.Popen[bytes]] = []
    servers: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"sizes": sizes, "gib_each": args.gib, "windows": []}
    logs = contextlib.ExitStack()
    try:
        have = 0
        for n in sizes:
            t0 = time.monotonic()
            start_holders(args, tmp, have, n, holders, env)
            have = n
            print(f"{n} holders up ({time.monotonic() - t0:.0f} s to start the new ones)", flush=True)
            if not args.no_poll and "poll" not in result:
                result["poll"] = poll_cost(args)
                if args.record:
                    subprocess.run(
                        [
                            sys.executable,
                            str(REPO / "tools/record_nvml.py"),
                            "--cycles",
                            "2",
                            "--out",
                            args.record,
                            "--note",
                            f"H200: {n} torch processes holding {args.gib} GiB each, "
                            "registered as ranks 0..N-1 of job 'bench' (bench/nvml_poll.py)",
                        ],
                        check=True,
                    )
            result["windows"].append(cpu_window(args, tmp, n, logs, servers))
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
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
        if args.keep:
            keep = Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            for f in [*tmp.glob("*.log"), *tmp.glob("*.metrics"), *tmp.glob("*/events.jsonl")]:
                name = f.name if f.parent == tmp else f"{f.parent.name}-{f.name}"
                shutil.copyfile(f, keep / name)
        for log in sorted(tmp.glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text or "ERROR" in text:
                print(f"--- {log.name} (tail)\n{text[-1500:]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
