#!/usr/bin/env python3
"""Training throughput with gpuwatchd watching vs without: A/B interleaved windows on a GPU node.

    python3 -m bench.train_ab --pyspy PATH [--conditions defaults,continuous] [--pairs 6]
                              [--window 6] [--warmup 20] [--out F.json]

One real training process (a bf16 MLP stack trained with AdamW on the GPU, its loss read back every
10 steps as a real loop logs it; ``gpuwatchd.heartbeat``-style file touched every second) is
registered as a rank and runs for the whole benchmark, reporting its step count. Windows of
``--window`` seconds alternate between the two arms of a condition (ABBA order, so drift cancels):

* ``defaults``: the real daemon (``gpuwatchd run``) with the shipped defaults (GIL sampling, stall
  detection, kernel log, discovery, NVML) watching the rank, vs the same daemon SIGSTOPped with
  any py-spy run it has in flight (a stopped process costs nothing);
* ``continuous``: the daemon's own GIL sampling command (``PySpy.record_gil``, ``py-spy record
  --gil --nonblocking``) at ``--rate`` Hz back to back for the whole window, vs nothing.

Prints, per condition, steps/s of each arm (median of windows) and the ratio of medians with a
95 % bootstrap confidence interval (windows resampled within each arm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.benchlib import REPO
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import PySpyError

TRAINER = r"""
import os, sys, time
hb = sys.argv[1]
try:
    import torch
    assert torch.cuda.is_available()
    dev = "cuda"
except Exception:  # dry runs on a machine without a GPU: a Python loop stands in
    torch = None
if torch is not None:
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    y = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
step, last_beat, last_report = 0, 0.0, 0.0
while True:
    if torch is not None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % 10 == 0:
            loss.item()  # what a real loop's logging does: Python waits for the GPU here
    else:
        sum(i * i for i in range(20000))
    step += 1
    now = time.monotonic()
    if now - last_beat >= 1.0:
        with open(hb, "a"):
            os.utime(hb)
        last_beat = now
    if now - last_report >= 0.1:
        if torch is not None:
            torch.cuda.synchronize()
            now = time.monotonic()
        sys.stdout.write(f"{now} {step}\n")
        sys.stdout.flush()
        last_report = now
"""


class Trainer:
    def __init__(self, hb: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(hb)], stdout=subprocess.PIPE, text=True)
        self.points: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, step = line.split()
            with self._lock:
                self.points.append((float(t), int(step)))
                del self.points[:-2000]

    def at(self, t: float) -> tuple[float, int]:
        """The report nearest to ``t``."""
        with self._lock:
            return min(self.points, key=lambda p: abs(p[0] - t))

    def rate(self, t0: float, t1: float) -> float:
        (a, sa), (b, sb) = self.at(t0), self.at(t1)
        return (sb - sa) / (b - a) if b > a else float("nan")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def pause(pid: int, sig: int) -> None:
    """SIGSTOP/SIGCONT the daemon and its py-spy runs (each is its own session)."""
    for p in [pid, *children(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def ratio_ci(on: list[float], off: list[float], n: int = 4000) -> tuple[float, float, float]:
    rng = random.Random(1)
    point = statistics.median(on) / statistics.median(off)
    boots = sorted(
        statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
        for _ in range(n)
    )
    return point, boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def run_condition(name: str, args: argparse.Namespace, trainer: Trainer, tmp: Path) -> dict[str, Any]:
    daemon: subprocess.Popen[bytes] | None = None
    stop_sampling = threading.Event()
    spy = PySpy(args.pyspy)
    sampled = {"seconds": 0.0, "cpu": 0.0}

    def sample_back_to_back() -> None:
        while not stop_sampling.is_set():
            try:
                s = spy.record_gil(trainer.proc.pid, args.rate, 1.0)
                sampled["seconds"] += 1.0
                sampled["cpu"] += s.pyspy_cpu_seconds
            except PySpyError as e:
                print(f"  sample failed: {e}", flush=True)
                time.sleep(0.2)

    if name == "defaults":
        port = 19990
        cfg = tmp / "defaults.yaml"
        cfg.write_text(
            f"rank_dir: {tmp / 'ranks'}\nstate_dir: {tmp / 'state'}\n"
            f"web:\n  listen_address: '127.0.0.1:{port}'\ngil:\n  pyspy_path: {args.pyspy}\n"
        )
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)],
            cwd=str(REPO),
            stdout=subprocess.DEVNULL,
            stderr=(tmp / "defaults.log").open("wb"),
        )
        time.sleep(5)  # first cycle, rank seen
        pause(daemon.pid, signal.SIGSTOP)
    on: list[float] = []
    off: list[float] = []
    try:
        for pair in range(args.pairs):
            for arm in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                worker = None
                if arm == "on":
                    if daemon is not None:
                        pause(daemon.pid, signal.SIGCONT)
                    else:
                        stop_sampling.clear()
                        worker = threading.Thread(target=sample_back_to_back, daemon=True)
                        worker.start()
                time.sleep(0.5)  # settle: the arm's work has started
                t0 = time.monotonic()
                time.sleep(args.window)
                t1 = time.monotonic()
                (on if arm == "on" else off).append(trainer.rate(t0, t1))
                if arm == "on":
                    if daemon is not None:
                        pause(daemon.pid, signal.SIGSTOP)
                    else:
                        stop_sampling.set()
                        assert worker is not None
                        worker.join(5)
    finally:
        if daemon is not None:
            pause(daemon.pid, signal.SIGCONT)
            daemon.terminate()
            daemon.wait(15)
    point, lo, hi = ratio_ci(on, off)
    res = {
        "condition": name,
        "windows_on": on,
        "windows_off": off,
        "window_seconds": args.window,
        "median_on_steps_per_s": statistics.median(on),
        "median_off_steps_per_s": statistics.median(off),
        "ratio_on_over_off": point,
        "ci95": [lo, hi],
    }
    if name == "continuous":
        res["pyspy_sampled_seconds"] = sampled["seconds"]
        res["pyspy_cpu_per_sampled_second"] = sampled["cpu"] / max(sampled["seconds"], 1.0)
    what = (
        "shipped defaults (daemon running vs SIGSTOPped)"
        if name == "defaults"
        else f"continuous GIL sampling at {args.rate} Hz vs none"
    )
    print(
        f"{what}: {res['median_on_steps_per_s']:.2f} vs {res['median_off_steps_per_s']:.2f} steps/s "
        f"(median of {len(on)}+{len(off)} windows of {args.window:g} s): throughput ratio "
        f"{point:.4f} (95 % CI {lo:.4f}-{hi:.4f})",
        flush=True,
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pyspy", required=True)
    ap.add_argument("--conditions", default="defaults,continuous")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatch-train-ab-"))
    (tmp / "ranks").mkdir()
    hb = tmp / "rank0.hb"
    trainer = Trainer(hb)
    results: dict[str, Any] = {"conditions": []}
    try:
        deadline = time.monotonic() + 120
        while not trainer.points:
            assert trainer.proc.poll() is None, "trainer died"
            assert time.monotonic() < deadline, "trainer did not start"
            time.sleep(0.2)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwatchd",
                "register",
                "--job-id",
                "train-ab",
                "--rank",
                "0",
                "--pid",
                str(trainer.proc.pid),
                "--heartbeat",
                str(hb),
                "--rank-dir",
                str(tmp / "ranks"),
            ],
            check=True,
            cwd=str(REPO),
            capture_output=True,
        )
        time.sleep(args.warmup)
        print(f"trainer warm: {trainer.rate(time.monotonic() - 3, time.monotonic()):.2f} steps/s", flush=True)
        for name in args.conditions.split(","):
            results["conditions"].append(run_condition(name, args, trainer, tmp))
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    finally:
        trainer.close()
        log = tmp / "defaults.log"
        if log.exists() and ("Traceback" in log.read_text() or "ERROR" in log.read_text()):
            print(log.read_text()[-1500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
