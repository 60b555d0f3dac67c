"""The seeds, recreated with real torch processes on a real NVIDIA GPU (marker ``gpu``).

1. a job's rank holds memory: attributed to (job_id, rank), equal to nvidia-smi's figure (±1 %);
2. a nohup'ed child of a wrapper that is then killed keeps 5 GiB: ``reparented_to_init`` with the
   memory nvidia-smi shows (±1 %); ``gpuwatchd check`` exits 1 naming its PID; ``check --kill``
   frees it and a second ``check`` exits 0;
3. a rank that allocates more than is left hits CUDA OOM and the finding names the co-tenant;
4. a DataLoader with the fork start method after CUDA init is flagged, the same with spawn is not.

Each test prints a ``PASS ...`` line with its numbers (quoted in the device-run report).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.wiring import Parts

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
GIB = 1 << 30


def smi_mib() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = {}
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        rows[int(pid)] = int(mib)
    return rows


def wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.1)


def gwd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [PY, "-m", "gpuwatchd", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO)
    )


class World:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.rank_dir = tmp / "ranks"
        self.rank_dir.mkdir()
        self.cfg_file = tmp / "config.yaml"
        self.cfg_file.write_text(
            f"rank_dir: {self.rank_dir}\nstate_dir: {tmp / 'state'}\n"
            "orphans:\n  grace_seconds: 2\ndiscovery:\n  enabled: false\ngil:\n  enabled: false\n"
        )
        self.procs: list[subprocess.Popen[Any]] = []
        self.pids: list[int] = []
        self.daemon = Daemon(
            load_config(str(self.cfg_file)), parts=lambda c, s: Parts(nvml=NvmlSubsystem(c, s, watch_udev=False))
        )
        sub = self.daemon.parts.nvml
        assert isinstance(sub, NvmlSubsystem)
        self.sub = sub
        self.sub.start(self.daemon)

    def popen(self, args: list[str], **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen(args, **kw)
        self.procs.append(p)
        return p

    def holder(self, gib: float, name: str) -> int:
        ready = self.tmp / f"{name}.pid"
        self.popen([PY, str(HERE / "holder.py"), "--gib", str(gib), "--ready-file", str(ready)])
        wait_for(ready)
        pid = int(ready.read_text())
        self.pids.append(pid)
        return pid

    def register(self, job: str, rank: int, pid: int) -> None:
        r = gwd("register", "--job-id", job, "--rank", str(rank), "--pid", str(pid), "--rank-dir", str(self.rank_dir))
        assert r.returncode == 0, r.stderr

    def close(self) -> None:
        self.sub.stop()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("gpuwatch"))
    yield w
    w.close()


def test_1_rank_memory_is_attributed_and_matches_nvidia_smi(world: World) -> None:
    rank = world.holder(2, "rank0")
    world.register("dflash", 0, rank)
    state = world.daemon.cycle()
    row = next(r for r in state.gpu_processes if r.pid == rank)
    assert (row.job_id, row.rank) == ("dflash", "0")
    smi = smi_mib()[rank]
    nvml_mib = row.used_memory_bytes / (1 << 20)
    assert abs(nvml_mib - smi) <= 0.01 * smi
    nvml = next(c for c in state.collectors if c.name == "nvml")
    assert nvml.success
    xid = world.sub.xid
    assert xid is not None and xid.error == ""
    assert xid.running  # registered for Xid critical-error events on this GPU
    # the daemon's one-call compute list (sources/nvml_compute.py) against nvidia-ml-py's own,
    # with three more holders on the GPU: the same processes and memory
    more = [world.holder(0.25, f"extra{i}") for i in range(3)]
    import pynvml

    from gpuwatchd.sources.nvml_compute import ComputeProcesses

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        cp = ComputeProcesses(pynvml)
        assert cp.available
        mine = [cp(0, h) for _ in range(3)]
        theirs = {(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    finally:
        pynvml.nvmlShutdown()
    assert all({(p.pid, p.usedGpuMemory) for p in m} == theirs for m in mine), (mine, theirs)
    assert {rank, *more} <= {pid for pid, _ in theirs} and cp.calls <= 4
    print(
        f"PASS rank memory: pid {rank} job dflash rank 0 nvml {nvml_mib:.0f} MiB "
        f"nvidia-smi {smi} MiB; nvml collector {nvml.duration_seconds * 1e3:.2f} ms; "
        f"Xid event thread registered and waiting; one-call compute list = nvidia-ml-py's "
        f"({len(theirs)} processes, {cp.calls} driver calls for 3 reads)"
    )


def test_2_seed_nohup_child_of_killed_wrapper(world: World) -> None:
    ready = world.tmp / "stale.pid"
    wrapper = world.popen(
        ["bash", "-c", f"nohup {PY} {HERE / 'holder.py'} --gib 5 --ready-file {ready} >/dev/null 2>&1 & wait"]
    )
    wait_for(ready)
    stale = int(ready.read_text())
    world.pids.append(stale)
    state = world.daemon.cycle()
    assert stale not in {o.pid for o in state.orphans}  # within grace, parent alive
    wrapper.send_signal(signal.SIGKILL)
    wrapper.wait()
    deadline = time.monotonic() + 10
    while (
        int(Path(f"/proc/{stale}/stat").read_text().rsplit(")", 1)[1].split()[1]) == wrapper.pid
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    time.sleep(2.5)  # orphans.grace_seconds: 2
    state = world.daemon.cycle()
    (o,) = [o for o in state.orphans if o.pid == stale]
    assert o.reason == "reparented_to_init"
    smi = smi_mib()[stale]
    mib = o.used_memory_bytes / (1 << 20)
    assert abs(mib - smi) <= 0.01 * smi
    (f,) = [f for f in state.findings if f.kind == "orphan_gpu_memory" and f.pid == str(stale)]
    print(f"PASS orphan: pid {stale} reason {o.reason} nvml {mib:.0f} MiB nvidia-smi {smi} MiB")
    print(f"     finding: {f.explanation}")

    r = gwd("check", "--config.file", str(world.cfg_file))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f" {stale} " in r.stdout and "reparented_to_init" in r.stdout
    print("PASS check exit 1:\n" + textwrap.indent(r.stdout.rstrip(), "     "))
    r = gwd("check", "--config.file", str(world.cfg_file), "--kill", "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"PASS check --kill exit 0: {r.stdout.strip()}")
    r = gwd("check", "--config.file", str(world.cfg_file), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["status"] == "clean"
    assert stale not in smi_mib()
    print(
        f"PASS second check exit 0: {json.loads(r.stdout)['status']}; nvidia-smi no longer "
        f"lists {stale}; the registered rank still holds {smi_mib()[state.ranks[0].pid]} MiB"
    )


OOM_RANK = """
import sys, torch, gpuwatchd
torch.cuda.init()
torch.ones(1, device="cuda")
print(gpuwatchd.register_rank(job_id="dflash", rank=1, rank_dir=sys.argv[1], heartbeat=False),
      flush=True)
try:
    torch.empty(int(float(sys.argv[2]) * (1 << 30)), dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:  # caught: only the allocator observer can see it
    print("OOM:", str(e).splitlines()[0][:300], flush=True)
"""


def test_3_cuda_oom_names_the_co_tenant(world: World) -> None:
    import pynvml

    pynvml.nvmlInit()
    free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free
    pynvml.nvmlShutdown()
    tenant_gib = max(1.0, free / GIB - 30)
    tenant = world.holder(tenant_gib, "tenant")
    world.daemon.cycle()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [PY, "-c", OOM_RANK, str(world.rank_dir), "60"], capture_output=True, text=True, timeout=180, env=env
    )
    assert r.returncode == 0 and "OOM: CUDA out of memory" in r.stdout, r.stdout + r.stderr
    state = world.daemon.cycle()
    (f,) = [f for f in state.findings if f.kind == "cuda_oom" and f.rank == "1"]
    assert f"PID {tenant}" in f.explanation and "not in any job" in f.explanation
    assert world.daemon.counters.get("cuda_oom_errors", ("dflash", "1", "0")) == 1
    print(f"PASS cuda oom: co-tenant pid {tenant} holding {tenant_gib:.1f} GiB named")
    print(f"     rank said: {r.stdout.strip().splitlines()[-1]}")
    print(f"     finding: {f.explanation}")
    os.kill(tenant, signal.SIGKILL)


def test_4_dataloader_fork_is_flagged_spawn_is_not(world: World) -> None:
    pids = {}
    for method in ("fork", "spawn"):
        ready = world.tmp / f"dl-{method}.json"
        world.popen([PY, str(HERE / "dataloader_rank.py"), "--start-method", method, "--ready-file", str(ready)])
        wait_for(ready)
        doc = json.loads(ready.read_text())
        pids[method] = doc
        world.pids += [doc["pid"], *doc["workers"]]
        world.register(f"dl-{method}", 0, doc["pid"])
    time.sleep(1)
    state = world.daemon.cycle()
    flagged = [f for f in state.findings if f.kind == "fork_after_cuda"]
    assert [(f.job_id, f.pid) for f in flagged] == [("dl-fork", str(pids["fork"]["pid"]))]
    assert sorted(flagged[0].evidence["children"]) == sorted(pids["fork"]["workers"])
    print(
        f"PASS fork_after_cuda: fork rank {pids['fork']['pid']} flagged "
        f"(workers {pids['fork']['workers']}), spawn rank {pids['spawn']['pid']} "
        f"(workers {pids['spawn']['workers']}) not flagged"
    )
    print(f"     finding: {flagged[0].explanation}")
