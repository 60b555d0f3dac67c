"""Issue 23 N3: a claim the join refuses drives no reading of the rank it names. Real users
(useradd, setpriv), real processes, the real daemon with py-spy.

On 63318c5 the subsystems read every entry of the cycle before the join refused any, and the
join copied ``stalled`` / progress by ``(job_id, rank)`` without the pid:

- false page: U1's stopped process claiming root's heartbeating ``(job, 0)`` made
  ``gpuwatch_rank_stalled`` 1 on root's rank;
- hidden stall: U1's fresh heartbeat on the same ``(job, 0)`` hid root's real stall;
- cross-user read: U1's refused claim of U2's spinning Python was GIL-sampled and published
  under U1's job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, write_config
from userutil import rank_world_fixture, setpriv, user_writes, users_fixture

U1, U2 = "gw-n3-u1", "gw-n3-u2"
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]
SPIN = ["/usr/bin/python3", "-c", "while True: pass"]
# touches argv[1] every 0.2 s (a heartbeat)
BEAT = ["/usr/bin/python3", "-c", "import os, sys, time\nwhile True:\n    os.utime(sys.argv[1]); time.sleep(0.2)"]


users = users_fixture(U1, U2)


world = rank_world_fixture("gw-n3-")


def _as(user: str | None, argv: list[str], procs: list[subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
    pre = setpriv(user) if user else []
    p = subprocess.Popen([*pre, *argv], env={"PATH": "/usr/bin:/bin"})
    procs.append(p)
    return p


def _doc(job: str, pid: int, heartbeat: Path | None = None) -> str:
    rank: dict[str, Any] = {"rank": 0, "pid": pid}
    if heartbeat is not None:
        rank["heartbeat"] = str(heartbeat)
    return json.dumps({"version": 1, "job_id": job, "ranks": [rank]})


def _refused(d: DaemonProc, world: Path, name: str) -> bool:
    path = world / "state" / "state.json"
    if not path.exists():
        return False
    return any(
        f["kind"] == "bad_rank_file" and name in f["explanation"] for f in json.loads(path.read_text())["findings"]
    )


def _hold(d: DaemonProc, what: str, pred: Any, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert pred(), f"{what} stopped holding; metrics:\n{d.text()}\nlog:\n{d.log()}"
        time.sleep(0.2)


def test_a_refused_stopped_claim_does_not_page_on_roots_rank(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    job = f"good{os.getpid()}"
    squatter = _as(U1, SLEEP, procs)  # started first: the lower pid
    os.kill(squatter.pid, signal.SIGSTOP)
    hb = world / "root.hb"
    hb.write_text("")
    root_rank = _as(None, [*BEAT, str(hb)], procs)
    (ranks / "good.json").write_text(_doc(job, root_rank.pid, hb))
    user_writes(U1, ranks / "claim.json", _doc(job, squatter.pid))
    path, cfg = write_config(world, rank_dir=str(ranks), stall={"after_seconds": 1.5})
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_stalled", job_id=job, rank="0") is not None and _refused(d, world, "claim.json")
            ),
            what="root's rank and the refusal",
        )
        assert d.value("gpuwatch_rank_info", job_id=job, rank="0", pid=str(root_rank.pid)) == 1.0
        _hold(
            d,
            "root's heartbeating rank not stalled",
            lambda: d.value("gpuwatch_rank_stalled", job_id=job, rank="0") == 0.0,
            6.0,
        )
    finally:
        d.stop()


def test_a_refused_fresh_heartbeat_does_not_hide_roots_stall(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    job = f"stuck{os.getpid()}"
    hb = world / "root.hb"
    hb.write_text("")
    os.utime(hb, (time.time() - 60, time.time() - 60))
    root_rank = _as(None, SLEEP, procs)  # never beats: stalled after 1.5 s
    user_hb = ranks / "u1.hb"
    user_writes(U1, user_hb, "")
    beater = _as(U1, [*BEAT, str(user_hb)], procs)  # started later: the higher pid
    (ranks / "stuck.json").write_text(_doc(job, root_rank.pid, hb))
    user_writes(U1, ranks / "claim.json", _doc(job, beater.pid, user_hb))
    path, cfg = write_config(world, rank_dir=str(ranks), stall={"after_seconds": 1.5})
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: d.value("gpuwatch_rank_stalled", job_id=job, rank="0") == 1.0, timeout=20, what="root's real stall"
        )
        assert d.value("gpuwatch_rank_progress_timestamp_seconds", job_id=job, rank="0") == pytest.approx(
            hb.stat().st_mtime
        )
    finally:
        d.stop()


def test_a_refused_claim_of_another_users_process_is_never_sampled(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    mine, theirs = f"rootgil{os.getpid()}", f"u1job{os.getpid()}"
    root_spin = _as(None, SPIN, procs)
    u2_spin = _as(U2, SPIN, procs)
    (ranks / "root.json").write_text(_doc(mine, root_spin.pid))
    user_writes(U1, ranks / "claim.json", _doc(theirs, u2_spin.pid))
    path, cfg = write_config(
        world,
        rank_dir=str(ranks),
        gil={"enabled": True, "interval_seconds": 1, "duration_seconds": 1, "rate_hz": 50, "timeout_seconds": 10},
    )
    d = DaemonProc(path, cfg)
    try:
        # the sampler works (root's own rank is sampled twice) ...
        d.wait_for(
            lambda: (d.value("gpuwatch_rank_gil_samples_total", job_id=mine, rank="0") or 0) >= 2 * 49,
            timeout=40,
            what="two GIL samples of root's rank",
        )
        assert _refused(d, world, "claim.json")
        # ... and never read U2's process for U1's refused claim
        text = d.text()
        assert theirs not in text, [ln for ln in text.splitlines() if theirs in ln]
    finally:
        d.stop()
