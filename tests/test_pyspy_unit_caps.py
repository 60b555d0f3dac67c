"""Issue 23 N8: the daemon with exactly the unit's privileges (its own non-root user, the unit's
AmbientCapabilities= as inheritable, ambient and bounding set via setpriv, NoNewPrivileges),
sampling a rank of another user whose owner stops and continues it again and again (a debugger,
Slurm's suspend). On 63318c5 the daemon sent SIGCONT when it found the rank stopped after a
py-spy run, which fails with EPERM under the unit (no CAP_KILL); the PermissionError escaped,
and the GIL sampler never cleared the rank's ``in_flight``: its samples froze for good.

Now the daemon never resumes what it did not stop (``--nonblocking`` never stops a process), and
an error in a sample always clears ``in_flight``. Real users (useradd, setpriv), real py-spy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import free_port
from userutil import system_user, user_writes

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "gpuwatchd.service"
PY_SPY = Path(sys.executable).parent / "py-spy"
DAEMON_USER, RANK_USER = "gw-n8-daemon", "gw-n8-rank"
SPIN = "import time\nwhile True:\n    sum(range(10000))\n"


def _unit_caps() -> str:
    """setpriv's spec for the unit's capabilities: "-all,+sys_ptrace,..."."""
    line = next(ln for ln in UNIT.read_text().splitlines() if ln.startswith("AmbientCapabilities="))
    caps = sorted(line.split("=", 1)[1].split())
    bounding = next(ln for ln in UNIT.read_text().splitlines() if ln.startswith("CapabilityBoundingSet="))
    assert sorted(bounding.split("=", 1)[1].split()) == caps  # the same set, as setpriv gives it
    return ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in caps)])


@pytest.fixture(scope="module")
def users() -> Iterator[None]:
    with system_user(DAEMON_USER), system_user(RANK_USER):
        yield


def _metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_rank_stopped_by_its_owner_is_never_resumed_and_sampling_goes_on(
    users: None, procs: list[subprocess.Popen[Any]]
) -> None:
    world = Path(tempfile.mkdtemp(prefix="gw-n8-", dir="/tmp"))
    world.chmod(0o755)
    daemon = None
    stop_toggling = threading.Event()
    try:
        (world / "ranks").mkdir()
        (world / "ranks").chmod(0o1777)
        (world / "state").mkdir()
        shutil.chown(world / "state", DAEMON_USER, DAEMON_USER)
        port = free_port()
        cfg = world / "config.yaml"
        cfg.write_text(
            f'web: {{listen_address: "127.0.0.1:{port}"}}\n'
            f"interval_seconds: 0.5\nrank_dir: {world / 'ranks'}\nstate_dir: {world / 'state'}\n"
            'kernel_log: "off"\nnvml: {enabled: false}\ndiscovery: {enabled: false}\n'
            "stall: {after_seconds: 1.5}\n"
            "gil: {enabled: true, interval_seconds: 1, duration_seconds: 1, healthy_interval_seconds: 1,"
            f" pyspy_path: {PY_SPY}}}\n"
        )
        cfg.chmod(0o644)
        rank = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={RANK_USER}",
                f"--regid={RANK_USER}",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                SPIN,
            ],
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        procs.append(rank)
        job = f"stopjob{os.getpid()}"
        user_writes(
            RANK_USER,
            world / "ranks" / "job.json",
            json.dumps({"version": 1, "job_id": job, "ranks": [{"rank": 0, "pid": rank.pid}]}),
        )

        def toggle() -> None:  # the owner (root here, for the test) stops and continues it
            # running half the time: half a core, well above the 0.3 below which a healthy rank
            # is not screened (daemon/gil.py), and most 1 s runs see a stop
            while not stop_toggling.is_set():
                os.kill(rank.pid, signal.SIGSTOP)
                time.sleep(0.25)
                os.kill(rank.pid, signal.SIGCONT)
                time.sleep(0.25)

        spec = _unit_caps()
        site = next((ROOT / ".venv" / "lib").glob("python3.*")) / "site-packages"
        daemon = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={DAEMON_USER}",
                f"--regid={DAEMON_USER}",
                "--clear-groups",
                f"--inh-caps={spec}",
                f"--ambient-caps={spec}",
                f"--bounding-set={spec}",
                "--no-new-privs",
                "/usr/bin/python3",
                "-m",
                "gpuwatchd",
                "run",
                "--config.file",
                str(cfg),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{ROOT}"},
            # a session of its own, as under systemd: the kernel lets any process SIGCONT the
            # processes of its own session, whatever their uid, which would hide the EPERM
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> str:
            assert daemon is not None and daemon.poll() is None, daemon.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    return str(r.read().decode())
            except OSError:
                return ""

        def samples() -> float:
            return _metric(scrape(), "gpuwatch_rank_gil_samples_total", job_id=job, rank="0") or 0.0

        deadline = time.monotonic() + 40
        while samples() < 1 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert samples() >= 1, scrape()[-3000:]
        threading.Thread(target=toggle, daemon=True).start()
        time.sleep(6)  # several runs that end with the rank stopped by its owner
        first = samples()
        deadline = time.monotonic() + 20
        while samples() <= first and time.monotonic() < deadline:
            time.sleep(0.3)
        text = scrape()
        assert (_metric(text, "gpuwatch_rank_gil_samples_total", job_id=job, rank="0") or 0) > first, (
            "GIL samples froze",
            text[-2000:],
        )
        assert _metric(text, "gpuwatch_collector_success", collector="pyspy") == 1.0
        # the owner's stop is kept: stopped now, the rank stays stopped across sampling runs
        stop_toggling.set()
        time.sleep(0.6)
        os.kill(rank.pid, signal.SIGSTOP)
        time.sleep(3)
        state = Path(f"/proc/{rank.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T"
    finally:
        stop_toggling.set()
        log = ""
        if daemon is not None:
            daemon.terminate()
            try:
                log = daemon.communicate(timeout=15)[0]
            except subprocess.TimeoutExpired:
                daemon.kill()
                log = daemon.communicate(timeout=5)[0]
        shutil.rmtree(world, ignore_errors=True)
    assert "PermissionError" not in log and "Traceback" not in log, log[-3000:]
