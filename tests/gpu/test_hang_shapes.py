"""Hang shapes on a real GPU, explained by the real daemon (marker ``gpu``; issue 15).

One daemon (``python -m gpuwatchd run``: py-spy stall dumps, NVML, rank files, flight recorder)
watches ranks started by hang_shape_rank.py, one shape after another (GPU utilisation is
device-wide, so the busy shapes run last, together):

1. seed 003 on a GPU: 2 GiB held, two threads deadlocked: "likely deadlock" naming both threads,
   "GPU 0 idle, 2.0 GiB held";
2. two gloo ranks, rank 1 stops before collective #5: the explanation says, from the flight
   recorder, that rank 1 never entered collective #5, within one daemon cycle of the dump;
3. synchronize() behind a stream waiting for a value nobody writes: waiting on an idle GPU;
4. synchronize() and .item() behind a long kernel: waiting on the GPU, "GPU 0 100 % busy";
5. torch.compile of a small model: ``rank_compiling`` while it compiles, never ``rank_stalled``.

Each prints its explanation verbatim (``EXPLANATION ...``). With ``GW_OUT`` set, each rank's
``py-spy dump --json`` and the flight-recorder answers are copied there (the recorded fixtures of
tests/test_hang_fixtures.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import free_port
from gpuworld import HERE, repo_env
from gpuworld import World as DaemonWorld

INTERVAL = 0.5
AFTER = 1.5
SLACK = 0.5
OUT = Path(os.environ["GW_OUT"]) if os.environ.get("GW_OUT") else None


class World(DaemonWorld):
    ready_timeout = 90.0

    def __init__(self, tmp: Path, after: float = AFTER) -> None:
        super().__init__(
            tmp,
            poll=0.05,
            interval_seconds=INTERVAL,
            stall={"after_seconds": after, "compile_after_seconds": 600, "flight_recorder_interval_seconds": 30},
        )

    def rank(
        self, mode: str, job: str, rank: int = 0, *extra: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        return self.start(
            [sys.executable, str(HERE / "hang_shape_rank.py"), mode, str(self.rank_dir), job, str(rank), *extra],
            repo_env(**(env or {})),
        )

    def finding(self, job: str, rank: int, kind: str, text: str = "") -> str:
        return next(
            (
                f["explanation"]
                for f in self.findings(job)
                if f["rank"] == str(rank) and f["kind"] == kind and text in f["explanation"]
            ),
            "",
        )

    def record(self, name: str, pid: int) -> None:
        if OUT is None:
            return
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        out = subprocess.run(
            [spy, "dump", "--json", "--nonblocking", "-p", str(pid)], capture_output=True, text=True, timeout=30
        )
        (OUT / f"dump_{name}.json").write_text(out.stdout)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("hangs"))
    yield w
    w.close()


def say(what: str, text: str) -> None:
    print(f"EXPLANATION {what}: {text}", flush=True)
    if OUT is not None:
        with open(OUT / "explanations.txt", "a") as f:
            f.write(f"{what}: {text}\n")


def test_deadlock_on_an_idle_gpu_with_memory_held(world: World) -> None:
    p = world.rank("deadlock_gpu", "seed3")
    world.ready(p)
    text = world.wait(lambda: world.finding("seed3", 0, "rank_stalled", "likely deadlock"), 30, "deadlock explained")
    world.record("deadlock_gpu", p.pid)
    say("deadlock_gpu", text)
    assert '"loader" in loader (hang_shape_rank.py:' in text
    assert '"writer" in writer (hang_shape_rank.py:' in text
    assert "likely deadlock: 2 threads blocked acquiring locks" in text
    assert "GPU 0 idle, " in text and " GiB held" in text  # 2 GiB tensor + the CUDA context
    p.kill()


def test_gloo_rank_that_never_entered_collective_5(world: World) -> None:
    port = str(free_port())
    env = {"TORCH_FR_BUFFER_SIZE": "2000"}
    r0 = world.rank("gloo", "fr-job", 0, port, env=env)
    r1 = world.rank("gloo", "fr-job", 1, port, env=env)
    world.ready(r0)
    world.ready(r1)
    text = world.wait(
        lambda: world.finding("fr-job", 0, "rank_stalled", "flight recorder"),
        60,
        "flight recorder in rank 0's explanation",
    )
    seen = time.time()
    dumps = [world.rank_dir / f"fr-job.{r}.fr" for r in (0, 1)]
    dumped = max(os.stat(d).st_mtime for d in dumps)
    say("gloo", text)
    print(
        f"PASS flight recorder: dumps written {dumped:.3f}, explanation {seen - dumped:.2f} s "
        f"later (cycle {INTERVAL} s)",
        flush=True,
    )
    world.record("gloo_rank0", r0.pid)
    world.record("gloo_rank1", r1.pid)
    if OUT is not None:
        for r, d in enumerate(dumps):
            shutil.copy(d, OUT / f"fr_gloo_rank{r}.json")
        (OUT / "metrics_gloo.txt").write_text(world.d.text())
    seqs = [max(e["collective_seq_id"] for e in json.loads(d.read_text())["trace"]["entries"]) for d in dumps]
    print(f"flight recorder: last collective entered: rank 0 #{seqs[0]}, rank 1 #{seqs[1]}")
    assert seqs[0] == seqs[1] + 1, seqs
    assert f"rank 1 never entered collective #{seqs[0]} (gloo:all_reduce) of process group 0" in text
    assert seen - dumped <= INTERVAL + SLACK + 0.1  # polled every 50 ms
    for r in (0, 1):
        assert world.d.value("gpuwatch_rank_collective_last_started_seq", job_id="fr-job", rank=str(r)) == float(
            seqs[r]
        )
    r0.kill()
    r1.kill()


def test_waiting_on_an_idle_gpu(world: World) -> None:
    p = world.rank("idle_wait", "idle")
    world.ready(p)
    text = world.wait(lambda: world.finding("idle", 0, "rank_stalled", "GPU"), 30, "idle wait")
    time.sleep(2 * INTERVAL)  # one more cycle: CPU shares over a full window
    text = world.finding("idle", 0, "rank_stalled") or text
    world.record("idle_wait", p.pid)
    say("idle_wait", text)
    assert "the GPU is idle" in text and "GPU 0 idle" in text
    p.kill()


def test_waiting_on_a_busy_gpu(world: World) -> None:
    sync = world.rank("sync_busy", "busy")
    item = world.rank("item_busy", "busy-item")
    world.ready(sync)
    world.ready(item)
    t1 = world.wait(lambda: world.finding("busy", 0, "rank_stalled", "busy"), 30, "sync busy")
    t2 = world.wait(lambda: world.finding("busy-item", 0, "rank_stalled", "busy"), 30, "item busy")
    time.sleep(2 * INTERVAL)
    t1 = world.finding("busy", 0, "rank_stalled") or t1
    t2 = world.finding("busy-item", 0, "rank_stalled") or t2
    world.record("sync_busy", sync.pid)
    world.record("item_busy", item.pid)
    say("sync_busy", t1)
    say("item_busy", t2)
    assert "waiting on the GPU" in t1 and "synchronize (torch/cuda/__init__.py:" in t1
    assert "GPU 0 100 % busy" in t1 and "the GPU is busy" in t1
    assert "the GPU is busy" in t2 and "native code without the GIL" in t2


def test_compiling_rank_is_not_paged(tmp_path: Path) -> None:
    # its own daemon with a longer bound: a rank is looked at from half the bound on, and the
    # compiler's CPU moves between the rank and short-lived children (g++, Triton workers), so
    # the looks before the bound must see it busy (bench/results/hang_compile_cpu.txt)
    world = World(tmp_path, after=4.0)
    try:
        _compile(world)
    finally:
        world.close()


def _compile(world: World) -> None:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(world.tmp / "inductor-cache")}
    p = world.rank("compile", "comp", env=env)
    world.ready(p)
    kinds: set[str] = set()
    compiling = ""
    assert p.stdout is not None
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout or ()), daemon=True).start()
    started = time.monotonic()
    out = ""
    while "step 6" not in out:
        assert time.monotonic() - started < 150, (kinds, out, world.d.log()[-3000:])
        out = "".join(lines)
        for f in world.findings("comp"):
            kinds.add(f["kind"])
            if f["kind"] == "rank_compiling" and not compiling:
                compiling = f["explanation"]
                world.record("compile", p.pid)
        time.sleep(0.05)
    took = time.monotonic() - started
    say("compile", compiling)
    print(f"PASS compile: {took:.1f} s until training resumed; findings seen: {sorted(kinds)}")
    assert "rank_compiling" in kinds and "rank_stalled" not in kinds, kinds
    assert "still compiling, not hung" in compiling
    p.kill()
