"""fork_after_cuda on real processes: a "rank" that opened NVIDIA device files (what a CUDA context
keeps open) and then started children with the fork, spawn or forkserver start method.

The only fake is the device nodes: this host has no /dev/nvidia*, so the rank opens regular files
named nvidiactl, nvidia-uvm and nvidia0 in a temporary devfs (HostPaths(devfs=...)) with the same
flags the CUDA driver used on the H200 (O_RDWR|O_CLOEXEC, see tests/fixtures/nvml/README.md).
Everything else (/proc, fork, exec, fd inheritance) is real.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import fork_after_cuda as fork_rule
from gpuwatchd.model import GpuProcessRow, RankState
from gpuwatchd.model.parts import GpuOutput, Tracked
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.devfds import read_evidence
from gpuwatchd.sources.procfs import ProcfsReader

RANK = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, sys, time

    def work(dev, reopen):
        if reopen:  # a spawned worker that initialises CUDA itself opens its own descriptors
            fds = [os.open(os.path.join(dev, n), os.O_RDWR | os.O_CLOEXEC)
                   for n in ("nvidiactl", "nvidia-uvm")]
        time.sleep(120)

    if __name__ == "__main__":
        dev, method, out, reopen, close = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
        fds = [os.open(os.path.join(dev, n), os.O_RDWR | os.O_CLOEXEC)
               for n in ("nvidiactl", "nvidia-uvm", "nvidia0")]
        if close == "1":
            [os.close(fd) for fd in fds]
        ctx = mp.get_context(method)
        kids = [ctx.Process(target=work, args=(dev, reopen == "1")) for _ in range(2)]
        for k in kids:
            k.start()
        with open(out + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "children": [k.pid for k in kids]}, f)
        os.replace(out + ".tmp", out)
        time.sleep(120)
    """
)


@pytest.fixture
def devfs(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0"):
        (dev / name).write_bytes(b"")
    return dev


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
    # children of a killed rank: end them by PID
    for p in started:
        for pid in getattr(p, "kids", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def _start(
    tmp_path: Path, devfs: Path, method: str, ranks: list, reopen: bool = False, close: bool = False
) -> tuple[int, list[int]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / f"ready-{method}-{reopen}-{close}.json"
    p = subprocess.Popen(
        [sys.executable, str(script), str(devfs), method, str(out), "1" if reopen else "0", "1" if close else "0"]
    )
    ranks.append(p)
    deadline = time.monotonic() + 30
    while not out.exists():
        assert time.monotonic() < deadline, "rank did not start its workers"
        assert p.poll() is None
        time.sleep(0.05)
    doc = json.loads(out.read_text())
    p.kids = doc["children"]  # type: ignore[attr-defined]
    time.sleep(0.3 if method == "fork" else 1.0)  # let spawned children exec and open their fds
    return doc["pid"], doc["children"]


def _findings(devfs: Path, rank_pid: int, gpu_processes: tuple = ()) -> list:
    paths = HostPaths(devfs=str(devfs))
    procfs = ProcfsReader(paths)
    tree = (rank_pid, *procfs.descendants(rank_pid))
    evidence = {pid: ev for pid in tree if (ev := read_evidence(paths, pid)) is not None}
    rank = RankState(
        job_id="llm-7",
        rank=1,
        pid=rank_pid,
        local_rank=1,
        world_size=8,
        alive=True,
        process=procfs.read_process(rank_pid),
        tree=tree,
    )
    ctx = FindingContext(
        now=time.time(),
        config=Config(),
        ranks=(rank,),
        gpu_processes=gpu_processes,
        parts=Tracked(gpu=GpuOutput(fork_evidence=evidence)),
    )
    return list(fork_rule.find(ctx))


def test_fork_children_that_inherited_device_fds_are_flagged(tmp_path: Path, devfs: Path, ranks: list) -> None:
    pid, kids = _start(tmp_path, devfs, "fork", ranks)
    paths = HostPaths(devfs=str(devfs))
    parent = read_evidence(paths, pid)
    assert parent is not None and parent.holds_cuda_device
    child = read_evidence(paths, kids[0])
    assert child is not None
    assert child.nvidia_fds == parent.nvidia_fds  # same numbers, same devices: inherited
    assert child.cmdline_digest == parent.cmdline_digest and child.exe == parent.exe
    (f,) = _findings(devfs, pid)
    assert f.kind == "fork_after_cuda" and f.severity == "warning"
    assert (f.job_id, f.rank, f.pid) == ("llm-7", "1", str(pid))
    assert sorted(f.evidence["children"]) == sorted(kids)
    assert "forked 2 child process(es)" in f.explanation and "spawn" in f.explanation
    assert str(devfs / "nvidiactl") in f.explanation
    # the workers only inherited the descriptors: a latent risk, said as such
    assert "no child used the GPU (inherited descriptors only: a latent risk" in f.explanation
    assert f.evidence["used_gpu"] is False


def test_fork_children_that_used_the_gpu_are_said_to(tmp_path: Path, devfs: Path, ranks: list) -> None:
    """A fork worker that opened the NVIDIA devices itself (a CUDA call after the fork), and one
    NVML lists with memory of its own: each is named as a child that used the GPU."""
    pid, kids = _start(tmp_path, devfs, "fork", ranks, reopen=True)
    (f,) = _findings(devfs, pid)
    assert f.evidence["used_gpu"] is True
    assert "a child used the GPU after the fork (a fault" in f.explanation
    assert f"PID {kids[0]} opened {devfs / 'nvidia-uvm'}, {devfs / 'nvidiactl'} after the fork" in f.explanation
    # NVML's process list (a recorded shape: the GPU is absent here) names the other worker
    pid2, kids2 = _start(tmp_path, devfs, "fork", ranks)
    row = GpuProcessRow(
        gpu_index=0,
        uuid="GPU-0",
        pid=kids2[1],
        used_memory_bytes=500 << 20,
        comm="python",
        user="root",
        job_id="llm-7",
        rank="1",
    )
    (g,) = _findings(devfs, pid2, (row,))
    assert g.evidence["used_gpu"] is True
    assert f"PID {kids2[1]} has its own CUDA context on GPU 0 holding 500.0 MiB (NVML)" in g.explanation


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_children_are_not_flagged(tmp_path: Path, devfs: Path, ranks: list, method: str) -> None:
    pid, _kids = _start(tmp_path, devfs, method, ranks)
    assert read_evidence(HostPaths(devfs=str(devfs)), pid).holds_cuda_device  # type: ignore[union-attr]
    assert _findings(devfs, pid) == []


def test_spawned_child_with_its_own_cuda_context_is_not_flagged(tmp_path: Path, devfs: Path, ranks: list) -> None:
    pid, kids = _start(tmp_path, devfs, "spawn", ranks, reopen=True)
    paths = HostPaths(devfs=str(devfs))
    deadline = time.monotonic() + 20
    child = read_evidence(paths, kids[0])
    while (child is None or not child.nvidia_fds) and time.monotonic() < deadline:
        time.sleep(0.1)
        child = read_evidence(paths, kids[0])
    assert child is not None and child.holds_cuda_device  # it has device fds of its own...
    assert _findings(devfs, pid) == []  # ...but it was exec'd fresh: not a fork after CUDA


def test_fork_without_a_cuda_context_is_not_flagged(tmp_path: Path, devfs: Path, ranks: list) -> None:
    pid, _ = _start(tmp_path, devfs, "fork", ranks, close=True)
    assert _findings(devfs, pid) == []


def test_device_fds_match_readlink_of_each_fd_path(tmp_path: Path, devfs: Path, ranks: list) -> None:
    """The fd scan reads each link relative to the fd directory opened once (a path walk of one
    name): the same (fd, target) pairs as readlink of every /proc/PID/fd/N path, the oracle."""
    rank_pid, kids = _start(tmp_path, devfs, "fork", ranks)
    for pid in (rank_pid, *kids):
        fd_dir = f"/proc/{pid}/fd"
        want = []
        for name in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(os.path.join(fd_dir, name))
                if target.startswith(str(devfs / "nvidia")):
                    want.append((int(name), target))
        ev = read_evidence(HostPaths(devfs=str(devfs)), pid)
        assert ev is not None
        assert ev.nvidia_fds == tuple(sorted(want))
        assert len(ev.nvidia_fds) == 3  # nvidiactl, nvidia-uvm, nvidia0: inherited by the fork
