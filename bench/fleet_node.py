"""One real GPU node's exposition, the template of the fleet benchmark (bench/fleet_prometheus.py).

Starts a real `gpuwatchd run` (loopback port, temp rank/state dirs) watching 8 real rank
processes, each with 2 forked DataLoader-style worker children (16 workers) and a heartbeat
file that carries the step (as `gpuwatchd.heartbeat(step)` writes it), registered with
`gpuwatchd register` on GPUs 0..7 of the 8-GPU NVML fixture
tests/fixtures/nvml/derived_h200_x8.json (derived from the H200 recording; its recorded PIDs are
replaced by the live rank PIDs, and each GPU reports clock event reasons 0, as a datacenter GPU's
`nvmlDeviceGetCurrentClocksEventReasons` does when nothing slows it: the recording predates that
call). As root on a cgroup v1 host each rank runs in its own memory cgroup with a limit (as Slurm's
task cgroups and Kubernetes containers have), created as /sys/fs/cgroup/memory/gwfleet-node-PID-R
and removed afterwards. Waits until every rank, GPU and step is in /metrics, then returns the
text. Costs ~20 s wall and a few % of a core while it runs; kills what it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from bench.benchlib import REPO, free_port

FIXTURE = REPO / "tests" / "fixtures" / "nvml" / "derived_h200_x8.json"
GPUS = 8
WORKERS_PER_RANK = 2
JOB_ID = "llm-70b"
WORLD_SIZE = 64

MEMCG_V1 = Path("/sys/fs/cgroup/memory")
RANK_MEMORY_LIMIT = 64 << 30

# A rank: joins its memory cgroup (argv[3], may be empty), forks its DataLoader workers (children
# with the same argv, as fork-started workers are), then makes progress: one step a second,
# written to its heartbeat file the way gpuwatchd.heartbeat(step) writes it (tmp file + rename).
RANK_PROGRAM = """
import os, sys, time
hb, workers, cg = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if cg:
    with open(cg + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
for _ in range(workers):
    if os.fork() == 0:
        while True:
            time.sleep(60)
step = 0
while True:
    with open(hb + ".tmp", "w") as f:
        f.write(str(step) + "\\n")
    os.replace(hb + ".tmp", hb)
    step += 1
    time.sleep(1)
"""


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return None


def _rank_memcgs() -> list[Path]:
    """One limited v1 memory cgroup per rank, or none where this process may not create them."""
    if os.geteuid() != 0 or not (MEMCG_V1 / "memory.limit_in_bytes").exists():
        return []
    out = []
    for r in range(GPUS):
        cg = MEMCG_V1 / f"gwfleet-node-{os.getpid()}-{r}"
        cg.mkdir()
        out.append(cg)
        (cg / "memory.limit_in_bytes").write_text(str(RANK_MEMORY_LIMIT))
    return out


def _remove_memcgs(cgs: list[Path]) -> None:
    for cg in cgs:
        deadline = time.monotonic() + 10
        while True:  # rmdir fails while the killed processes are still being reaped
            try:
                cg.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def node_exposition(timeout: float = 60.0, gil: bool = True) -> str:
    """The /metrics text of a real daemon watching 8 ranks with 16 workers on 8 fixture GPUs."""
    gw = str(Path(sys.executable).with_name("gpuwatchd"))
    with tempfile.TemporaryDirectory(prefix="gwfleet-node-") as tmp:
        d = Path(tmp)
        ranks_dir, state = d / "ranks", d / "state"
        ranks_dir.mkdir()
        state.mkdir()
        procs: list[subprocess.Popen[bytes]] = []
        daemon: subprocess.Popen[bytes] | None = None
        cgs = _rank_memcgs()
        try:
            for r in range(GPUS):
                hb = d / f"hb{r}"
                hb.touch()
                # own session: the rank and its workers are killed as one process group
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            RANK_PROGRAM,
                            str(hb),
                            str(WORKERS_PER_RANK),
                            str(cgs[r]) if cgs else "",
                        ],
                        start_new_session=True,
                    )
                )
            doc = json.loads(FIXTURE.read_text())
            live = {668 + r: p.pid for r, p in enumerate(procs)}
            for cycle in doc["cycles"]:
                for dev in cycle["devices"]:
                    for key in ("compute", "process_utilization"):
                        dev[key] = [dict(p, pid=live[p["pid"]]) for p in dev[key]]
                    dev.setdefault("clocks_event_reasons", 0)
            fixture = d / "nvml.json"
            fixture.write_text(json.dumps(doc))
            port = free_port()
            cfg = {
                "web": {"listen_address": f"127.0.0.1:{port}"},
                "interval_seconds": 1,
                "rank_dir": str(ranks_dir),
                "state_dir": str(state),
                "kernel_log": "kmsg",
                "nvml": {"fixture": str(fixture)},
                "discovery": {"enabled": False},
                "gil": {"enabled": gil, "interval_seconds": 5, "duration_seconds": 1},
            }
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
            for r, p in enumerate(procs):
                subprocess.run(
                    [
                        gw,
                        "register",
                        "--job-id",
                        JOB_ID,
                        "--rank",
                        str(r),
                        "--local-rank",
                        str(r),
                        "--pid",
                        str(p.pid),
                        "--world-size",
                        str(WORLD_SIZE),
                        "--gpus",
                        str(r),
                        "--heartbeat",
                        str(d / f"hb{r}"),
                        "--rank-dir",
                        str(ranks_dir),
                    ],
                    check=True,
                    capture_output=True,
                )
            with (d / "daemon.log").open("wb") as log:
                daemon = subprocess.Popen(
                    [gw, "run", "--config.file", str(d / "config.yaml")], stdout=log, stderr=subprocess.STDOUT
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                text = _scrape(f"http://127.0.0.1:{port}/metrics")
                if text and _complete(text, gil):
                    return text
                if daemon.poll() is not None:
                    break
                time.sleep(0.5)
            raise RuntimeError(
                "daemon /metrics never showed all 8 ranks and GPUs:\n" + (d / "daemon.log").read_text()[-3000:]
            )
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(timeout=10)
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            _remove_memcgs(cgs)


def _complete(text: str, gil: bool) -> bool:
    need = [f'gpuwatch_rank_up{{job_id="{JOB_ID}",rank="{r}"}} 1' for r in range(GPUS)]
    need += [f'gpuwatch_gpu_info{{gpu="{g}"' for g in range(GPUS)]
    need += ["gpuwatch_rank_gpu_memory_bytes{", "gpuwatch_gpu_clock_throttled{"]
    need += [f'gpuwatch_rank_step{{job_id="{JOB_ID}",rank="{r}"}}' for r in range(GPUS)]
    if gil:
        need += [f'gpuwatch_rank_gil_samples_total{{job_id="{JOB_ID}",rank="{r}"}}' for r in range(GPUS)]
    return all(n in text for n in need)


if __name__ == "__main__":
    sys.stdout.write(node_exposition())
