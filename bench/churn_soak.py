"""Job-churn soak: N jobs per second started and ended against the real daemon, for minutes.

Starts the real daemon (``gpuwatchd run``: rank files, /proc, py-spy GIL sampling, the kernel log
from /dev/kmsg when readable) on loopback, then keeps ``--live-jobs`` jobs alive at all times,
starting ``--jobs-per-second`` new ones (each ``--ranks-per-job`` real Python processes, registered
through one rank file) and ending the oldest as each new one starts (SIGKILL, then the rank file is
removed, as a Slurm epilog would). Every ``--oom-every``-th job runs one rank inside its own 32 MiB
memory cgroup (cgroup v1 ``memory.limit_in_bytes``, named ``gwtrust_state_soak_*``) that allocates
past the limit a second after it registered: a real kernel OOM kill, counted by the daemon.

Every ``--sample-seconds`` it prints: live ranks (``gpuwatch_rank_up == 1``), series in /metrics,
exposition bytes, the daemon's RSS and open fds (the least of five reads in a second), and the
sizes of ``state.json``, ``events.jsonl`` and ``rank_trees.json``. At the end: the first sample,
the steady value (median of the samples from ``--steady-from`` to 80 % of the run) and the last
sample, with last/steady, for the same number of live ranks. ``oom_kills`` and ``events_jsonl``
are not resources but records of events: they grow by design, the counters until
``retention.oom_kill_seconds`` (30 min), the log until ``max_log_bytes`` (16 MB, then compacted).
Not a timed test: a soak whose numbers are kept in bench/results/.

Run as root (memory cgroups, /dev/kmsg): ``.venv/bin/python -m bench.churn_soak
[--duration 600] [--jobs-per-second 2]``; ``--repo DIR`` runs another checkout's daemon (the
code before a fix) with the same load.
"""

from __future__ import annotations

import argparse
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
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import yaml

from bench.benchlib import REPO, free_port, rss_kib

RANK_CODE = "import time\nwhile True:\n    time.sleep(0.05)\n"
# Waits a second (registered meanwhile), then writes 64 MiB into a 32 MiB cgroup.
OOM_CODE = "import time\ntime.sleep(1.0)\nx = b'x' * (64 << 20)\ntime.sleep(60)\n"
CGROUP_V1 = "/sys/fs/cgroup/memory"


class MemCgroup:
    """A uniquely named cgroup-v1 memory cgroup with a small limit (removed by ``remove``)."""

    def __init__(self, limit_bytes: int = 32 << 20) -> None:
        self.path = os.path.join(CGROUP_V1, f"gwtrust_state_soak_{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        with open(os.path.join(self.path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))

    def enter(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def remove(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


class Job:
    def __init__(self, rank_dir: Path, n: int, ranks: int, oom: bool) -> None:
        self.job_id = f"soak-{n}"
        self.cgroup = MemCgroup() if oom else None
        self.procs: list[subprocess.Popen[bytes]] = []
        for r in range(ranks):
            in_cg = self.cgroup is not None and r == ranks - 1
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", OOM_CODE if in_cg else RANK_CODE],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    preexec_fn=self.cgroup.enter if in_cg and self.cgroup else None,
                )
            )
        doc = {
            "version": 1,
            "job_id": self.job_id,
            "world_size": ranks,
            "ranks": [{"rank": r, "local_rank": r, "pid": p.pid} for r, p in enumerate(self.procs)],
        }
        self.path = rank_dir / f"{self.job_id}.json"
        tmp = rank_dir / f".{self.job_id}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)

    def end(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=10)
        self.path.unlink(missing_ok=True)
        if self.cgroup is not None:
            self.cgroup.remove()


def measure(url: str, pid: int, state_dir: Path) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read()
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    live = sum(1 for ln in lines if ln.startswith("gpuwatch_rank_up{") and ln.endswith(" 1.0"))
    kills = sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in lines
        if ln.startswith("gpuwatch_oom_kills_total{") and 'job_id="soak-' in ln
    )
    rss_kb = rss_kib(pid)

    # the least of five reads 0.2 s apart: a py-spy child in flight holds pipes for a moment;
    # a leak still shows, in every read
    reads = []
    for _ in range(5):
        reads.append(len(os.listdir(f"/proc/{pid}/fd")))
        time.sleep(0.2)
    fds = min(reads)

    def size(name: str) -> float:
        try:
            return float(os.path.getsize(state_dir / name))
        except OSError:
            return 0.0

    return {
        "live_ranks": float(live),
        "oom_kills": kills,
        "series": float(len(lines)),
        "bytes": float(len(body)),
        "rss_mb": rss_kb / 1024,
        "fds": float(fds),
        "state_json": size("state.json"),
        "events_jsonl": size("events.jsonl"),
        "rank_trees": size("rank_trees.json"),
    }


COLS = ("live_ranks", "oom_kills", "series", "bytes", "rss_mb", "fds", "state_json", "events_jsonl", "rank_trees")


def row(t: float, m: dict[str, float]) -> str:
    return f"{t:7.0f} " + " ".join(f"{m[c]:>12.1f}" if c == "rss_mb" else f"{m[c]:>12.0f}" for c in COLS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--jobs-per-second", type=float, default=2.0)
    ap.add_argument("--live-jobs", type=int, default=6)
    ap.add_argument("--ranks-per-job", type=int, default=2)
    ap.add_argument("--oom-every", type=int, default=50, help="0: no OOM kills")
    ap.add_argument("--interval", type=float, default=1.0, help="the daemon's interval_seconds")
    ap.add_argument("--sample-seconds", type=float, default=30.0)
    ap.add_argument("--steady-from", type=float, default=180.0)
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout whose daemon to run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gwtrust-state-soak-"))
    (tmp / "ranks").mkdir()
    (tmp / "ranks").chmod(0o1777)
    kmsg = os.access("/dev/kmsg", os.R_OK)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cfg: dict[str, Any] = {
        "web": {"listen_address": f"127.0.0.1:{free_port()}"},
        "interval_seconds": args.interval,
        "rank_dir": str(tmp / "ranks"),
        "state_dir": str(tmp / "state"),
        "kernel_log": "kmsg" if kmsg else "off",
        "gil": {
            "enabled": True,
            "interval_seconds": 3.0,
            "duration_seconds": 0.5,
            "rate_hz": 50,
            "max_concurrent": 2,
            "pyspy_path": pyspy,
        },
        "nvml": {"enabled": False},
        "discovery": {"enabled": False},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - closed at the end
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(tmp / "config.yaml")],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=args.repo,
        env={**os.environ, "PYTHONPATH": str(args.repo)},
    )
    url = f"http://{cfg['web']['listen_address']}/metrics"
    jobs: deque[Job] = deque()
    samples: list[tuple[float, dict[str, float]]] = []
    started = ended = 0
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                measure(url, daemon.pid, tmp / "state")
                break
            except OSError:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError((tmp / "daemon.log").read_text()) from None
                time.sleep(0.2)
        print(
            f"# churn soak: {args.jobs_per_second:g} jobs/s, {args.live_jobs} live jobs x "
            f"{args.ranks_per_job} ranks, OOM kill every {args.oom_every or 'no'} jobs, "
            f"{args.duration:g} s, daemon interval {args.interval:g} s, kernel_log "
            f"{cfg['kernel_log']}, repo {args.repo}",
            flush=True,
        )
        print(f"{'t_s':>7} " + " ".join(f"{c:>12}" for c in COLS), flush=True)
        t0 = time.monotonic()
        next_job = t0
        next_sample = t0 + 10.0  # the first live jobs are registered by then
        while (now := time.monotonic()) < t0 + args.duration:
            if now >= next_job:
                oom = args.oom_every > 0 and started % args.oom_every == args.oom_every - 1
                jobs.append(Job(tmp / "ranks", started, args.ranks_per_job, oom))
                started += 1
                if len(jobs) > args.live_jobs:
                    jobs.popleft().end()
                    ended += 1
                next_job += 1.0 / args.jobs_per_second
            if now >= next_sample:
                m = measure(url, daemon.pid, tmp / "state")
                samples.append((now - t0, m))
                print(row(now - t0, m), flush=True)
                next_sample += args.sample_seconds
            time.sleep(max(0.0, min(next_job, next_sample) - time.monotonic()))
        m = measure(url, daemon.pid, tmp / "state")
        samples.append((time.monotonic() - t0, m))
        print(row(samples[-1][0], m), flush=True)
    finally:
        while jobs:
            jobs.popleft().end()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    steady = [m for t, m in samples if args.steady_from <= t <= 0.8 * args.duration] or [m for _, m in samples]
    first, last = samples[0][1], samples[-1][1]
    print(
        f"\n# {started} jobs started, {ended} ended ({started * args.ranks_per_job} rank "
        f"processes); steady = median of {len(steady)} samples from t={args.steady_from:g} s "
        f"to t={0.8 * args.duration:g} s"
    )
    print(f"{'figure':>12} {'start':>12} {'steady':>12} {'end':>12} {'end/steady':>11}")
    for c in COLS:
        s = statistics.median(m[c] for m in steady)
        ratio = f"{last[c] / s:11.3f}" if s else f"{'-':>11}"
        print(f"{c:>12} {first[c]:>12.1f} {s:>12.1f} {last[c]:>12.1f} {ratio}")
    oom_jobs = started // args.oom_every if args.oom_every else 0
    print(
        f"# {oom_jobs} jobs ran a rank into its memory cgroup's limit; oom_kills = the sum of "
        f"gpuwatch_oom_kills_total of soak jobs in /metrics; daemon exit {daemon.returncode}"
    )
    if args.keep:
        print(f"# kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
