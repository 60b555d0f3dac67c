"""The whole pipeline, byte for byte, like node_exporter's end-to-end test.

A recorded /proc tree (tests/fixtures/proc/golden, written by tools/make_proc_fixture.py) and an
NVML recording (tests/fixtures/nvml/h200_orphan_dataloader.json) go through the real daemon's
cycles (rank files, /proc, the GPU, py-spy, kernel-log, memory and straggler subsystems, the join,
the findings) with a fixed clock, and the
/metrics text it serves over a real socket, in both formats, is compared with
tests/fixtures/golden/metrics.txt (text 0.0.4) and metrics.openmetrics.txt (OpenMetrics 1.0.0):
the bytes a scraper gets, not a re-rendering. Any change to a metric name, label, value, help
text or to how a value is written shows up here as a diff.

Beside the GPU: py-spy is absent (an explicit runner without a binary: the ``pyspy`` collector
down, stall verdicts from /proc); the kernel log is ``off`` (its collector down, its counters at
0); host memory reads a cgroup v2 tree written under the test's /sys (the rank's
``system.slice/golden.service``) and the fixture's /proc/meminfo and /proc/pressure/memory (copied
from tests/fixtures/memcg/v2); the rank beats ``heartbeat(step)``: before each cycle the test
writes a step into the rank's heartbeat file and sets its mtime, as ``gpuwatchd.heartbeat`` does,
and the straggler subsystem reads it back through the daemon's heartbeat roots
(``gpuwatch_rank_step``, ``gpuwatch_rank_progress_timestamp_seconds``). One rank has no peer to be
slower than, so no ``rank_straggler`` finding (tests/test_straggler.py pages on one).
``SAMPLED`` lists the families of those subsystems that must have a sample: a regeneration that
loses one fails here, whatever the golden file then says.

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_exposition.py   # regenerate

The only values that depend on the machine are the collectors' wall-clock durations (replaced by
0), the daemon's own /proc/self/oom_score_adj and process_* self-metrics (replaced by 0;
tests/test_exposition_formats.py compares those with client_python's ProcessCollector), the
memory limit of the test's own cgroup (left out: tests/test_liveness.py checks it) and the
user name of the fixture's
owner (replaced by ``USER``). RSS is pages times the page size: the golden file is for 4 KiB pages
(x86-64, where CI runs).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

from gpuwatchd.config.schema import Config, MemoryConfig, NvmlConfig, OrphansConfig
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.kernel_log import KernelLogSubsystem
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.stall import StallSubsystem
from gpuwatchd.daemon.straggler import StragglerSubsystem
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.paths import HostPaths
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.web.server import serve

HERE = Path(__file__).resolve().parent
PROC = HERE / "fixtures" / "proc" / "golden"
NVML = HERE / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
GOLDEN = HERE / "fixtures" / "golden" / "metrics.txt"
GOLDEN_OM = HERE / "fixtures" / "golden" / "metrics.openmetrics.txt"
OPENMETRICS = "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,*/*;q=0.1"
T0 = 1795935723.0  # the NVML recording's first cycle
HEARTBEATS = {T0: (T0 - 1.0, 1200), T0 + 5.0: (T0 + 4.0, 1260), T0 + 40.0: (T0 + 39.5, 1680)}
# Each subsystem's families that the fixture gives a sample: (family, a label set it must carry).
SAMPLED = {
    "straggler": [("gpuwatch_rank_step", '{job_id="golden",rank="0"}')],
    "progress": [
        ("gpuwatch_rank_progress_timestamp_seconds", '{job_id="golden",rank="0"}'),
        ("gpuwatch_rank_stalled", '{job_id="golden",rank="0"}'),
    ],
    "pyspy": [
        ("gpuwatch_collector_success", '{collector="pyspy"}'),
        ("gpuwatch_rank_gil_samples_total", '{job_id="golden",rank="0"}'),
        ("gpuwatch_cycle_deferred_probes_total", '{probe="dump"}'),
    ],
    "kernel_log": [
        ("gpuwatch_collector_success", '{collector="kernel_log"}'),
        ("gpuwatch_kernel_log_overruns_total", ""),
    ],
    "memory": [
        ("gpuwatch_rank_memory_cgroup_usage_bytes", '{job_id="golden",rank="0"}'),
        ("gpuwatch_node_memory_available_bytes", ""),
    ],
}
DURATION = re.compile(r"^(gpuwatch_\w*duration_seconds\w*(?:\{[^}]*\})?|gpuwatch_cycle_seconds\w*) \S+$", re.M)


def _served(registry: object, accept: str | None) -> str:
    server = serve(registry, "127.0.0.1:0")  # type: ignore[arg-type]
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.address[1]}/metrics", headers={"Accept": accept} if accept else {}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()
    finally:
        server.close()


CGROUP = {  # the rank's cgroup v2 (its /proc/447/cgroup: 0::/system.slice/golden.service)
    "cgroup.controllers": "cpuset cpu io memory pids\n",
    "system.slice/golden.service/memory.current": "6442450944\n",
    "system.slice/golden.service/memory.max": "8589934592\n",
    "system.slice/golden.service/memory.high": "max\n",
    "system.slice/golden.service/memory.stat": "anon 6227702579\nfile 214748365\ninactive_file 107374182\n",
    "system.slice/golden.service/memory.pressure": (
        "some avg10=1.25 avg60=0.40 avg300=0.10 total=4500000\nfull avg10=0.25 avg60=0.10 avg300=0.02 total=1500000\n"
    ),
}


def _exposition(tmp_path: Path, accept: str | None = None) -> str:
    rank_dir = tmp_path / "ranks"
    heartbeat = tmp_path / "golden.0.hb"
    for name, text in CGROUP.items():
        f = tmp_path / "sys" / "fs" / "cgroup" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    write_rank_file(
        str(rank_dir),
        {
            "version": 1,
            "job_id": "golden",
            "world_size": 1,
            "ranks": [
                {
                    "rank": 0,
                    "local_rank": 0,
                    "pid": 447,
                    "gpus": ["0"],
                    "start_ticks": 571200,
                    "heartbeat": str(heartbeat),
                }
            ],
        },
        "golden.json",
    )
    cfg = Config(
        rank_dir=str(rank_dir),
        state_dir=str(tmp_path / "state"),
        procfs=str(PROC),
        nvml=NvmlConfig(fixture=str(NVML)),
        orphans=OrphansConfig(grace_seconds=30.0),
        kernel_log="off",
        memory=MemoryConfig(min_window_seconds=10.0),
    )
    now = [T0]
    paths = HostPaths(procfs=str(PROC), sysfs=str(tmp_path / "sys"), devfs=str(tmp_path / "dev"))
    daemon = Daemon(
        cfg,
        paths=paths,
        clock=lambda: now[0],
        write_state=False,
        parts=lambda c, s: Parts(
            stall=StallSubsystem(c, s, spy=PySpy(None, unavailable_reason="not installed")),
            straggler=StragglerSubsystem(c, s),
            kernel_log=KernelLogSubsystem(c, s),
            nvml=NvmlSubsystem(c, s, watch_xid=False, watch_udev=False),
            memory=MemorySubsystem(c, s, spy=PySpy(None)),
        ),
    )
    for sub in daemon.subsystems:
        sub.start(daemon)
    try:
        for t in (T0, T0 + 5.0, T0 + 40.0):  # the orphans outlive their 30 s grace
            now[0] = t
            beat_at, step = HEARTBEATS[t]
            heartbeat.write_text(str(step))
            os.utime(heartbeat, (beat_at, beat_at))
            daemon.cycle()
        text = _served(daemon.registry, accept)
    finally:
        for sub in daemon.subsystems:
            sub.stop()
    text = DURATION.sub(lambda m: f"{m.group(1)} 0.0", text)
    text = re.sub(r"^gpuwatch_process_oom_score_adj \S+$", "gpuwatch_process_oom_score_adj 0.0", text, flags=re.M)
    text = re.sub(r"^(process_\w+) \S+$", r"\1 0.0", text, flags=re.M)
    # the limit of the test process's own cgroup: present only where the machine sets one
    text = re.sub(r"^(# (HELP|TYPE) )?gpuwatch_process_memory_limit_bytes\b.*\n", "", text, flags=re.M)
    return text.replace(f'"{pwd.getpwuid(os.stat(PROC).st_uid).pw_name}"', '"USER"')


def test_metrics_match_the_golden_file(tmp_path: Path) -> None:
    for golden, accept in ((GOLDEN, None), (GOLDEN_OM, OPENMETRICS)):
        text = _exposition(tmp_path / golden.name, accept)
        if os.environ.get("UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert text == golden.read_text(), f"{golden.name}: run with UPDATE_GOLDEN=1 and review the diff"


def test_every_subsystem_family_has_its_sample() -> None:
    for golden in (GOLDEN, GOLDEN_OM):
        text = golden.read_text()
        for subsystem, families in SAMPLED.items():
            for family, labels in families:
                assert re.search(rf"^{family}{re.escape(labels)} \S+$", text, re.M), (
                    f"{golden.name}: no {family}{labels} sample ({subsystem})"
                )
    assert 'gpuwatch_rank_step{job_id="golden",rank="0"} 1680.0' in GOLDEN.read_text()


def test_golden_file_is_deterministic(tmp_path: Path) -> None:
    assert _exposition(tmp_path / "a") == _exposition(tmp_path / "b")


def test_golden_file_passes_promtool_lint() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (apt: prometheus) is part of the test setup (scripts/test)"
    out = subprocess.run([promtool, "check", "metrics"], input=GOLDEN.read_bytes(), capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
