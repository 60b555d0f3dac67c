"""Rank deaths under real torchrun on a real GPU, through the real daemon (marker ``gpu``).

Each case is a 2-rank torchrun job (tests/gpu/exit_rank.py: CUDA matmul + gloo all_reduce every
step), found by discovery only; rank 1 dies AFTER seconds in. torchrun reaps the rank at once and
ends the other (SIGTERM; rank 0's all_reduce may fail first). What is asserted, from the daemon's
``rank_exit`` events (events.jsonl) and its findings (/metrics):

- both ranks' exits are recorded, rank 1 named the first to fail with its cause: ``SIGSEGV`` and
  the kernel's ``segfault at 1`` line (segv), ``exit_nonzero`` (exc, assert: the device-side
  assert surfaces as a RuntimeError), ``SIGKILL`` (kill); rank 0 not first, its first_rank 1;
- the event is in events.jsonl within 5 s of the death (printed: ``SAW ... death to event``);
- the finding: ``job_crashed`` (warning) for segv, exc and assert; ``rank_down`` (page) for kill.

Each prints ``SAW`` lines for bench/results/.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import DaemonProc, finding_jobs, write_config  # noqa: E402

AFTER = "8"  # seconds of training before the fault: discovery (every 0.5 s) finds both ranks


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("exits")
    path, cfg = write_config(
        tmp, kernel_log="kmsg", nvml={"enabled": True}, discovery={"enabled": True, "interval_seconds": 0.5}
    )
    d = DaemonProc(path, cfg)
    try:
        yield d
    finally:
        d.stop()


def _exit_lines(state_dir: str, job: str) -> dict[str, tuple[dict, float]]:
    """rank -> (its rank_exit event, when this test first saw it in events.jsonl)."""
    log = Path(state_dir) / "events.jsonl"
    out: dict[str, tuple[dict, float]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        if f'"job_id":"{job}"' in line and '"kind":"rank_exit"' in line:
            ev = json.loads(line)
            out[ev["rank"]] = (ev, time.time())
    return out


CASES = [
    ("segv", "SIGSEGV", {"job_crashed"}),
    ("exc", "exit_nonzero", {"job_crashed"}),
    ("assert", "exit_nonzero", {"job_crashed"}),
    ("kill", "SIGKILL", {"rank_down"}),
]


@pytest.mark.parametrize(("fault", "cause", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_torchrun_rank_death_is_named_with_its_cause(
    daemon: DaemonProc, fault: str, cause: str, kinds: set[str]
) -> None:
    job = f"gpu-exit-{fault}-{os.getpid()}"
    state = daemon.cfg["state_dir"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{_port()}",
        "--rdzv-id",
        job,
        str(HERE / "exit_rank.py"),
        fault,
        AFTER,
    ]
    launcher = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    seen: dict[str, tuple[dict, float]] = {}
    deadline = time.monotonic() + 120
    while len(seen) < 2 and time.monotonic() < deadline:
        for rank, hit in _exit_lines(state, job).items():
            seen.setdefault(rank, hit)
        time.sleep(0.02)
    out, _ = launcher.communicate(timeout=120)
    assert len(seen) == 2, f"rank_exit events: {seen}\ntorchrun:\n{out[-3000:]}\n{daemon.log()}"
    (one, one_seen), (zero, _) = seen["1"], seen["0"]
    delay = one_seen - one["time"]
    print(
        f"SAW {fault}: {one['summary']} (read by {one['fields']['read_by']}); death to event "
        f"{delay:.3f} s; rank 0: {zero['summary']}"
    )
    assert one["fields"]["cause"] == cause, one
    assert one["fields"]["first_pid"] == one["pid"] and zero["fields"]["first_rank"] == 1, (one, zero)
    if fault == "segv":
        assert "kernel: segfault at 1" in one["summary"], one
    assert delay < 5.0
    daemon.wait_for(lambda: all(job in finding_jobs(daemon, k) for k in kinds), timeout=15, what=f"findings {kinds}")
    for kind in {"rank_down", "job_crashed"} - kinds:
        assert job not in finding_jobs(daemon, kind), kind
    print(f"SAW {fault}: findings {sorted(kinds)}")
