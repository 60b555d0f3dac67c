"""Jobs nobody changed, on a real GPU, through the real daemon (marker ``gpu``; issue 22).

Every rank here is found by discovery only (torchrun's variables, no rank file, no heartbeat) and
judged by its stacks, /proc and NVML (join/stall_spin.py), with ``stall.after_seconds`` = AFTER:

1. healthy, never paged over 3 x AFTER: one GPU-bound rank syncing with ``.item()`` every step;
   a two-rank gloo job whose rank 0 pauses AFTER/2 every ten steps (a checkpoint) while rank 1
   waits in all_reduce;
2. hangs, paged within AFTER plus one look (plus discovery's interval): a GPU spin hang (one kernel
   that never ends) behind ``synchronize()`` and behind ``.item()``, confirmed by the GPU; a
   deadlock; a collective hang (three gloo ranks, the last blocked in load_batch) with the odd one
   out named;
3. heartbeats with no code change: ``torchrun ... -m gpuwatchd.rank.run train.py`` and, with the wheel
   installed in a venv, ``GPUWATCHD_HEARTBEAT=1 torchrun ... train.py``: the rank file appears with
   its heartbeat, and when the script stops stepping it is paged with ``method: heartbeat``.

Each prints what it saw (``SAW ...``), for bench/results/.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import free_port
from gpuworld import HERE, REPO, repo_env, say
from gpuworld import World as DaemonWorld

INTERVAL = 0.5
AFTER = 4.0
DISCOVERY = 1.0
LOOK = max(AFTER / 5, INTERVAL)


class World(DaemonWorld):
    def __init__(self, tmp: Path) -> None:
        super().__init__(
            tmp,
            poll=0.1,
            interval_seconds=INTERVAL,
            discovery={"enabled": True, "interval_seconds": DISCOVERY},
            stall={"after_seconds": AFTER, "compile_after_seconds": 600},
        )

    def env(self, job: str, rank: int = 0, world: int = 1) -> dict[str, str]:
        return repo_env(
            TORCHELASTIC_RUN_ID=job,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            GPUWATCH_RANK_DIR=str(self.rank_dir),
        )

    def start(self, cmd: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
        return super().start(cmd, env, start_new_session=True, **popen)

    def rank(self, mode: str, job: str, rank: int = 0, world: int = 1, *extra: str) -> subprocess.Popen[str]:
        return self.start([sys.executable, str(HERE / "discovered_rank.py"), mode, *extra], self.env(job, rank, world))

    def watched(self, job: str, ranks: int) -> None:
        self.wait(
            lambda: all(
                self.d.value("gpuwatch_rank_stalled", job_id=job, rank=str(r)) is not None for r in range(ranks)
            ),
            30,
            f"{job} discovered",
        )

    def paged(self, job: str) -> dict[str, dict[str, Any]]:
        return {f["rank"]: f for f in self.findings(job) if f["kind"] == "rank_stalled"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("discovered"))
    yield w
    w.close()


def _never_paged(world: World, job: str, seconds: float) -> list[str]:
    kinds: list[str] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        now = world.findings(job)
        assert not [f for f in now if f["kind"] == "rank_stalled"], now
        kinds += [
            f"{f['kind']} rank {f['rank']}: {f['explanation']}"
            for f in now
            if f"{f['kind']} rank {f['rank']}: {f['explanation']}" not in kinds
        ]
        time.sleep(INTERVAL / 2)
    return kinds


def test_healthy_item_loop_is_never_paged(world: World) -> None:
    job = f"h1a-{uuid.uuid4().hex[:6]}"
    p = world.rank("item_loop", job)
    world.ready(p)
    world.watched(job, 1)
    seen = _never_paged(world, job, 3 * AFTER + 2 * LOOK)
    say("item_loop findings over 3 x after", seen or "none")
    world.stop(p)


def test_two_rank_job_with_checkpoint_pauses_is_never_paged(world: World) -> None:
    job = f"ckpt-{uuid.uuid4().hex[:6]}"
    port = str(free_port())
    procs = [world.rank("ckpt", job, r, 2, port, str(AFTER / 2)) for r in range(2)]
    for p in procs:
        world.ready(p)
    world.watched(job, 2)
    seen = _never_paged(world, job, 3 * AFTER + 2 * LOOK)
    say("ckpt findings over 3 x after", seen or "none")
    world.stop(*procs)


def test_gpu_spin_hang_is_paged_confirmed_by_the_gpu(world: World) -> None:
    jobs = {mode: f"{mode}-{uuid.uuid4().hex[:6]}" for mode in ("gpu_spin", "gpu_spin_item")}
    procs = {mode: world.rank(mode, job) for mode, job in jobs.items()}
    for p in procs.values():
        world.ready(p)
    t0 = time.monotonic()
    for mode, job in jobs.items():
        f = world.wait(lambda job=job: world.paged(job).get("0"), AFTER + 2 * LOOK + DISCOVERY + 4, f"{mode} paged")
        say(f"{mode} paged after {time.monotonic() - t0:.1f} s", f["explanation"])
        assert f["evidence"]["confirmed_by"] == "gpu_spin", f
        assert "no memory traffic" in f["explanation"]
    world.stop(*procs.values())


def test_deadlock_is_paged(world: World) -> None:
    job = f"dead-{uuid.uuid4().hex[:6]}"
    p = world.rank("deadlock", job)
    world.ready(p)
    t0 = time.monotonic()
    f = world.wait(lambda: world.paged(job).get("0"), AFTER + 2 * LOOK + DISCOVERY + 4, "deadlock paged")
    say(f"deadlock paged after {time.monotonic() - t0:.1f} s", f["explanation"])
    assert "likely deadlock" in f["explanation"]
    world.stop(p)


def test_collective_hang_names_the_odd_one_out(world: World) -> None:
    job = f"coll-{uuid.uuid4().hex[:6]}"
    port = str(free_port())
    procs = [world.rank("data_hang", job, r, 3, port, "0") for r in range(3)]
    for p in procs:
        world.ready(p)
    t0 = time.monotonic()
    every = world.wait(
        lambda: len(world.paged(job)) == 3 and world.paged(job),
        AFTER + 2 * LOOK + DISCOVERY + 6,
        "all three ranks paged",
    )
    for r, f in sorted(every.items()):
        say(f"collective hang rank {r} paged after {time.monotonic() - t0:.1f} s", f["explanation"])
    assert every["2"]["evidence"]["suspect"] and "odd one out" in every["2"]["explanation"]
    assert "load_batch" in every["2"]["explanation"]
    assert "suspect: rank 2" in every["0"]["explanation"] and "collective" in every["0"]["explanation"]
    world.stop(*procs)


def _torchrun(world: World, python: str, job: str, extra_env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    env = world.env(job)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(k)
    env.update(extra_env)
    # static rendezvous: --standalone would replace the run id (the job id) with a random one
    return world.start(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--rdzv-id",
            job,
            *args,
        ],
        env,
    )


def _heartbeat_paged(world: World, job: str, what: str) -> None:
    doc = world.wait(
        lambda: next(
            (json.loads(p.read_text()) for p in world.rank_dir.glob(f"{job}*.json") if "heartbeat" in p.read_text()),
            None,
        ),
        90,
        f"{what}: rank file",
    )
    say(f"{what} rank file", json.dumps(doc))
    f = world.wait(lambda: world.paged(job).get("0"), 60, f"{what}: paged when the steps stop")
    say(f"{what} paged", f"method: {f['evidence']['method']}: {f['explanation']}")
    assert f["evidence"]["method"] == "heartbeat"


def test_torchrun_launcher_shim_heartbeat(world: World) -> None:
    job = f"shim-{uuid.uuid4().hex[:6]}"
    p = _torchrun(world, sys.executable, job, {}, "-m", "gpuwatchd.rank.run", str(HERE / "autobeat_train.py"), "40")
    _heartbeat_paged(world, job, "torchrun -m gpuwatchd.rank.run")
    world.stop(p)


def test_torchrun_with_the_wheels_pth_heartbeat(world: World, tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    (whl,) = (tmp_path / "dist").glob("gpuwatchd-*.whl")
    # A fresh venv with the wheel installed (a pure-Python wheel unpacked into site-packages, as
    # pip does) that sees this interpreter's packages (torch) through a .pth of its own: a venv
    # made from a venv would see the base interpreter's packages, not torch.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    (site_dir,) = (venv / "lib").glob("python3*/site-packages")
    zipfile.ZipFile(whl).extractall(site_dir)
    assert (site_dir / "gpuwatchd-heartbeat.pth").is_file()
    outer = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (site_dir / "zz-outer-site.pth").write_text(f"import site; [site.addsitedir(p) for p in {outer!r}]\n")
    job = f"pth-{uuid.uuid4().hex[:6]}"
    # the rank must import the wheel's gpuwatchd, not this checkout's: no PYTHONPATH to the repo
    p = _torchrun(
        world,
        str(venv / "bin/python"),
        job,
        {"GPUWATCHD_HEARTBEAT": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        str(HERE / "autobeat_train.py"),
        "40",
    )
    _heartbeat_paged(world, job, "GPUWATCHD_HEARTBEAT=1 torchrun (wheel .pth)")
    world.stop(p)
