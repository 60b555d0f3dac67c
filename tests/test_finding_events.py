"""Finding transitions reach the event log: `gpuwatchd events` shows a rank's death and recovery
next to the kernel's OOM kills (one timeline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from daemonutil import DaemonProc, write_config


def events(state_dir: str) -> list[dict]:
    r = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "events", "--state-dir", state_dir, "--json", "--since", "all"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return list(json.loads(r.stdout))


def test_rank_death_and_its_clearing_are_events(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--rank-dir",
            cfg["rank_dir"],
            "--job-id",
            "ev-job",
            "--rank",
            "2",
            "--pid",
            str(rank.pid),
        ],
        check=True,
    )
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id="ev-job", rank="2") == 1, what="rank up")
        rank.kill()
        rank.wait()
        d.wait_for(lambda: any(e["kind"] == "rank_down" for e in events(cfg["state_dir"])), what="rank_down event")
        (down,) = [e for e in events(cfg["state_dir"]) if e["kind"] == "rank_down"]
        assert (down["job_id"], down["rank"], down["pid"], down["severity"]) == ("ev-job", "2", rank.pid, "page")
        assert "rank 2 of job ev-job" in down["summary"]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwatchd",
                "unregister",
                "--rank-dir",
                cfg["rank_dir"],
                "--job-id",
                "ev-job",
                "--rank",
                "2",
            ],
            check=True,
        )
        d.wait_for(
            lambda: any(e["kind"] == "rank_down cleared" for e in events(cfg["state_dir"])), what="cleared event"
        )
        # one transition, one line: no repetition while the state holds
        kinds = [e["kind"] for e in events(cfg["state_dir"])]
        assert kinds.count("rank_down") == 1 and kinds.count("rank_down cleared") == 1
        table = subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "events", "--state-dir", cfg["state_dir"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "rank_down" in table and "ev-job" in table
    finally:
        assert d.stop() == 0
