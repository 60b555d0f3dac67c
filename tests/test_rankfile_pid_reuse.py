"""Issue 23 N4: a dead rank registered by a rank file keeps paging ``rank_down`` when another
user's process takes its PID, with ``start_ticks`` in the file and without (then the start time
the daemon saw first is the rank's identity). On 63318c5 the uid refusal ran before the start-time
comparison: the claim became that process's refused claim, and ``rank_down`` vanished after one
cycle. (Commit 77273cd fixed the same for discovered ranks: tests/test_discovery_identity.py.)

The PID is reused for real, in a PID namespace of the scene's own (``unshare --pid
--mount-proc``; ``/proc/sys/kernel/ns_last_pid`` hands the next process the dead rank's PID).
Real users (useradd, setpriv), real processes, the real daemon."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from userutil import shared_rank_world, system_user

OWNER, TAKER = "gw-n4-owner", "gw-n4-taker"
TESTS = str(Path(__file__).resolve().parent)

# PID 1 of the new namespace: argv = tests dir, world dir, owner, taker, job, "ticks"/"noticks".
SCENE = r"""
import json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from daemonutil import DaemonProc, finding_jobs, write_config
from userutil import user_writes
world, owner, taker, job, ticks = Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]
def as_user(user):
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *SLEEP]
procs = [subprocess.Popen(as_user(owner), env={"PATH": "/usr/bin:/bin"})]
rank = procs[0]
path, cfg = write_config(world)
entry = {"rank": 0, "pid": rank.pid}
if ticks == "ticks":
    time.sleep(0.2)
    entry["start_ticks"] = int(Path(f"/proc/{rank.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
user_writes(owner, world / "ranks" / "job.json",
            json.dumps({"version": 1, "job_id": job, "ranks": [entry]}))
d = DaemonProc(path, cfg)
try:
    d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0, what="rank up")
    dead = rank.pid
    rank.kill()
    rank.wait()
    for _ in range(50):  # a thread the daemon starts meanwhile may take the PID first: again
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(dead - 1))
        p = subprocess.Popen(as_user(taker), env={"PATH": "/usr/bin:/bin"})
        procs.append(p)
        if p.pid == dead:
            break
    assert p.pid == dead, "the dead rank's PID was not handed out again"
    uid = subprocess.run(["id", "-u", taker], capture_output=True, text=True, check=True).stdout.strip()
    d.wait_for(lambda: Path(f"/proc/{dead}/status").read_text().split("Uid:")[1].split()[0] == uid,
               what="the other user's process at the dead rank's PID")
    d.wait_for(lambda: job in finding_jobs(d, "rank_down"), what="rank_down")
    end = time.monotonic() + 4.0
    while time.monotonic() < end:  # cycles with the other user's process at that PID
        assert job in finding_jobs(d, "rank_down") and d.value(
            "gpuwatch_rank_up", job_id=job, rank="0") == 0.0, (
            f"the rank's death stopped paging; daemon log:\n{d.log()}\nmetrics:\n{d.text()}")
        time.sleep(0.2)
    print("paged", flush=True)
finally:
    d.stop()
    for p in procs:
        p.kill()
        p.wait()
"""


@pytest.fixture(scope="module")
def users() -> Iterator[None]:
    with system_user(OWNER), system_user(TAKER):
        yield


@pytest.mark.parametrize("ticks", ["ticks", "noticks"])
def test_a_dead_rank_whose_pid_another_user_takes_still_pages(users: None, ticks: str) -> None:
    job = f"reuse-{uuid.uuid4().hex[:8]}"
    with shared_rank_world("gw-n4-") as world:
        out = subprocess.run(
            [
                "unshare",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                sys.executable,
                "-c",
                SCENE,
                TESTS,
                str(world),
                OWNER,
                TAKER,
                job,
                ticks,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0 and out.stdout.strip() == "paged", out.stdout + out.stderr[:3000]
