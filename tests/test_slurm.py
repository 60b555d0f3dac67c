"""deploy/slurm/*.sh run the way slurmd and slurmstepd run them: no PATH, the SLURM_* variables of
the hook, a real task process, the real gpuwatchd CLI (NVML from recorded H200 readings)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.sources.rankfiles import RankFileReader

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "deploy" / "slurm"
GW = str(Path(sys.executable).parent / "gpuwatchd")  # the venv running the tests
NVML = ROOT / "tests" / "fixtures" / "nvml"


def _hook(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # slurmd/slurmstepd give hooks no PATH (prolog_epilog.html): the scripts must set their own.
    return subprocess.run(["/bin/bash", str(SLURM / script)], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[dict[str, object]]:
    rank_dir = tmp_path / "ranks"
    rank_dir.mkdir()
    rank_dir.chmod(0o1777)
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield {"rank_dir": rank_dir, "task": task, "tmp": tmp_path}
    task.kill()
    task.wait()


def _config(tmp: Path, rank_dir: Path, fixture: str) -> str:
    cfg = tmp / f"config-{fixture}.yaml"
    cfg.write_text(f"rank_dir: {rank_dir}\nnvml:\n  fixture: {NVML / fixture}\n")
    return str(cfg)


def _task_env(node: dict[str, object], **extra: str) -> dict[str, str]:
    task = node["task"]
    assert isinstance(task, subprocess.Popen)
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_GPUS": "0,1",
        "SLURM_TASK_PID": str(task.pid),
        "GPUWATCHD": GW,
        "GPUWATCHD_CONFIG": _config(Path(str(node["tmp"])), Path(str(node["rank_dir"])), "h200_idle.json"),
    }
    env.update(extra)
    return env


def test_task_prolog_registers_and_task_epilog_unregisters(node: dict[str, object]) -> None:
    rank_dir = Path(str(node["rank_dir"]))
    out = _hook("task_prolog.sh", _task_env(node))
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""  # Slurm reads a TaskProlog's stdout as export/unset/print commands
    assert sorted(p.name for p in rank_dir.iterdir()) == ["77.0.3.json"]
    entries, bad = RankFileReader(str(rank_dir)).scan()
    assert bad == []
    [entry] = entries
    task = node["task"]
    assert isinstance(task, subprocess.Popen)
    assert (entry.job_id, entry.rank, entry.pid, entry.local_rank, entry.world_size) == ("77.0", 3, task.pid, 1, 8)
    assert entry.gpus == ("0", "1")
    assert entry.start_ticks is not None  # guards against PID reuse

    out = _hook("task_epilog.sh", _task_env(node))
    assert out.returncode == 0 and out.stdout == ""
    assert list(rank_dir.iterdir()) == []


def test_task_prolog_never_fails_the_task(node: dict[str, object]) -> None:
    rank_dir = Path(str(node["rank_dir"]))
    opted_out = _hook("task_prolog.sh", _task_env(node, GPUWATCHD_SLURM_REGISTER="0"))
    assert opted_out.returncode == 0 and list(rank_dir.iterdir()) == []
    missing = _hook("task_prolog.sh", _task_env(node, GPUWATCHD="/nonexistent/gpuwatchd"))
    assert missing.returncode == 0 and missing.stdout == ""
    bad = _hook("task_prolog.sh", _task_env(node, SLURM_JOB_ID="77/../../etc"))
    assert bad.returncode == 0 and bad.stdout == ""
    assert "register failed" in bad.stderr
    assert list(rank_dir.iterdir()) == []


def test_epilog_sweeps_only_this_jobs_leftovers(node: dict[str, object]) -> None:
    rank_dir = Path(str(node["rank_dir"]))
    for name in ("77.0.3.json", "77.1.0.json", "77.0.3.hb", "770.0.0.json", "8.0.0.json", "other-job.json"):
        (rank_dir / name).write_text("{}")
    target = node["tmp"]
    assert isinstance(target, Path)
    (target / "precious").write_text("keep")
    (rank_dir / "77.9.9.json").symlink_to(target / "precious")
    out = _hook("epilog.sh", {"SLURM_JOB_ID": "77", "GPUWATCHD_RANK_DIR": str(rank_dir)})
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in rank_dir.iterdir()) == ["77.9.9.json", "770.0.0.json", "8.0.0.json", "other-job.json"]
    assert (target / "precious").read_text() == "keep"
    assert _hook("epilog.sh", {"SLURM_JOB_ID": "*", "GPUWATCHD_RANK_DIR": str(rank_dir)}).returncode == 0
    assert len(list(rank_dir.iterdir())) == 4


def _prolog_env(node: dict[str, object], fixture: str, **extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "78",
        "SLURM_JOB_GPUS": "0",
        "GPUWATCHD": GW,
        "GPUWATCHD_CONFIG": _config(Path(str(node["tmp"])), Path(str(node["rank_dir"])), fixture),
    }
    env.update(extra)
    return env


def test_prolog_accepts_a_clean_node(node: dict[str, object]) -> None:
    out = _hook("prolog.sh", _prolog_env(node, "h200_idle.json"))
    assert out.returncode == 0, out.stderr


def test_prolog_refuses_a_node_whose_gpu_holds_stale_memory(node: dict[str, object]) -> None:
    # Recorded on an H200: processes of a killed launch still hold 9.4 GiB; none is a live rank.
    out = _hook("prolog.sh", _prolog_env(node, "h200_orphan_dataloader.json"))
    assert out.returncode == 1
    assert "refusing node" in out.stderr and "stale GPU memory on GPU(s) 0" in out.stderr
    assert "5.60 GiB" in out.stderr  # the check's table names what holds the memory


def test_prolog_without_gpus_checks_nothing(node: dict[str, object]) -> None:
    env = _prolog_env(node, "h200_orphan_dataloader.json")
    del env["SLURM_JOB_GPUS"]
    assert _hook("prolog.sh", env).returncode == 0


def test_prolog_when_the_check_cannot_run(node: dict[str, object]) -> None:
    absent = _hook("prolog.sh", _prolog_env(node, "not_present.json"))
    assert absent.returncode == 1 and "check failed (exit 3)" in absent.stderr  # NVML unreadable: docs/cli.md
    assert _hook("prolog.sh", _prolog_env(node, "not_present.json", GPUWATCHD_FAIL_OPEN="1")).returncode == 0
    env = _prolog_env(node, "h200_idle.json", GPUWATCHD="/nonexistent/gpuwatchd")
    missing = _hook("prolog.sh", env)
    assert missing.returncode == 1 and "not installed" in missing.stderr
    env["GPUWATCHD_FAIL_OPEN"] = "1"
    assert _hook("prolog.sh", env).returncode == 0


def test_scripts_are_executable_and_parse() -> None:
    for script in ("prolog.sh", "epilog.sh", "task_prolog.sh", "task_epilog.sh"):
        path = SLURM / script
        assert os.access(path, os.X_OK), script
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
    readme = (SLURM / "README.md").read_text()
    for script in ("prolog.sh", "epilog.sh", "task_prolog.sh", "task_epilog.sh"):
        assert script in readme


def test_task_prolog_turns_on_torchs_dump_pipe_for_a_job_that_opts_in(node: dict[str, object]) -> None:
    """GPUWATCHD_FR_PIPE=1: export lines for torch's dump pipe into a directory private to the
    task; the TaskEpilog removes it. A base directory another user made first turns it off."""
    tmp = Path(str(node["tmp"]))
    out = _hook("task_prolog.sh", _task_env(node, GPUWATCHD_FR_PIPE="1", TMPDIR=str(tmp)))
    d = tmp / f"gpuwatch-fr-{os.getuid()}" / "77.0.3"
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"export TORCH_FR_DEBUG_INFO_PIPE_FILE={d}/pipe_",
        f"export TORCH_NCCL_DEBUG_INFO_PIPE_FILE={d}/pipe_",
        "export TORCH_FR_BUFFER_SIZE=2000",
        f"export TORCH_FR_DUMP_TEMP_FILE={d}/trace_",
    ]
    assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700
    own = _hook(
        "task_prolog.sh",
        _task_env(node, GPUWATCHD_FR_PIPE="1", TMPDIR=str(tmp), TORCH_NCCL_DEBUG_INFO_PIPE_FILE="/mine/p_"),
    )
    assert own.stdout == ""  # the job's own setting wins
    assert _hook("task_epilog.sh", _task_env(node, GPUWATCHD_FR_PIPE="1", TMPDIR=str(tmp))).returncode == 0
    assert not d.exists()

    theirs = tmp / "other"
    theirs.mkdir()
    (theirs / f"gpuwatch-fr-{os.getuid()}").mkdir()
    os.chown(theirs / f"gpuwatch-fr-{os.getuid()}", 65534, 65534)
    squatted = _hook("task_prolog.sh", _task_env(node, GPUWATCHD_FR_PIPE="1", TMPDIR=str(theirs)))
    assert squatted.returncode == 0 and squatted.stdout == ""
