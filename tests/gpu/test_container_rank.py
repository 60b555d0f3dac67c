"""A rank in its own PID namespace (``unshare --pid --fork --mount-proc``, as a pod or a
containerised Slurm task) holding GPU memory with torch (marker ``gpu``, like the rest of
tests/gpu/): NVML reports its host PID, the daemon attributes that memory to the rank whose file
says ``"pid": 1``, and ``gpuwatchd check`` does not call it an orphan.

Prints ``PASS ...`` lines with the numbers (quoted in the device-run report).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.wiring import Parts

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

RANK = """
import os, sys, time, torch, gpuwatchd
block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
block.fill_(1)
torch.cuda.synchronize()
path = gpuwatchd.register_rank(job_id="podgpu", rank=0, rank_dir=sys.argv[1],
                               heartbeat="/tmp/podgpu.hb", cuda_oom_hook=False, strict=True)
gpuwatchd.heartbeat(0)
print("ready", os.getpid(), path, flush=True)
while True:
    gpuwatchd.heartbeat()
    time.sleep(0.25)
"""


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to make a PID namespace")
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    p = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", PY, "-c", RANK, str(ranks)],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert p.stdout is not None
    line = p.stdout.readline().split()
    assert line[:2] == ["ready", "1"], line
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
        host_pid = int(f.read().split()[0])
    yield p, host_pid, tmp_path
    p.kill()
    p.wait(30)


def test_rank_in_a_pid_namespace_is_attributed_by_nvmls_host_pid(pod: tuple[subprocess.Popen[str], int, Path]) -> None:
    _, host_pid, tmp = pod
    doc = json.loads((tmp / "ranks" / "podgpu.0.json").read_text())
    entry = doc["ranks"][0]
    assert entry["pid"] == 1 and entry["pid_ns"] == os.stat(f"/proc/{host_pid}/ns/pid").st_ino
    cfg_file = tmp / "config.yaml"
    cfg_file.write_text(
        f"rank_dir: {tmp / 'ranks'}\nstate_dir: {tmp / 'state'}\ndiscovery:\n  enabled: false\ngil:\n  enabled: false\n"
    )
    daemon = Daemon(load_config(str(cfg_file)), parts=lambda c, s: Parts(nvml=NvmlSubsystem(c, s, watch_udev=False)))
    sub = daemon.parts.nvml
    assert isinstance(sub, NvmlSubsystem)
    sub.start(daemon)
    try:
        deadline = time.monotonic() + 60
        while True:
            state = daemon.cycle()
            rows = [r for r in state.gpu_processes if r.pid == host_pid]
            if rows or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        [rank] = [r for r in state.ranks if r.job_id == "podgpu"]
        assert rank.alive and rank.pid == host_pid and rank.ns_pid == 1, rank
        [row] = rows
        assert (row.job_id, row.rank) == ("podgpu", "0"), row
        assert host_pid not in {o.pid for o in state.orphans}
        assert not [f for f in state.findings if f.kind in ("rank_down", "orphan_gpu_memory")]
        assert (row.used_memory_bytes or 0) >= 1 << 30
        print(
            f"PASS NVML pid {row.pid} (the rank file says pid 1, pid_ns {entry['pid_ns']}) -> "
            f"job {row.job_id} rank {row.rank}, {row.used_memory_bytes / (1 << 20):.0f} MiB; "
            f"rank alive, ns_pid {rank.ns_pid}; no orphan, no rank_down"
        )
    finally:
        sub.stop()
    r = subprocess.run(
        [PY, "-m", "gpuwatchd", "check", "--config.file", str(cfg_file), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=str(REPO),
    )
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "clean", r.stdout + r.stderr
    print(f"PASS gpuwatchd check exit 0: {r.stdout.strip()}")
    ps = subprocess.run(
        [PY, "-m", "gpuwatchd", "ps", "--config.file", str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=str(REPO),
    )
    assert f"pid {host_pid} (1 in its container)" in ps.stdout, ps.stdout + ps.stderr
    print("PASS gpuwatchd ps:\n" + textwrap.indent(ps.stdout.rstrip(), "     "))
