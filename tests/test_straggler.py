"""Slow, not stopped: three real ranks beat heartbeat(step) through the real daemon; one runs in a
real cpu cgroup whose CFS quota holds it to 10 % of a core. The daemon exports every rank's step
and names the throttled rank a straggler, with CPU throttling from its cgroup's cpu.stat as the
cause. Also: NVML clock-throttle reasons (a derived replay) as a cause, and the rate rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from gpuwatchd.config.schema import Config, StragglerConfig
from gpuwatchd.findings import FindingContext, rank_straggler
from gpuwatchd.model import GpuDevice, RankState
from gpuwatchd.model.parts import GpuOutput, RankRate, StragglerOutput, Tracked
from gpuwatchd.sources.cgroup_cpu import parse_cpu_stat
from gpuwatchd.sources.heartbeat_step import read_step
from gpuwatchd.sources.memcg import parse_cgroup_file
from gpuwatchd.sources.nvml_fixture import fixture_source

PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
NVML = Path(__file__).parent / "fixtures" / "nvml"
CPU_ROOT = "/sys/fs/cgroup/cpu"


class CpuCgroup:
    """A uniquely named cgroup-v1 cpu cgroup with a CFS quota (removed on close)."""

    def __init__(self, quota_us: int, period_us: int = 100_000) -> None:
        self.path = os.path.join(CPU_ROOT, f"gwhangs-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self._write("cpu.cfs_period_us", period_us)
        self._write("cpu.cfs_quota_us", quota_us)

    def _write(self, name: str, value: int) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", pid)

    def close(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            for pid in f.read().split():
                with open(os.path.join(CPU_ROOT, "cgroup.procs"), "w") as root:
                    root.write(pid)
        os.rmdir(self.path)


def test_throttled_rank_is_named_a_straggler_with_its_cgroup_as_cause(tmp_path: Path) -> None:
    from daemonutil import DaemonProc, write_config

    cfg_path, cfg = write_config(tmp_path, straggler={"window_seconds": 3.0, "ratio": 0.8, "for_seconds": 2.0})
    cg = CpuCgroup(quota_us=10_000)
    ranks = []
    try:
        for r in range(3):
            p = subprocess.Popen(
                [sys.executable, str(PROGRAMS / "hang_rank.py"), "train", cfg["rank_dir"], "slow-job", str(r)],
                stdout=subprocess.PIPE,
                text=True,
            )
            ranks.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        cg.add(ranks[2].pid)
        d = DaemonProc(cfg_path, cfg)
        try:
            state = Path(cfg["state_dir"]) / "state.json"

            def finding() -> dict:
                try:
                    doc = json.loads(state.read_text())
                except (OSError, ValueError):
                    return {}
                return next((f for f in doc["findings"] if f["kind"] == "rank_straggler"), {})

            d.wait_for(lambda: bool(finding()), timeout=40, what="rank_straggler")
            f = finding()
            print(f["explanation"])
            assert f["rank"] == "2" and f["severity"] == "warning"
            assert "is a straggler: " in f["explanation"] and "(ranks 0, 1, 2)" in f["explanation"]
            assert "CPU throttled by its cgroup: " in f["explanation"]
            assert f["evidence"]["ratio"] < 0.8 and f["evidence"]["throttled_periods"] > 0
            steps = {r: d.value("gpuwatch_rank_step", job_id="slow-job", rank=str(r)) for r in range(3)}
            assert all(v is not None and v > 0 for v in steps.values()), steps
            assert steps[2] < min(steps[0], steps[1]), steps  # type: ignore[type-var]
            assert d.value("gpuwatch_finding", kind="rank_straggler", rank="0") is None
        finally:
            assert d.stop() == 0
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        cg.close()


def test_step_file_rules(tmp_path: Path) -> None:
    hb = tmp_path / "j.0.hb"
    hb.write_text("1234\n")
    assert read_step(str(hb), os.getuid()) == 1234
    assert read_step(str(hb), 54321) is None  # someone else's file
    link = tmp_path / "link.hb"
    link.symlink_to(hb)
    assert read_step(str(link), None) is None
    for junk in ("", "-3", "12abc", "9" * 40):
        hb.write_text(junk)
        assert read_step(str(hb), None) is None


def test_cpu_stat_v1_and_v2() -> None:
    v1 = parse_cpu_stat("nr_periods 90\nnr_throttled 87\nthrottled_time 4200000000\n")
    assert v1 is not None and (v1.periods, v1.throttled_periods, v1.throttled_seconds) == (90, 87, 4.2)
    v2 = parse_cpu_stat("usage_usec 10\nnr_periods 5\nnr_throttled 2\nthrottled_usec 1500000\n")
    assert v2 is not None and v2.throttled_seconds == 1.5
    assert parse_cpu_stat("usage_usec 10\n") is None


def test_gpu_clock_throttle_reasons_from_nvml_name_a_cause() -> None:
    """derived_throttled.json: h200_idle.json with clocks_event_reasons HW thermal + SW power cap."""
    devices, _ = fixture_source(str(NVML / "derived_throttled.json")).read()
    assert devices[0].throttle_reasons == 0x44
    idle, _ = fixture_source(str(NVML / "h200_idle.json")).read()
    assert idle[0].throttle_reasons is None  # recorded before the field: the driver "does not say"
    r = RankState("j", 1, 11, 1, 2, True, None, gpus=("0",))
    rr = RankRate("j", 1, 11, 2.0, 300.0, 10.0, (0, 1), 0.0, True)
    ctx = FindingContext(
        now=400.0,
        config=Config(),
        ranks=(r,),
        parts=Tracked(gpu=GpuOutput(gpus=devices), straggler=StragglerOutput(rates={("j", 1): rr})),
    )
    (f,) = rank_straggler.find(ctx, ())
    assert "GPU 0 clocks throttled: sw_power_cap, hw_thermal (NVML)" in f.explanation
    assert "0.20x its job's median of 10.00 steps/s" in f.explanation


def test_rank_memory_pressure_is_named_by_kind_when_present() -> None:
    from gpuwatchd.model import Finding

    r = RankState("j", 1, 11, 1, 2, True, None)
    rr = RankRate("j", 1, 11, 2.0, 300.0, 10.0, (0, 1), 0.0, True)
    ctx = FindingContext(
        now=400.0,
        config=Config(),
        ranks=(r,),
        parts=Tracked(
            gpu=GpuOutput(gpus=(GpuDevice(0, "u", "n", "p", None, None, None),)),
            straggler=StragglerOutput(rates={("j", 1): rr}),
        ),
    )
    mem = Finding("rank_memory_pressure", "warning", "x", "j", "1", "11")
    (f,) = rank_straggler.find(ctx, (mem,))
    assert "causes: host memory pressure (rank_memory_pressure)" in f.explanation
    (f,) = rank_straggler.find(ctx, ())
    assert "no cause visible to gpuwatchd" in f.explanation


def _observe(t: Any, reader: Any, now: float, entries: list[Any], mtimes: dict[tuple[str, int], float]) -> Any:
    """One cycle as daemon/straggler.py runs it: the due steps and the cpu.stat read (of the cgroup
    the process view read for each rank), then judged."""
    cgroups = {e.pid: parse_cgroup_file(Path(f"/proc/{e.pid}/cgroup").read_text()) for e in entries}
    return t.observe(now, entries, mtimes, reader.steps(t.due(entries, mtimes)), reader.cpu_stats(entries, cgroups))


def test_tracker_needs_two_ranks_and_the_full_bound(tmp_path: Path) -> None:
    from gpuwatchd.join.straggler import StragglerTracker
    from gpuwatchd.model import RankEntry
    from gpuwatchd.sources.step_cpu import StepCpuReader

    cfg = StragglerConfig(window_seconds=10.0, ratio=0.8, for_seconds=5.0)
    t = StragglerTracker(cfg)
    reader = StepCpuReader()
    hbs = [tmp_path / f"j.{r}.hb" for r in range(2)]
    entries = [RankEntry("j", r, os.getpid(), heartbeat=str(hbs[r])) for r in range(2)]
    out = {}
    for i in range(30):
        now = 1000.0 + i
        for r, hb in enumerate(hbs):
            hb.write_text(str(i * (10 if r == 0 else 2)))
        _, out = _observe(t, reader, now, entries, {("j", 0): now, ("j", 1): now})
        if i < 10:
            assert not any(x.straggler for x in out.values())
    assert out[("j", 1)].straggler and not out[("j", 0)].straggler
    assert out[("j", 1)].rate == 2.0 and out[("j", 0)].rate == 10.0
    # alone, a rank has no median to be compared with
    _, solo = _observe(StragglerTracker(cfg), StepCpuReader(), 1000.0, entries[:1], {("j", 0): 1000.0})
    assert solo[("j", 0)].median is None


def test_a_cpu_stat_without_throttling_counters_is_not_looked_up_again_each_cycle(tmp_path: Path) -> None:
    """A cgroup v2 without the cpu controller (the H200 host of bench/nvml_poll.py) has a
    cpu.stat of usage only: the rank's cgroup used to be looked up from /proc/PID/cgroup again
    every cycle for every rank because of it. Its path is looked for again only when the file is
    gone (or the process view reads another cgroup for the rank)."""
    from gpuwatchd.join.straggler import StragglerTracker
    from gpuwatchd.model import RankEntry
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.step_cpu import StepCpuReader

    sys_root = tmp_path / "sys"
    found = []
    for line in Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)  # this process's real cgroup, v1 or v2
        mount = "cpu,cpuacct" if "cpu" in controllers.split(",") else "" if controllers == "" else None
        if mount is not None:
            d = sys_root / "fs" / "cgroup" / mount / path.lstrip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "cpu.stat").write_text("usage_usec 10\nuser_usec 8\nsystem_usec 2\n")
            found.append(d / "cpu.stat")
    assert found
    t = StragglerTracker(StragglerConfig(window_seconds=10.0))
    reader = StepCpuReader(HostPaths(sysfs=str(sys_root)))
    now = [1000.0]
    hb = tmp_path / "j.0.hb"
    hb.write_text("1")
    entries = [RankEntry("j", 0, os.getpid(), heartbeat=str(hb))]
    for i in range(5):
        now[0] = 1000.0 + i
        _observe(t, reader, 1000.0 + i, entries, {("j", 0): 1000.0 + i})
    assert reader.path_lookups == 1  # was 5
    for f in found:
        f.unlink()
    now[0] = 1005.0
    _observe(t, reader, 1005.0, entries, {("j", 0): 1005.0})
    assert reader.path_lookups == 1
    now[0] = 1006.0
    _observe(t, reader, 1006.0, entries, {("j", 0): 1006.0})
    assert reader.path_lookups == 2  # gone: looked for again at the next cycle
