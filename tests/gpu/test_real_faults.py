"""Real faults on real jobs, on a real GPU, through the real daemon (marker ``gpu``).

Zero integration: every rank is found by discovery (torchrun's variables, no rank file, no
heartbeat). ``stall.after_seconds`` is AFTER (30 s, the issue's measurement); the conclusive
bound is the shipped one.

1. NVIDIA's fault catalog (the eleven faults of nvidia-resiliency-ext's ``inject_fault``), each in
   rank 1 of its own 2-rank torchrun job (tests/gpu/fault_rank.py: a matmul, a backward pass, a
   gloo all_reduce and an SGD step each step). torchrun tears the job down within a second of a
   death. Deaths: rank 1's exit is recorded with its cause within 5 s of the fault and named the
   first to fail; rank 0's exit is said to follow it. Hangs (GPU_SLEEP, GIL, STOP): paged, with
   the cause named, within 60 s of the fault.
2. Healthy framework jobs (a Hugging Face ``Trainer`` and a Lightning ``Trainer``, evaluating and
   checkpointing every few dozen steps, two DataLoader workers) over 3 x AFTER: no page.

Each prints what it saw (``SAW ...``) and the delay from the fault, for docs/runbooks.md's table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import free_port
from gpuworld import HERE, REPO, repo_env, say
from gpuworld import World as DaemonWorld

INTERVAL = 1.0
AFTER = float(os.environ.get("GPUWATCH_TEST_AFTER", "30"))
DISCOVERY = 1.0
CONCLUSIVE_BOUND = 60.0  # fault -> page, for the hangs that leave no doubt
DEATH_BOUND = 5.0  # fault -> the exit recorded with its cause
DEATHS = {  # fault -> what the first exit's cause must say
    "GPU": "exit",
    "ASYNC_EXC": "exit",
    "SIGNAL_EXC": "exit",
    "ABORT": "SIGABRT",
    "SEGFAULT": "SIGSEGV",
    "INT": "SIGINT",
    "KILL": "SIGKILL",
    "TERM": "SIGTERM",
}
HANGS = {"GPU_SLEEP": "GPU", "GIL": "GIL", "STOP": "stopped"}


class World(DaemonWorld):
    def __init__(self, tmp: Path) -> None:
        # debug: the stall tracker's dump pacing per rank, printed for a hang paged late
        super().__init__(
            tmp,
            daemon_args=("--log.level", "debug"),
            interval_seconds=INTERVAL,
            discovery={"enabled": True, "interval_seconds": DISCOVERY},
            stall={"after_seconds": AFTER},
        )

    def torchrun(self, job: str, nproc: int, *args: str) -> subprocess.Popen[str]:
        env = {
            k: v for k, v in repo_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
        }
        # static rendezvous: --standalone would replace the run id (the job id) with a random one
        return self.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(free_port()),
                "--rdzv-id",
                job,
                *args,
            ],
            env,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


class Lines:
    """The launcher's merged output, line by line, with the time each arrived."""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, args=(p,), daemon=True)
        self._t.start()

    def _read(self, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                if prefix in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no {prefix!r} in {timeout:.0f} s: {[x for _, x in self.lines][-40:]}")

    def count(self, word: str) -> int:
        return sum(1 for _, line in list(self.lines) if line.split(":")[-1].strip() == word)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("faults"))
    yield w
    w.close()


def _start_faulted(world: World, fault: str, delay: float = 3.0) -> tuple[str, subprocess.Popen[str], Lines, float]:
    job = f"{fault.lower().replace('_', '')}-{uuid.uuid4().hex[:6]}"
    p = world.torchrun(job, 2, str(HERE / "fault_rank.py"), fault, "--fault-rank", "1", "--delay", str(delay))
    out = Lines(p)
    deadline = time.monotonic() + 180
    # both ranks past their first step, or the fault already injected (rank 0's "ready" may
    # come after rank 1's fault: a device-side assert failed the job before both were counted)
    while out.count("ready") < 2 and not any(x.startswith("fault ") for _, x in list(out.lines)):
        assert time.monotonic() < deadline and p.poll() is None, [x for _, x in out.lines][:80]
        time.sleep(0.1)
    line = out.first("fault ", delay + 30)
    at = float(line.split("fault ")[-1].split()[0])
    return job, p, out, at


def _exit_events(world: World, job: str) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "events",
            "--state-dir",
            world.cfg["state_dir"],
            "--json",
            "--since",
            "all",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    try:
        every = json.loads(out.stdout)
    except ValueError:
        return {}
    return {e["rank"]: e for e in every if e.get("kind") == "rank_exit" and e.get("job_id") == job}


# The causes each fault may end rank 1 with: a device-side assert surfaces as the next CUDA call's
# exception (exit 1), or as an abort where a C++ destructor meets the broken context.
CAUSES = {
    "GPU": {"exit_nonzero", "SIGABRT"},
    "ASYNC_EXC": {"exit_nonzero"},
    "SIGNAL_EXC": {"exit_nonzero"},
    "ABORT": {"SIGABRT"},
    "SEGFAULT": {"SIGSEGV"},
    "INT": {"SIGINT", "exit_nonzero"},
    "KILL": {"SIGKILL"},
    "TERM": {"SIGTERM"},
}


@pytest.mark.parametrize("fault", sorted(CAUSES))
def test_a_death_of_the_catalog_is_named_with_its_cause_and_first(world: World, fault: str) -> None:
    job, p, _out, at = _start_faulted(world, fault)
    got = world.wait(
        lambda: (lambda ev: ev if {"0", "1"} <= set(ev) else None)(_exit_events(world, job)),
        DEATH_BOUND + 10,
        f"{fault}: both ranks' exits recorded",
    )
    seen = time.time()
    one, zero = got["1"], got["0"]
    say(
        f"{fault} rank 1 exit, {one['time'] - at:+.2f} s after the fault (in the event log {seen - at:.1f} s after)",
        one["summary"],
    )
    say(f"{fault} rank 0 exit", zero["summary"])
    assert one["fields"]["cause"] in CAUSES[fault], one
    assert one["fields"]["first_pid"] == one["pid"], (one, zero)
    # rank 0 follows: SIGTERM'd by torchrun, or ended by its own all_reduce error (gloo: "Connection
    # closed by peer") a moment before the launcher's signal; either way after rank 1, and said so
    assert zero["fields"]["first_rank"] == 1 and zero["time"] >= one["time"], zero
    assert one["time"] - at <= DEATH_BOUND
    if fault == "SEGFAULT":  # the kernel's own line, where the daemon can read the kernel log
        if world.d.value("gpuwatch_collector_success", collector="kernel_log") == 1.0:
            assert "segfault at 1" in one["summary"], one
        else:
            say("SEGFAULT kernel line", "no kernel log readable on this machine (a container)")
    world.wait(lambda: p.poll() is not None, 60, f"{fault}: torchrun ended")
    # every finding of the job from now until the launcher's grace (rank_down's 10 s) has passed:
    # a page raised for a cycle and gone is a page all the same
    seen_kinds: set[tuple[str, str]] = set()
    end = time.monotonic() + 12.0
    while time.monotonic() < end:
        seen_kinds |= {(f["kind"], f["severity"]) for f in world.findings(job)}
        time.sleep(INTERVAL / 2)
    kinds = sorted(seen_kinds)
    say(f"{fault} findings", kinds or "none")
    # docs/runbooks.md#rank-exits: SIGKILL with no OOM killer pages; a stop (SIGTERM, SIGINT) the
    # launcher answered by ending the job says nothing; its own code crashing it is one warning
    if one["fields"]["cause"] == "SIGKILL":
        expected = {("rank_down", "page")}
    elif one["fields"]["cause"] in ("SIGTERM", "SIGINT"):
        expected = set()
    else:
        expected = {("job_crashed", "warning")}
    assert seen_kinds == expected, kinds


@pytest.mark.parametrize("fault", sorted(HANGS))
def test_a_conclusive_hang_of_the_catalog_is_paged_within_a_minute(world: World, fault: str) -> None:
    job, p, _out, at = _start_faulted(world, fault)
    try:
        f = world.wait(
            lambda: next((f for f in world.findings(job) if f["kind"] == "rank_stalled" and f["rank"] == "1"), None),
            CONCLUSIVE_BOUND + 15,
            f"{fault}: rank 1 paged",
        )
    except AssertionError:  # how the dumps were paced since the fault: what made it late
        print("\n".join(line for line in world.d.log().splitlines() if "stall pacing" in line)[-8000:])
        raise
    delay = time.time() - at
    say(f"{fault} paged {delay:.1f} s after the fault", f["explanation"])
    peers = [g for g in world.findings(job) if g["kind"] == "rank_stalled" and g["rank"] == "0"]
    say(f"{fault} rank 0", peers[0]["explanation"] if peers else "not paged")
    world.stop(p)
    # how the dumps were paced since the fault, every time (a page in time can be one dump
    # interval from late): each line where the next dump moved later (a dump, or a look that
    # found work) and the line before it
    m = re.search(r"\(pid (\d+)\)", f["explanation"])
    say(f"{fault} dump pacing", "\n".join(_pacing_turns(world.d.log(), m.group(1) if m else None)))
    # held still for the conclusive bound, and what was still missing at each cycle until the page
    held = [
        x
        for x in world.d.log().splitlines()
        if ("stall held" in x or "stall excused" in x) and (not m or f"pid {m.group(1)} " in x)
    ]
    say(f"{fault} held or excused", "\n".join(held[:3] + (["..."] if len(held) > 6 else []) + held[3:][-3:]))
    assert delay <= CONCLUSIVE_BOUND, delay


def _pacing_turns(log: str, pid: str | None) -> list[str]:
    """The daemon's "stall pacing" lines of ``pid`` where the next dump moved later, each with
    the line before it."""
    lines = [x for x in log.splitlines() if "stall pacing" in x and (pid is None or f"pid {pid} " in x)]
    due = [float(m.group(1)) if (m := re.search(r"due in (-?[\d.]+) s", x)) else 0.0 for x in lines]
    keep: list[str] = []
    for i in range(1, len(lines)):
        if due[i] > due[i - 1] + 0.5:
            keep += [lines[i - 1], lines[i]]
    return keep[-40:]


def _healthy(world: World, name: str, script: str, *args: str) -> None:
    job = f"{name}-{uuid.uuid4().hex[:6]}"
    p = world.torchrun(job, 1, str(HERE / script), "--out", str(world.tmp / job), *args)
    out = Lines(p)
    out.first("ready", 240)
    t0 = time.monotonic()
    seen: list[str] = []
    while time.monotonic() - t0 < 3 * AFTER + 10:
        assert p.poll() is None, [x for _, x in out.lines][-40:]
        now = world.findings(job)
        assert not [f for f in now if f["severity"] == "page"], now
        seen += [f"{f['kind']} rank {f['rank']}" for f in now if f"{f['kind']} rank {f['rank']}" not in seen]
        time.sleep(INTERVAL)
    ckpts = sorted(x.name for x in (world.tmp / job).rglob("*") if "checkpoint" in x.name or x.suffix == ".ckpt")
    say(f"{name} over 3 x after ({3 * AFTER:.0f} s), checkpoints {len(ckpts)}", seen or "no finding")
    assert ckpts, "the job never checkpointed: the test did not test the pause"
    world.stop(p)


def test_a_healthy_hf_trainer_job_is_never_paged(world: World) -> None:
    _healthy(world, "hf", "hf_trainer_job.py", "--every", "40")


def test_a_healthy_lightning_job_is_never_paged(world: World) -> None:
    _healthy(world, "lightning", "lightning_job.py", "--every", "50")
