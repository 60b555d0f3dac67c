"""The whole pipeline, byte for byte, like node_exporter's end-to-end test.

A recorded /proc tree (tests/fixtures/proc/golden, written by tools/make_proc_fixture.py) and an
NVML recording (tests/fixtures/nvml/h200_orphan_dataloader.json) go through the real daemon's
cycles (rank files, /proc, the GPU subsystem, the join, the findings) with a fixed clock, and the
/metrics text it serves is compared with tests/fixtures/golden/metrics.txt. Any change to a metric
name, label, value or help text shows up here as a diff.

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_exposition.py   # regenerate

The only values that depend on the machine are the collectors' wall-clock durations (replaced by
0), the daemon's own /proc/self/oom_score_adj (replaced by 0) and the user name of the fixture's
owner (replaced by ``USER``). RSS is pages times the page size: the golden file is for 4 KiB pages
(x86-64, where CI runs).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

from prometheus_client.exposition import generate_latest

from gpuwatchd.config import Config, NvmlConfig, OrphansConfig
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.gpu import GpuSubsystem
from gpuwatchd.paths import HostPaths
from gpuwatchd.rank.rankfile import write_rank_file

HERE = Path(__file__).resolve().parent
PROC = HERE / "fixtures" / "proc" / "golden"
NVML = HERE / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
GOLDEN = HERE / "fixtures" / "golden" / "metrics.txt"
T0 = 1795935723.0  # the NVML recording's first cycle
DURATION = re.compile(r"^(gpuwatch_\w*duration_seconds\w*(?:\{[^}]*\})?|gpuwatch_cycle_seconds\w*) \S+$", re.M)


def _exposition(tmp_path: Path) -> str:
    rank_dir = tmp_path / "ranks"
    write_rank_file(str(rank_dir), {
        "version": 1, "job_id": "golden", "world_size": 1,
        "ranks": [{"rank": 0, "local_rank": 0, "pid": 447, "gpus": ["0"], "start_ticks": 571200}],
    }, "golden.json")
    cfg = Config(rank_dir=str(rank_dir), state_dir=str(tmp_path / "state"), procfs=str(PROC),
                 nvml=NvmlConfig(fixture=str(NVML)), orphans=OrphansConfig(grace_seconds=30.0))
    now = [T0]
    paths = HostPaths(procfs=str(PROC), sysfs=str(tmp_path / "sys"), devfs=str(tmp_path / "dev"))
    daemon = Daemon(cfg, paths=paths, clock=lambda: now[0], write_state=False,
                    subsystems=[GpuSubsystem(watch_xid=False, watch_udev=False)])
    for sub in daemon.subsystems:
        sub.start(daemon)
    try:
        for t in (T0, T0 + 5.0, T0 + 40.0):  # the orphans outlive their 30 s grace
            now[0] = t
            daemon.cycle()
        text = generate_latest(daemon.registry).decode()
    finally:
        for sub in daemon.subsystems:
            sub.stop()
    text = DURATION.sub(lambda m: f"{m.group(1)} 0.0", text)
    text = re.sub(r"^gpuwatch_process_oom_score_adj \S+$", "gpuwatch_process_oom_score_adj 0.0", text, flags=re.M)
    return text.replace(f'"{pwd.getpwuid(os.stat(PROC).st_uid).pw_name}"', '"USER"')


def test_metrics_match_the_golden_file(tmp_path: Path) -> None:
    text = _exposition(tmp_path)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "run with UPDATE_GOLDEN=1 and review the diff"


def test_golden_file_is_deterministic(tmp_path: Path) -> None:
    assert _exposition(tmp_path / "a") == _exposition(tmp_path / "b")


def test_golden_file_passes_promtool_lint() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (apt: prometheus) is part of the test setup (scripts/test)"
    out = subprocess.run([promtool, "check", "metrics"], input=GOLDEN.read_bytes(),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
