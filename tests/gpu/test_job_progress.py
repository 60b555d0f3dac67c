"""The job is hung when the job makes no progress (issue 33 item 4), on a real GPU, through the
real daemon (marker ``gpu``): a 2-rank gloo job under torchrun, found by discovery only (no rank
file, no heartbeat), whose rank 0 evaluates alone on the GPU (``torch.no_grad()``, ``.item()`` per
batch) for 1.5 x ``stall.after_seconds`` while rank 1 waits in ``dist.barrier()``, two rounds.

Asserted: no ``rank_stalled`` for either rank over the whole job (before, issue 33 measured rank 1
paged 40 s into the wait at after_seconds 30 and rank 0 20 s later, "confirmed by its peers").
Printed (``SAW ...``, for bench/results/): every other finding of the job, with the first cycle
it appeared in: rank 1's ``rank_waiting`` info ("rank 1 waits in barrier for rank 0, which ...")
where rank 1 waited long enough to be judged, and nothing else expected.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import DaemonProc, write_config  # noqa: E402
from gpuworld import kill_tree  # noqa: E402

INTERVAL = 0.5
AFTER = 8.0
DISCOVERY = 1.0
EVAL = 1.5 * AFTER
ROUNDS = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _findings(state: Path, job: str) -> list[dict]:
    try:
        return [f for f in json.loads(state.read_text())["findings"] if f.get("job_id") == job]
    except (OSError, ValueError, KeyError):
        return []


def test_rank0_evaluating_alone_while_rank1_waits_in_a_barrier_is_not_paged(tmp_path: Path) -> None:
    cfg_path, cfg = write_config(
        tmp_path,
        interval_seconds=INTERVAL,
        nvml={"enabled": True},
        discovery={"enabled": True, "interval_seconds": DISCOVERY},
        stall={"after_seconds": AFTER, "conclusive_seconds": AFTER / 2, "compile_after_seconds": 600},
    )
    state = Path(cfg["state_dir"]) / "state.json"
    d = DaemonProc(cfg_path, cfg)
    job = f"evalalone-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    # static rendezvous: --standalone would replace the run id (the job id) with a random one
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_port()),
            "--rdzv-id",
            job,
            str(HERE / "eval_alone_rank.py"),
            str(EVAL),
            str(ROUNDS),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(x.strip()) for x in p.stdout or ()], daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while "ready" not in lines:
            assert p.poll() is None and time.monotonic() < deadline, (p.returncode, lines)
            time.sleep(0.2)
        t0 = time.monotonic()
        seen: dict[str, float] = {}
        budget = ROUNDS * (EVAL + 30) + 120
        while p.poll() is None:
            found = _findings(state, job)
            paged = [f for f in found if f["kind"] == "rank_stalled"]
            assert not paged, (paged, lines, d.log()[-3000:])
            for f in found:
                seen.setdefault(f"{f['kind']} rank {f['rank']}: {f['explanation']}", time.monotonic() - t0)
            assert time.monotonic() - t0 < budget, f"the job did not finish in {budget:.0f} s: {lines}"
            time.sleep(INTERVAL / 2)
        assert p.returncode == 0 and "done" in lines, (p.returncode, lines)
        assert [x for x in lines if x.startswith("eval ")] == [f"eval {n}" for n in range(ROUNDS)]
        for text, at in sorted(seen.items(), key=lambda kv: kv[1]):
            print(f"SAW at {at:.1f} s: {text}", flush=True)
        if not seen:
            print("SAW no finding for the job", flush=True)
    finally:
        kill_tree(p)  # torchrun and its ranks (each in a session of its own)
        d.stop()
