"""A discovered rank's identity is the process discovery saw (PID and start time): when it exits
and another user's process takes its PID before the next discovery pass, the rank is dead
(rank_down), not that process's claim, which its uid would refuse: the death would not page.

The PID is reused for real: the whole scene (the daemon, root's two ranks, the user's process)
runs in a PID namespace of its own (``unshare --pid --mount-proc``), where setting
``/proc/sys/kernel/ns_last_pid`` hands the next process the dead rank's PID without touching the
host's PID allocation. Real processes, real setpriv to a second user, the real daemon."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from userutil import shared_rank_world, users_fixture

USER = "gwtrustrank-u"  # test_rank_claims.py's user
TESTS = str(Path(__file__).resolve().parent)

# Runs as PID 1 of the new namespace: argv = tests dir, world dir, user, job id. Exits 0 when
# the reused PID's rank pages rank_down and stays paged.
SCENE = r"""
import subprocess, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from daemonutil import DaemonProc, finding_jobs, write_config
world, user, job = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]
env = {"TORCHELASTIC_RUN_ID": job, "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
procs = [subprocess.Popen(SLEEP, env={**env, "RANK": "0"})]
time.sleep(0.05)  # root's rank 0 starts first: the job is root's
rank1 = subprocess.Popen(SLEEP, env={**env, "RANK": "1"})
procs.append(rank1)
path, cfg = write_config(world, discovery={"enabled": True, "interval_seconds": 600})
d = DaemonProc(path, cfg)
try:
    d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id=job, rank="1") == 1.0,
               what="root's rank 1 up")
    dead = rank1.pid
    rank1.kill()
    rank1.wait()
    for _ in range(50):  # a thread the daemon starts meanwhile may take the PID first: again
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(dead - 1))
        taker = subprocess.Popen(["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups",
                                  *SLEEP], env={"PATH": "/usr/bin:/bin"})
        procs.append(taker)
        if taker.pid == dead:
            break
    assert taker.pid == dead, "the dead rank's PID was not handed out again"
    uid = subprocess.run(["id", "-u", user], capture_output=True, text=True, check=True).stdout.strip()
    d.wait_for(lambda: Path(f"/proc/{dead}/status").read_text().split("Uid:")[1].split()[0] == uid,
               what="the user's process at the dead rank's PID")
    d.wait_for(lambda: job in finding_jobs(d, "rank_down"), what="rank_down of rank 1")
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # cycles with the user's process at that PID
        assert job in finding_jobs(d, "rank_down") and d.value(
            "gpuwatch_rank_up", job_id=job, rank="1") == 0.0, (
            f"rank 1's death stopped paging; daemon log:\n{d.log()}\nmetrics:\n{d.text()}")
        time.sleep(0.2)
    print("paged", flush=True)
finally:
    d.stop()
    for p in procs:
        p.kill()
        p.wait()
"""


user = users_fixture(USER)


def test_a_dead_discovered_rank_whose_pid_another_user_takes_still_pages(user: int) -> None:
    job = f"reusejob-{uuid.uuid4().hex[:8]}"
    with shared_rank_world("gwtrustrank-reuse-") as world:
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
                USER,
                job,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0 and out.stdout.strip() == "paged", out.stdout + out.stderr
