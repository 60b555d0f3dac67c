"""NCCL's own view of a real job (marker gpu): its RAS port and torch's flight-recorder pipe.

A torchrun job trains on cuda:0 with the NCCL backend (tests/gpu/ras_train.py), with
``NCCL_RAS_ADDR`` on a free loopback port and torch's dump pipe turned on through its environment
(``TORCH_FR_DEBUG_INFO_PIPE_FILE`` and its old name, a trace buffer, ``TORCH_FR_DUMP_TEMP_FILE``), as the shipped
Slurm TaskProlog sets them for a job that opts in. The real daemon watches (interval 0.5 s,
``stall.after_seconds`` 2 s, RAS every 1 s, the flight recorder every 5 s), logging at debug.

Two worlds, each its own test:

- ``one_rank``: world size 1. NCCL copies a one-rank collective locally (``ncclLaunchOneRank``,
  src/enqueue.cc) with no kernel plan, and only a plan adds to the counts RAS reports
  (``comm->seqNumber``, src/plugin/profiler.cc): its counts stay 0 while it trains (the device
  run of session 12 waited 60 s for them to grow). So: RAS answers, the daemon joins the answer
  to rank 0 (``counted`` false, no ``gpuwatch_nccl_ras_rank_operations``), and the dump pipe.
- ``two_ranks_one_gpu``: world size 2, both ranks on cuda:0, each with its own ``NCCL_HOSTID``
  (two "nodes" to NCCL, joined by its socket transport on ``lo``): NCCL counts their collectives.

Steps:

0. Prelude, printed whatever follows: the raw answer of the job's RAS port, asked by a client in
   this file (``CLIENT PROTOCOL 2``, ``TIMEOUT 1``, ``SET FORMAT json``, ``STATUS``), and the
   port's listeners with their owners (/proc/net/tcp and /proc/PID/fd).
1. NCCL is 2.28 or later (RAS answers JSON from 2.28 on: tests/fixtures/nccl_ras/README.md); a
   job that beats on time is never asked.
2. The job stops calling ``heartbeat()`` but keeps training: its heartbeat is late, so its RAS
   port is asked (working or not: daemon/nccl_ras.py ``ras_jobs``), and ``gpuwatchd ps --json``
   shows rank 0 in ``nccl_ras``. Two ranks: the op counts (``nccl_ras[].ops``) grow from one answer
   to the next, and the moving counts keep the rank from being stalled. One rank: ``ops`` 0 and
   ``counted`` false.
3. The job stops issuing collectives (sleeps in Python, no heartbeat): ``rank_stalled`` is raised;
   two ranks: the counts stop (``gpuwatch_nccl_ras_rank_operations_unchanged_seconds`` past 2 s).
4. One rank: through the pipe, while it is stalled: the daemon writes to the rank's FIFO, reads
   the pickled dump, and the rank's collective series appears
   (``gpuwatch_rank_collective_last_started_seq``); the job resumes and its steps grow.

On a failure the message holds the raw RAS answer asked again then, the daemon's RAS and
flight-recorder lines, ``ps --json``'s ``nccl_ras`` and the rank's stall gauges, and the job's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import DaemonProc, free_port, write_config  # noqa: E402
from gpuworld import kill_tree  # noqa: E402


def wait_until(pred: Callable[[], bool], timeout: float, what: str, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{log()}")


def ras_raw(port: int, timeout: float = 5.0) -> str:
    """What the RAS port answers NCCL's own client's commands, each answer line shown."""
    out: list[str] = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            buf = b""
            for cmd in ("CLIENT PROTOCOL 2", "TIMEOUT 1", "SET FORMAT json"):
                s.sendall(cmd.encode() + b"\n")
                while b"\n" not in buf:
                    chunk = s.recv(4096)
                    if not chunk:
                        return "\n".join([*out, f"{cmd!r} -> closed"])
                    buf += chunk
                line, _, buf = buf.partition(b"\n")
                out.append(f"{cmd!r} -> {line.decode(errors='replace')!r}")
            s.sendall(b"STATUS\n")
            body = buf
            while len(body) < 1 << 20:
                chunk = s.recv(65536)
                if not chunk:
                    break
                body += chunk
            out.append(f"'STATUS' -> {len(body)} bytes:\n{body.decode(errors='replace')[:6000]}")
    except OSError as exc:
        out.append(f"port {port}: {exc!r}")
    return "\n".join(out)


def listeners(port: int) -> str:
    """The listening sockets on ``port`` (/proc/net/tcp{,6}) and which processes hold them."""
    inodes: dict[int, str] = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes[int(cols[9])] = f"{name} {cols[1]}"
    owners: dict[int, list[int]] = {i: [] for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
                    if m and int(m[1]) in owners:
                        owners[int(m[1])].append(int(pid))
    return (
        "; ".join(f"{inodes[i]} inode {i} held by pids {sorted(set(p))}" for i, p in owners.items())
        or f"nothing listens on port {port}"
    )


def ps_json(cfg_path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "ps", "--json", "--config.file", str(cfg_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    return dict(json.loads(out.stdout))


def ras_rows(cfg_path: Path, job_id: str) -> list[dict[str, Any]]:
    """Rank 0's ``nccl_ras`` rows as ``gpuwatchd ps --json`` shows them."""
    return [r for r in ps_json(cfg_path).get("nccl_ras", []) if r["job_id"] == job_id and r["rank"] == 0]


def stalled(d: DaemonProc, job_id: str) -> bool:
    """The page's gauge and the finding agree that rank 0 is stalled."""
    return (
        d.value("gpuwatch_finding", kind="rank_stalled", job_id=job_id, rank="0") == 1.0
        and d.value("gpuwatch_rank_stalled", job_id=job_id, rank="0") == 1.0
    )


@pytest.mark.parametrize("world", ["one_rank", "two_ranks_one_gpu"])
def test_nccl_ras_counts_and_the_dump_pipe_on_a_real_job(tmp_path: Path, world: str) -> None:
    nproc = 1 if world == "one_rank" else 2
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "fr").mkdir()
    cfg_path, cfg = write_config(
        tmp_path,
        interval_seconds=0.5,
        nvml={"enabled": True},
        log_level="debug",
        stall={"after_seconds": 2.0, "nccl_ras_interval_seconds": 1.0, "flight_recorder_interval_seconds": 5.0},
    )
    job_id = f"ras{nproc}x{os.getpid()}"
    port = free_port()
    env = {
        **os.environ,
        "GPUWATCH_RANK_DIR": cfg["rank_dir"],
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "NCCL_RAS_ADDR": f"127.0.0.1:{port}",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,RAS",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/fr/pipe_",
        "TORCH_FR_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/fr/pipe_",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr/trace_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/fr/trace_",
    }
    args = []
    if nproc > 1:  # two "nodes" to NCCL on one GPU, over its socket transport on loopback
        env.update(NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
        args = ["--split-hosts"]
    d = DaemonProc(cfg_path, cfg)
    log_path = tmp_path / "job.log"
    with open(log_path, "wb") as f:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                "--max-restarts",
                "0",
                str(HERE / "ras_train.py"),
                "--out",
                str(out),
                "--job-id",
                job_id,
                *args,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(tmp_path),
            start_new_session=True,
        )
    seen: list[tuple[int, float]] = []

    def log() -> str:
        daemon = d.log()
        job = log_path.read_text(errors="replace")
        ours = [ln for ln in daemon.splitlines() if "nccl_ras" in ln or "flight_recorder" in ln]
        try:
            rows = json.dumps(ps_json(cfg_path).get("nccl_ras", []))[:3000]
        except (subprocess.SubprocessError, ValueError) as exc:
            rows = repr(exc)
        gauges = {
            n: d.value(n, job_id=job_id, rank="0")
            for n in (
                "gpuwatch_rank_stalled",
                "gpuwatch_rank_up",
                "gpuwatch_nccl_ras_rank_operations",
                "gpuwatch_nccl_ras_rank_operations_unchanged_seconds",
            )
        }
        return (
            f"world {world}; (ops, asked_at) seen: {seen}\ngauges of rank 0: {gauges}\n"
            f"ps --json nccl_ras: {rows}\nRAS port {port} now: {listeners(port)}\n{ras_raw(port)}\n"
            f"daemon's RAS and flight-recorder lines (last 60 of {len(ours)}):\n"
            + "\n".join(ours[-60:])
            + "\njob log's NCCL RAS and init lines (first 30):\n"
            + "\n".join([ln for ln in job.splitlines() if "RAS" in ln or "NCCL version" in ln][:30])
            + f"\njob log:\n{job[-5000:]}\n"
            f"daemon log (tail):\n{daemon[-3000:]}"
        )

    def steps() -> int:
        try:
            return int((out / "step").read_text())
        except (OSError, ValueError):
            return -1

    try:
        wait_until(
            lambda: (
                steps() >= 5
                and all(d.value("gpuwatch_rank_up", job_id=job_id, rank=str(r)) == 1.0 for r in range(nproc))
            ),
            180,
            "the job training and its ranks up",
            log,
        )
        # the prelude: what the port answers, whatever the daemon makes of it
        print(f"\n[{world}] RAS port {port}: {listeners(port)}\n{ras_raw(port)}", flush=True)
        version = tuple(int(x) for x in (out / "nccl").read_text().split("."))
        assert version >= (2, 28), f"NCCL {version}: RAS answers JSON from 2.28 on"
        # a job beating on time is not asked (one late at its start was, until it beat again)
        wait_until(lambda: not ras_rows(cfg_path, job_id), 10, "no RAS rows of a job that beats", log)

        (out / "quiet").touch()  # no heartbeat: late, while it trains
        if nproc == 1:
            wait_until(
                lambda: bool(ras_rows(cfg_path, job_id)), 30, "rank 0's RAS answer joined in gpuwatchd ps --json", log
            )
            row = ras_rows(cfg_path, job_id)[0]
            print(f"[{world}] joined: {row}", flush=True)
            assert row["ops"] == 0 and row["counted"] is False, (row, log())
            assert d.value("gpuwatch_nccl_ras_rank_operations", job_id=job_id, rank="0") is None

            (out / "hang").touch()  # no collectives, no heartbeat: stalled, and the pipe is written
            wait_until(lambda: stalled(d, job_id), 30, "rank_stalled", log)
            wait_until(
                lambda: (
                    (d.value("gpuwatch_rank_collective_last_started_seq", job_id=job_id, rank="0", pg="0") or 0) > 0
                ),
                60,
                "the flight-recorder dump read through torch's pipe",
                log,
            )
            at_dump = steps()
            (out / "hang").unlink()
            wait_until(lambda: steps() >= at_dump + 10, 30, "training going on after the dump", log)
        else:

            def counts_move() -> bool:
                now = [(r["ops"], r["asked_at"]) for r in ras_rows(cfg_path, job_id)]
                if now and (not seen or now[0][1] != seen[-1][1]):
                    seen.append(now[0])
                return len(seen) >= 3 and seen[-1][0] > seen[-2][0] > seen[0][0]

            wait_until(counts_move, 60, "RAS op counts that grow in gpuwatchd ps --json", log)
            print(f"[{world}] (ops, asked_at): {seen}", flush=True)
            wait_until(
                lambda: d.value("gpuwatch_rank_stalled", job_id=job_id, rank="0") == 0.0,
                10,
                "moving RAS counts keeping the rank from being stalled (the page's gauge)",
                log,
            )

            (out / "hang").touch()  # no more collectives
            wait_until(
                lambda: (
                    (d.value("gpuwatch_nccl_ras_rank_operations_unchanged_seconds", job_id=job_id, rank="0") or 0)
                    >= 2.0
                    and stalled(d, job_id)
                ),
                60,
                "RAS counts that stop, and rank_stalled",
                log,
            )
            ops = ras_rows(cfg_path, job_id)[0]["ops"]
            time.sleep(2.5)
            assert ras_rows(cfg_path, job_id)[0]["ops"] == ops, log()
        assert agent.poll() is None, log()
        assert "Traceback" not in d.log(), log()
    finally:
        kill_tree(agent)  # torchrun and its ranks (each in a session of its own)
        assert d.stop() == 0, d.log()
