"""`gpuwatchd ps`: from the running daemon's state, and from a live /proc view without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from daemonutil import DaemonProc, write_config


def gw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuwatchd", *args], capture_output=True, text=True, timeout=60)


def test_ps_with_and_without_daemon(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={"NCCL_BLOCKING_WAIT": "1", "PATH": "/usr/bin:/bin"}
    )
    try:
        assert (
            gw(
                "register", "--config.file", str(path), "--job-id", "ps-job", "--rank", "5", "--pid", str(rank.pid)
            ).returncode
            == 0
        )
        d = DaemonProc(path, cfg)
        try:
            d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id="ps-job") == 1, what="rank up")
            out = gw("ps", "--config.file", str(path))
            assert out.returncode == 0, out.stderr
            assert "daemon state" in out.stdout
            line = next(x for x in out.stdout.splitlines() if x.startswith("ps-job"))
            assert f" {rank.pid} " in line and "nccl_legacy_env" in line
            data = json.loads(gw("ps", "--config.file", str(path), "--json").stdout)
            assert [(r["job_id"], r["rank"], r["alive"]) for r in data["ranks"]] == [("ps-job", 5, True)]
        finally:
            d.stop()
        (Path(cfg["state_dir"]) / "state.json").unlink()
        out = gw("ps", "--config.file", str(path))
        assert "daemon not running" in out.stdout and "ps-job" in out.stdout
    finally:
        rank.kill()
        rank.wait()
