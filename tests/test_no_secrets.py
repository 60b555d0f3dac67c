"""No output of gpuwatchd ever carries an environment value or a command-line argument.

Two ranks are started with a secret in their argv and in their environment (also as the *value*
of NCCL variables the daemon reads by name, and inherited by a DataLoader-like child); one is
discovered from its environment, one registered with `gpuwatchd register`; one then dies. The
real daemon watches them with discovery on and debug logging. Then every output is searched for
the secret: /metrics, every file in state_dir (events JSONL, state, cursors), `gpuwatchd ps`,
`ps --json`, `events --json`, `doctor PID` (text and JSON), and the daemon's own log."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import DaemonProc, write_config

REPO = Path(__file__).resolve().parent.parent
SECRET = f"gwh7SECRET{secrets.token_hex(8)}"
RANK_CODE = (
    "import os, sys, time\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    time.sleep(300)\n"  # a DataLoader-like worker inheriting argv and environment
    "    os._exit(0)\n"
    "print(child, flush=True)\n"
    "time.sleep(300)\n"
)
WORKERS: list[int] = []


def _start_rank(rank: int, extra_env: dict[str, str]) -> subprocess.Popen[str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "API_TOKEN": SECRET,
        "WANDB_API_KEY": SECRET,
        "NCCL_ASYNC_ERROR_HANDLING": SECRET,  # a legacy name whose *name* is a finding
        "NCCL_BLOCKING_WAIT": SECRET,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        **extra_env,
    }
    p = subprocess.Popen(
        [sys.executable, "-c", RANK_CODE, "--api-key", SECRET, f"--password={SECRET}"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    WORKERS.append(int(p.stdout.readline()))
    return p


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    for pid in WORKERS:  # the forked workers, by the PIDs they reported
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    WORKERS.clear()


def _cli(cfg: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args, "--config.file", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    return out.stdout + out.stderr


def test_no_output_contains_argv_or_environment_values(tmp_path: Path, ranks: list[subprocess.Popen[str]]) -> None:
    discovered = _start_rank(0, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "nosecrets"})
    registered = _start_rank(1, {})
    ranks += [discovered, registered]

    path, cfg = write_config(tmp_path, discovery={"enabled": True, "interval_seconds": 0.5}, log_level="debug")
    reg = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--config.file",
            str(path),
            "--job-id",
            "nosecrets",
            "--rank",
            "1",
            "--pid",
            str(registered.pid),
            "--world-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert reg.returncode == 0, reg.stderr

    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id="nosecrets", rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id="nosecrets", rank="1") == 1.0
            ),
            what="both ranks up",
        )
        d.wait_for(lambda: d.value("gpuwatch_finding", kind="nccl_legacy_env") == 1.0, what="the NCCL finding")
        metrics_alive = d.text()
        registered.kill()
        registered.wait(10)
        d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id="nosecrets", rank="1") == 0.0, what="rank 1 down")
        d.wait_for(lambda: (Path(cfg["state_dir"]) / "events.jsonl").exists(), what="an event")
        metrics_dead = d.text()
        outputs = {
            "/metrics (alive)": metrics_alive,
            "/metrics (after the death)": metrics_dead,
            "ps": _cli(path, "ps"),
            "ps --json": _cli(path, "ps", "--json"),
            "events --json": _cli(path, "events", "--json"),
            "doctor": _cli(path, "doctor", str(discovered.pid)),
            "doctor --json": _cli(path, "doctor", str(discovered.pid), "--json"),
        }
    finally:
        d.stop()
    outputs["daemon log"] = d.log_path.read_text(errors="replace")
    for f in sorted(Path(cfg["state_dir"]).rglob("*")):
        if f.is_file():
            outputs[f"state_dir/{f.name}"] = f.read_bytes().decode("utf-8", "replace")

    # The outputs really describe these ranks (so an empty output cannot pass)...
    assert 'job_id="nosecrets"' in metrics_alive
    assert "nosecrets" in outputs["ps --json"] and str(discovered.pid) in outputs["ps --json"]
    assert "NCCL_ASYNC_ERROR_HANDLING" in outputs["ps --json"] + metrics_alive + outputs["state_dir/state.json"]
    assert 'kind="rank_down"' in metrics_dead and "rank_down" in outputs["state_dir/state.json"]
    assert outputs["state_dir/events.jsonl"].strip() and outputs["events --json"].strip()
    assert str(discovered.pid) in outputs["doctor --json"]
    assert "DEBUG" in outputs["daemon log"]
    # ...and none of them carries the secret.
    leaks = sorted(name for name, text in outputs.items() if SECRET in text)
    assert leaks == [], f"secret found in: {leaks}"
    # Nor the argument names next to it: command lines are not exported at all.
    for name, text in outputs.items():
        assert "--api-key" not in text and "--password" not in text, name
