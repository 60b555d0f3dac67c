"""`gpuwatchd doctor PID` on real processes: threads, fds vs limit, Python stack with the GIL
owner, NCCL environment, fork checks (a real fork inheriting a stand-in device fd), daemon state."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml

from gpuwatchd.cli import doctor
from gpuwatchd.config.schema import Config
from gpuwatchd.paths import HostPaths

PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
SECRET = "s3cr3t-token-value-never-printed"


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def test_doctor_on_a_gil_bound_misconfigured_rank(tmp_path: Path, procs: list) -> None:
    prog = tmp_path / "leaky.py"
    prog.write_text(
        textwrap.dedent(f"""
        import os, runpy, sys
        held = [open(os.devnull) for _ in range(58)]   # close to the soft limit of 64
        sys.argv = ["cpu4.py"]
        runpy.run_path({str(PROGRAMS / "cpu4.py")!r}, run_name="__main__")
    """)
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "WANDB_API_KEY": SECRET,
    }
    p = subprocess.Popen(
        [sys.executable, str(prog)], stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_low_fd_limit
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    r = doctor.collect(p.pid, Config())
    assert r["state"] in ("S", "R") and r["fds"]["soft_limit"] == 64
    assert r["fds"]["open"] >= 58 and r["fds"]["ratio"] >= 0.9
    names = {t["python_thread"] for t in r["threads"]}
    py_names = {t["name"] for t in r["python"]["threads"]}
    assert py_names >= {"MainThread", "cpu-0", "cpu-1", "cpu-2", "cpu-3"}
    if sys.version_info >= (3, 11):
        # OS thread <-> Python thread needs PyThreadState.native_thread_id (3.11+); on 3.10 py-spy
        # --nonblocking reports os_thread_id null (py-spy issue #567), so the join is not possible
        assert names >= py_names
    assert {t["tid"] for t in r["threads"]} == {int(t) for t in os.listdir(f"/proc/{p.pid}/task")}
    assert sum(t["owns_gil"] for t in r["threads"]) <= 1
    cpu0 = next(t for t in r["python"]["threads"] if t["name"] == "cpu-0")
    assert cpu0["frames"][0].startswith("burn (cpu4.py:")
    nccl = {c["variable"]: c["verdict"] for c in r["nccl"]}
    assert nccl["TORCH_NCCL_ASYNC_ERROR_HANDLING"].startswith("0: no error handling")
    assert "legacy name" in nccl["NCCL_ASYNC_ERROR_HANDLING"]
    kinds = {f["kind"] for f in r["findings"]}
    assert kinds >= {"fd_exhaustion", "nccl_legacy_env", "nccl_error_handling_off"}
    text = doctor.render(r)
    assert "GIL owner:" in text and "THREADS (5)" in text and "fd_exhaustion" in text
    assert SECRET not in text and SECRET not in json.dumps(r)


def test_doctor_sees_a_fork_that_inherited_the_device_fd(tmp_path: Path, procs: list) -> None:
    """A real fork after opening a stand-in for /dev/nvidiactl (HostPaths.devfs = tmp_path)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").write_text("")
    prog = tmp_path / "forker.py"
    prog.write_text(
        textwrap.dedent(f"""
        import os, time
        ctl = open({str(dev / "nvidiactl")!r})          # what a CUDA context keeps open
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        print("ready", flush=True)
        time.sleep(60)
    """)
    )
    p = subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    procs.append(p)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        r = doctor.collect(p.pid, Config(), paths=HostPaths(devfs=str(dev)))
        assert r["fork"]["holds_cuda_context"]
        assert len(r["fork"]["children"]) == 1
        assert r["fork"]["forked_after_cuda"] == r["fork"]["children"]
        assert "fork_after_cuda" in {f["kind"] for f in r["findings"]}
        # with the real /dev the same process holds no NVIDIA device: no fork finding
        r2 = doctor.collect(p.pid, Config())
        assert not r2["fork"]["holds_cuda_context"] and r2["fork"]["forked_after_cuda"] == []
    finally:
        os.killpg(p.pid, signal.SIGKILL)


def test_doctor_cli_with_daemon_state(tmp_path: Path, procs: list) -> None:
    p = subprocess.Popen([sys.executable, str(PROGRAMS / "io4.py")], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state = {
        "timestamp": time.time(),
        "ranks": [
            {
                "job_id": "llm-7",
                "rank": 3,
                "pid": p.pid,
                "tree": [p.pid],
                "alive": True,
                "stalled": True,
                "progress_timestamp": time.time() - 400,
            }
        ],
        "gpus": [{"index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H200"}],
        "gpu_processes": [{"gpu_index": 0, "uuid": "GPU-aaaa", "pid": p.pid, "used_memory_bytes": 55 << 30}],
        "findings": [
            {
                "kind": "rank_stalled",
                "severity": "page",
                "job_id": "llm-7",
                "rank": "3",
                "pid": str(p.pid),
                "explanation": "rank 3 of job llm-7 made no progress",
            }
        ],
        "counters": {
            "rank_gil_samples": [{"labels": ["llm-7", "3"], "value": 200.0}],
            "rank_gil_held_samples": [{"labels": ["llm-7", "3"], "value": 10.0}],
        },
    }
    (state_dir / "state.json").write_text(json.dumps(state))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(state_dir), "interval_seconds": 5}))
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "doctor", "--config.file", str(cfg), str(p.pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "rank 3 of job llm-7 (STALLED)" in out.stdout
    assert "GPU memory: GPU 0 55.0 GiB" in out.stdout
    assert "GIL held 5% of 200 sampled ticks" in out.stdout
    assert "[page] rank_stalled: rank 3 of job llm-7 made no progress" in out.stdout
    assert "Thread " in out.stdout and '"lock"' in out.stdout
    js = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "doctor", "--config.file", str(cfg), "--json", str(p.pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    data = json.loads(js.stdout)
    assert data["rank"]["job_id"] == "llm-7" and data["gpu_memory"][0]["used_memory_bytes"] == 55 << 30
    assert data["python"]["gil_owner"] is None  # every thread is blocked
    gone = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "doctor", "--config.file", str(cfg), "999999999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # a PID that names nothing is the user's mistake: exit 2, one line on stderr (docs/cli.md)
    assert gone.returncode == 2 and gone.stdout == ""
    assert gone.stderr.splitlines()[-1] == "gpuwatchd doctor: no process 999999999"
    assert "Traceback" not in gone.stderr


def test_doctor_without_pyspy_still_reports_the_rest(procs: list) -> None:
    p = subprocess.Popen([sys.executable, str(PROGRAMS / "io4.py")], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    from gpuwatchd.config.schema import GilConfig

    r = doctor.collect(p.pid, Config(gil=GilConfig(pyspy_path="/nonexistent/py-spy")))
    assert "absent" in r["python"]["error"]
    assert len(r["threads"]) == 5 and all(t["python_thread"] is None for t in r["threads"])
    assert "unavailable: absent" in doctor.render(r)


def test_doctor_reads_gpu_memory_from_nvml_when_no_daemon_runs(procs: list) -> None:
    """No daemon state: one NVML reading, here the replay recorded on the H200 with the recorded
    DataLoader parent (pid 453, 6008340480 bytes) mapped onto a real local process."""
    from gpuwatchd.sources.nvml_fixture import RecordedNvml

    p = subprocess.Popen([sys.executable, str(PROGRAMS / "io4.py")], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    fixture = Path(__file__).parent / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
    replay = RecordedNvml.from_file(str(fixture), pid_map={453: p.pid})
    r = doctor.collect(p.pid, Config(), nvml=replay)
    assert r["gpu_memory_source"] == "NVML now"
    assert r["gpu_memory"] == [{"gpu": 0, "uuid": r["gpu_memory"][0]["uuid"], "used_memory_bytes": 6008340480}]
    assert "GPU memory: GPU 0 5.6 GiB (NVML now)" in doctor.render(r)
    # this host has no NVIDIA driver: said so, nothing else changes
    r = doctor.collect(p.pid, Config())
    assert r["gpu_memory"] is None and "no NVIDIA driver" in r["gpu_memory_source"]
