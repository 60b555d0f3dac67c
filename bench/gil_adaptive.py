#!/usr/bin/env python3
"""GIL sampling's share of the daemon's CPU at shipped defaults, before and after the adaptive
schedule, on real Python ranks with real py-spy.

    python3 -m bench.gil_adaptive [--ranks 64] [--busy 2] [--convoys 0,1] [--seconds 120]
                                  [--warmup 15] [--before-rev 6e08b57] [--skip-cost]

1. py-spy's cost per run against duration x rate: ``PySpy.record_gil`` (what the daemon runs) on a
   41-thread target, three runs each; py-spy's own CPU (rusage of the run) and the caller's (this
   process: spawn, temp files, reading and parsing), and the fit ``a + b * ticks``.
2. Side by side in one window, both at shipped defaults (only rank_dir, state_dir, the listen
   address and an NVML replay with GPU 0 95 % busy and GPU 1 idle are set): this checkout
   ("after") and the same daemon at ``--before-rev`` ("before", extracted with ``git archive``,
   with this checkout's NVML replay, whose Xid wait no longer spins),
   watching the same ``--ranks`` real Python ranks registered with ``gpuwatchd.register_rank``:
   light ranks (heartbeat twice a second, 8 idle threads, GPU 1: the H200 device's idle torch
   holders), ``--busy`` busy healthy ranks (two threads at ~15 % each, GPU 0 busy) and, per
   ``--convoys`` window, that many GIL-convoyed ranks (three threads burning in Python, GPU 1
   idle). CPU = utime+stime of each
   daemon ("own") and cutime+cstime (its reaped py-spy runs) from /proc/PID/stat over
   ``--seconds`` after ``--warmup``; the GIL samples taken (``gpuwatch_rank_gil_samples_total``)
   and when each daemon raised ``gil_saturated`` for the convoyed rank (from its start). A third
   daemon ("gil-off", this checkout with ``gil.enabled: false``) is the baseline that the GIL
   sampling's share (own CPU above it, plus the py-spy children) is measured against.

The daemons share the machine's cores with the ranks: compare them with each other, not with an
idle machine. On a shared machine pass ``--extra 'discovery:\n  enabled: false\n'``: discovery
would take other users' launcher processes for ranks (and sample them). Output: plain text on
stdout (kept in bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchlib import REPO, cpu_seconds, get, self_cpu
from gpuwatchd.sources.pyspy import PySpy, resolve_pyspy

RANK = r"""
import sys, threading, time
import gpuwatchd
kind, rank_dir, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
gpu = "0" if kind == "busy" else "1"
gpuwatchd.register_rank("bench", rank, rank_dir=rank_dir, gpus=[gpu], cuda_oom_hook=False,
                        flight_recorder=False)
stop = threading.Event()
for i in range(8):
    threading.Thread(target=stop.wait, name=f"idle-{i}", daemon=True).start()
def burn():
    x = 0
    while True:
        for i in range(100000):
            x += i * i
def duty():
    while True:
        end = time.perf_counter() + 0.015
        while time.perf_counter() < end:
            pass
        time.sleep(0.085)
if kind == "convoy":
    for i in range(3):
        threading.Thread(target=burn, name=f"cpu-{i}", daemon=True).start()
elif kind == "busy":
    for i in range(2):
        threading.Thread(target=duty, name=f"duty-{i}", daemon=True).start()
print("ready", flush=True)
step = 0
while True:
    gpuwatchd.heartbeat(step)
    step += 1
    time.sleep(0.5)
"""

TARGET = r"""
import threading, time
ev = threading.Event()
for i in range(40):
    threading.Thread(target=ev.wait, daemon=True).start()
def busy():
    while True:
        sum(range(1000))
        time.sleep(0.002)
threading.Thread(target=busy, daemon=True).start()
print("ready", flush=True)
ev.wait()
"""


def cost_model() -> None:
    target = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        spy = PySpy(resolve_pyspy(), timeout_seconds=60)
        print("1. py-spy record --gil --nonblocking on a 41-thread Python target, 3 runs each")
        print(f"   {'duration':>8} {'rate':>5} {'ticks':>5} {'py-spy CPU/run':>15} {'caller CPU/run':>15}")
        points = []
        for seconds, rate in [(1, 20), (1, 50), (2, 50), (5, 20), (5, 50), (5, 100)]:
            own0, spent = self_cpu(), 0.0
            for _ in range(3):
                spent += spy.record_gil(target.pid, rate, seconds).pyspy_cpu_seconds
            own = (self_cpu() - own0) / 3
            ticks = seconds * rate - 1
            points.append((ticks, spent / 3))
            print(f"   {seconds:>6} s {rate:>3} Hz {ticks:>5} {1e3 * spent / 3:>12.1f} ms {1e3 * own:>12.1f} ms")
        n = len(points)
        mx = sum(t for t, _ in points) / n
        my = sum(c for _, c in points) / n
        b = sum((t - mx) * (c - my) for t, c in points) / sum((t - mx) ** 2 for t, _ in points)
        a = my - b * mx
        print(
            f"   fit: py-spy CPU per run = {1e3 * a:.1f} ms + {1e3 * b:.3f} ms x ticks "
            f"(a 1 s 20 Hz screening: {1e3 * (a + 19 * b):.1f} ms; a 5 s 50 Hz sample: "
            f"{1e3 * (a + 249 * b):.1f} ms)",
            flush=True,
        )
    finally:
        target.kill()
        target.wait()


def nvml_replay(path: Path) -> None:
    src = json.loads((REPO / "tests/fixtures/nvml/derived_h200_x8.json").read_text())
    cycle = src["cycles"][0]
    devices = cycle["devices"][:2]
    for dev, util in zip(devices, (95, 0), strict=True):
        dev["utilization"] = {"gpu": util, "memory": 0}
        dev["compute"], dev["process_utilization"] = [], []
    src["cycles"] = [{**cycle, "count": 2, "devices": devices}]
    src["note"] = "derived from derived_h200_x8.json: GPU 0 95 % busy, GPU 1 idle (bench)"
    path.write_text(json.dumps(src))


def gil_samples(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gpuwatch_rank_gil_samples_total{")
    )


def saturated(text: str, rank: int) -> bool:
    return any(
        line.startswith("gpuwatch_finding{")
        and 'kind="gil_saturated"' in line
        and f'rank="{rank}"' in line
        and line.endswith(" 1.0")
        for line in text.splitlines()
    )


def window(args: argparse.Namespace, tmp: Path, convoy: int) -> None:
    rank_dir = tmp / "ranks"
    rank_dir.mkdir()
    fixture = tmp / "nvml.json"
    nvml_replay(fixture)
    checkouts: dict[str, tuple[Path, str]] = {"after": (REPO, ""), "gil-off": (REPO, "gil:\n  enabled: false\n")}
    if args.before_rev:
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.before_rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        # the NVML replay of this checkout in both (the older one spun in its Xid event wait)
        replay = "gpuwatchd/sources/nvml_fixture.py"
        (before / replay).write_bytes((REPO / replay).read_bytes())
        checkouts["before"] = (before, "")
    kinds = ["convoy"] * convoy + ["busy"] * args.busy + ["light"] * (args.ranks - convoy - args.busy)
    ranks: list[subprocess.Popen[str]] = []
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        for i, kind in enumerate(kinds):
            p = subprocess.Popen(
                [sys.executable, "-c", RANK, kind, str(rank_dir), str(i)], stdout=subprocess.PIPE, text=True, env=env
            )
            ranks.append(p)
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        urls, started = {}, {}
        for k, (name, (repo, extra)) in enumerate(checkouts.items()):
            port = args.port + k
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(
                f"rank_dir: {rank_dir}\nstate_dir: {tmp / name}\nweb:\n  "
                f"listen_address: '127.0.0.1:{port}'\nnvml:\n  fixture: {fixture}\n"
                f"{args.extra.replace(chr(92) + 'n', chr(10))}{extra}"
            )
            log = (tmp / f"{name}.log").open("wb")
            daemons[name] = subprocess.Popen(
                [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)],
                cwd=repo,
                env={**os.environ, "PYTHONPATH": str(repo)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            started[name] = time.monotonic()
            urls[name] = f"http://127.0.0.1:{port}/metrics"
        found: dict[str, float] = {}

        def poll() -> None:
            for name, url in urls.items():
                try:
                    text = get(url).decode()
                except OSError:
                    continue
                if convoy and name not in found and saturated(text, 0):
                    found[name] = time.monotonic() - started[name]

        end = time.monotonic() + args.warmup
        while time.monotonic() < end:
            poll()
            time.sleep(1)
        own0 = {k: cpu_seconds(p.pid, children=False) for k, p in daemons.items()}
        all0 = {k: cpu_seconds(p.pid, children=True) for k, p in daemons.items()}
        samples0 = {k: gil_samples(get(u).decode()) for k, u in urls.items()}
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            poll()
            time.sleep(5)
        wall = time.monotonic() - t0
        print(
            f"2. {args.ranks} real Python ranks ({convoy} GIL-convoyed on an idle GPU, {args.busy} "
            f"busy on a busy GPU, {args.ranks - convoy - args.busy} light), shipped defaults, "
            f"{wall:.0f} s window after {args.warmup:.0f} s"
        )
        own_of = {name: cpu_seconds(p.pid, children=False) - own0[name] for name, p in daemons.items()}
        for name, p in daemons.items():
            own = own_of[name]
            kids = cpu_seconds(p.pid, children=True) - all0[name] - own
            taken = gil_samples(get(urls[name]).decode()) - samples0[name]
            when = (
                f"{found[name]:.0f} s after start"
                if name in found
                else "not in the run"
                if convoy
                else "none (no convoyed rank)"
            )
            print(
                f"   {name:6s} daemon own {100 * own / wall:.3f} % of a core, py-spy children "
                f"{100 * kids / wall:.3f} %, total {100 * (own + kids) / wall:.3f} %; "
                f"{taken:.0f} GIL ticks sampled; gil_saturated for the convoyed rank: {when}",
                flush=True,
            )
            if name != "gil-off":
                share = own - own_of["gil-off"] + kids
                print(
                    f"   {name:6s} GIL sampling's share (own - gil-off's own + children): "
                    f"{100 * share / wall:.3f} % of a core",
                    flush=True,
                )
    finally:
        for p in daemons.values():
            p.send_signal(signal.SIGTERM)
        for p in daemons.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in ranks:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--warmup", type=float, default=15)
    ap.add_argument("--before-rev", default="6e08b57", help="'' for the after daemon only")
    ap.add_argument("--port", type=int, default=19930)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--convoys", default="0,1", help="a window per value: GIL-convoyed ranks in it")
    ap.add_argument(
        "--extra",
        default="",
        help="YAML appended to every daemon's config, e.g. "
        '"discovery:\\n  enabled: false\\n" where /proc scans of other users\' '
        "processes dominate (a shared VM)",
    )
    args = ap.parse_args()
    if not args.skip_cost:
        cost_model()
    for convoy in (int(c) for c in args.convoys.split(",")):
        with tempfile.TemporaryDirectory(prefix="gwadaptive-bench-") as tmp:
            window(args, Path(tmp), convoy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
