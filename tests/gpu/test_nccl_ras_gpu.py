"""NCCL's own view of a real job (marker gpu): its RAS port and torch's flight-recorder pipe.

A world-size-1 torchrun job trains on cuda:0 with the NCCL backend (tests/gpu/ras_train.py), with
``NCCL_RAS_ADDR`` on a free loopback port and torch's dump pipe turned on through its environment
(``TORCH_FR_DEBUG_INFO_PIPE_FILE`` and its old name, a trace buffer, ``TORCH_FR_DUMP_TEMP_FILE``), as the shipped
Slurm TaskProlog sets them for a job that opts in. The real daemon watches (interval 0.5 s,
``stall.after_seconds`` 2 s, RAS every 1 s, the flight recorder every 5 s).

1. NCCL is 2.28 or later (RAS answers JSON from 2.28 on: tests/fixtures/nccl_ras/README.md).
2. The job stops calling ``heartbeat()`` but keeps training: gpuwatchd finds it stalled, asks
   its RAS port, joins the answer to rank 0 by PID, and ``gpuwatchd ps --json`` shows the
   rank's op counts (``nccl_ras[].ops``) grow from one answer to the next; the moving counts
   keep the rank from being stalled (``gpuwatch_rank_stalled`` 0, no ``rank_stalled`` finding).
3. Through the pipe: the daemon writes to the rank's FIFO, reads the pickled dump, and the
   rank's collective series appears (``gpuwatch_rank_collective_last_started_seq``); the job's
   step counter keeps growing after the dump (training goes on).
4. The job stops issuing collectives (sleeps in Python): the counts stop
   (``gpuwatch_nccl_ras_rank_operations_unchanged_seconds`` grows past 2 s) and ``rank_stalled``
   is raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import DaemonProc, free_port, write_config  # noqa: E402


def wait_until(pred: Callable[[], bool], timeout: float, what: str, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{log()}")


def ps_json(cfg_path: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "gpuwatchd", "ps", "--json", "--config.file", str(cfg_path)],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return dict(json.loads(out.stdout))


def ras_ops(cfg_path: Path, job_id: str) -> list[tuple[int, float]]:
    """(ops, asked_at) of rank 0 as ``gpuwatchd ps --json`` shows it."""
    return [(r["ops"], r["asked_at"]) for r in ps_json(cfg_path).get("nccl_ras", [])
            if r["job_id"] == job_id and r["rank"] == 0]


def stalled(d: DaemonProc, job_id: str) -> bool:
    """The page's gauge and the finding agree that rank 0 is stalled."""
    return d.value("gpuwatch_finding", kind="rank_stalled", job_id=job_id, rank="0") == 1.0 and \
        d.value("gpuwatch_rank_stalled", job_id=job_id, rank="0") == 1.0


def test_nccl_ras_counts_and_the_dump_pipe_on_a_real_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "fr").mkdir()
    cfg_path, cfg = write_config(tmp_path, interval_seconds=0.5, nvml={"enabled": True}, stall={
        "after_seconds": 2.0, "nccl_ras_interval_seconds": 1.0, "flight_recorder_interval_seconds": 5.0})
    job_id = f"ras{os.getpid()}"
    env = {**os.environ, "GPUWATCH_RANK_DIR": cfg["rank_dir"],
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1",
           "NCCL_RAS_ADDR": f"127.0.0.1:{free_port()}",
           "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/fr/pipe_",
           "TORCH_FR_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/fr/pipe_",
           "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
           "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr/trace_",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/fr/trace_"}
    d = DaemonProc(cfg_path, cfg)
    log_path = tmp_path / "job.log"
    with open(log_path, "wb") as f:
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             "--max-restarts", "0", str(HERE / "ras_train.py"), "--out", str(out), "--job-id", job_id],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path), start_new_session=True)

    def log() -> str:
        return (f"job log:\n{log_path.read_text(errors='replace')[-4000:]}\n"
                f"daemon log:\n{d.log()[-4000:]}")

    def steps() -> int:
        try:
            return int((out / "step").read_text())
        except (OSError, ValueError):
            return -1

    try:
        wait_until(lambda: steps() >= 5 and d.value("gpuwatch_rank_up", job_id=job_id, rank="0") == 1.0,
                   180, "the job training and its rank up", log)
        version = tuple(int(x) for x in (out / "nccl").read_text().split("."))
        assert version >= (2, 28), f"NCCL {version}: RAS answers JSON from 2.28 on"
        assert not ras_ops(cfg_path, job_id)  # a healthy job's RAS port is never asked

        (out / "quiet").touch()  # no heartbeat: stalled to gpuwatchd, while NCCL's counts move
        seen: list[tuple[int, float]] = []

        def counts_move() -> bool:
            now = ras_ops(cfg_path, job_id)
            if now and (not seen or now[0][1] != seen[-1][1]):
                seen.append(now[0])
            return len(seen) >= 3 and seen[-1][0] > seen[-2][0] > seen[0][0]

        wait_until(counts_move, 60, "RAS op counts that grow in gpuwatchd ps --json", log)
        assert d.value("gpuwatch_rank_stalled", job_id=job_id, rank="0") == 0.0, \
            "moving RAS counts must keep the rank from being stalled (the page's gauge)"
        assert d.value("gpuwatch_finding", kind="rank_stalled", job_id=job_id, rank="0") is None

        wait_until(lambda: (d.value("gpuwatch_rank_collective_last_started_seq", job_id=job_id,
                                    rank="0", pg="0") or 0) > 0, 60,
                   "the flight-recorder dump read through torch's pipe", log)
        at_dump = steps()
        wait_until(lambda: steps() >= at_dump + 10, 30, "training going on after the dump", log)

        (out / "hang").touch()  # no more collectives
        wait_until(lambda: (d.value("gpuwatch_nccl_ras_rank_operations_unchanged_seconds",
                                    job_id=job_id, rank="0") or 0) >= 2.0 and stalled(d, job_id),
                   60, "RAS counts that stop, and rank_stalled", log)
        ops = ras_ops(cfg_path, job_id)
        time.sleep(2.5)
        assert ras_ops(cfg_path, job_id)[0][0] == ops[0][0]
        assert agent.poll() is None, log()
        assert "Traceback" not in d.log()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(30)
        assert d.stop() == 0, d.log()
