"""gil.py (scheduler, convoy hint, counters), findings/gil_saturated.py and findings/stall.py, and the whole
py-spy path through the real daemon (`gpuwatchd run`) scraped over loopback."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemonutil import DaemonProc, has_finding, write_config

from gpuwatchd.config.schema import Config, GilConfig
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.gil import GilSampler
from gpuwatchd.daemon.gil_convoy import convoy_hint
from gpuwatchd.daemon.gil_schedule import GilTarget
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import gil_saturated as gil_finding
from gpuwatchd.findings import stall as stall_finding
from gpuwatchd.model import GilReading, GpuDevice, GpuProcessRow, RankState
from gpuwatchd.model.parts import GpuOutput, StallOutput, Tracked
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.model.threads import ThreadInfo
from gpuwatchd.paths import HostPaths
from gpuwatchd.rank import api
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.threads import read_threads

PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
BINARY = pyspy.resolve_pyspy()


def start(procs: list, program: str, *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, str(PROGRAMS / program), *args], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


# ----------------------------------------------------------------------------- convoy hint


def _t(tid: int, ticks: int, state: str = "S", wchan: str = "futex_do_wait") -> ThreadInfo:
    return ThreadInfo(tid, tid, "python", state, wchan, ticks, 0, 0)


def test_convoy_hint_rules() -> None:
    before = tuple(_t(i, 0) for i in range(4))
    # 4 threads each ~1/4 of a core over 2 s, 3 parked in futex: a convoy
    after = (_t(0, 50, "R", ""), *(_t(i, 50) for i in range(1, 4)))
    assert convoy_hint(before, after, 2.0, 100).convoy
    # 2 threads each a full core: real parallelism (GIL released), no convoy
    par = (_t(0, 200, "R", ""), _t(1, 200, "R", ""), _t(2, 0), _t(3, 0))
    assert not convoy_hint(before, par, 2.0, 100).convoy
    # one busy thread: a Python-bound loop, not contention between threads
    one = (_t(0, 200, "R", ""), _t(1, 0), _t(2, 0), _t(3, 0))
    assert not convoy_hint(before, one, 2.0, 100).convoy
    # busy threads parked in something else than a futex
    polling = tuple(_t(i, 0, "S", "do_sys_poll") for i in range(4))
    nofutex = tuple(_t(i, 50, "S", "do_sys_poll") for i in range(4))
    assert not convoy_hint(polling, nofutex, 2.0, 100).convoy
    assert not convoy_hint(before, after, 0.0, 100).convoy
    # the waiters were parked at the first look and all runnable (woken to ask for the GIL, or
    # queued for a core on a busy node) at the second: still a convoy
    queued = tuple(_t(i, 50, "R", "") for i in range(4))
    assert convoy_hint(before, queued, 2.0, 100).convoy
    assert not convoy_hint(tuple(_t(i, 0, "R", "") for i in range(4)), queued, 2.0, 100).convoy


def test_convoy_hint_on_real_processes(procs: list) -> None:
    """The hint is a state at two looks: a waiter woken to ask for the GIL, or read between its
    stat and its wchan, is not seen parked (measured here: about 4 % of reads, and on a full-suite
    run once all but one of the four waiters at both looks). The daemon looks again each cycle, so
    the convoy must show within three windows, and the I/O threads never."""
    cpu4 = start(procs, "cpu4.py")
    io4 = start(procs, "io4.py")
    paths = HostPaths()
    clk = os.sysconf("SC_CLK_TCK")
    seen = []
    for _ in range(3):
        b_cpu, b_io = read_threads(paths, cpu4.pid), read_threads(paths, io4.pid)
        time.sleep(1.5)
        h_cpu = convoy_hint(b_cpu, read_threads(paths, cpu4.pid), 1.5, clk)
        h_io = convoy_hint(b_io, read_threads(paths, io4.pid), 1.5, clk)
        assert not h_io.convoy and h_io.busy_threads == 0, h_io
        assert h_cpu.busy_threads >= 3 and 0.5 <= h_cpu.total_cores <= 1.4, h_cpu
        seen.append(h_cpu)
        if h_cpu.convoy:
            break
    assert seen[-1].convoy, seen


# ----------------------------------------------------------------------------- scheduler


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_schedule_is_jittered_and_spread() -> None:
    clock = FakeClock()
    s = GilSampler(PySpy(None), CounterStore(), interval_seconds=30, clock=clock, rng=random.Random(7))
    s.update_targets(GilTarget("j", r, 10_000_000 + r) for r in range(20))
    firsts = sorted(p.next_due for p in s.plan())
    assert firsts[0] >= 1000.0 and firsts[-1] <= 1030.0
    assert firsts[-1] - firsts[0] > 15  # spread, not a thundering herd
    assert len(s.due()) < 20
    clock.t = 1031.0
    due = s.due()
    assert len(due) == 20
    # after a (failed: py-spy absent) sample, the next one is interval ±20 % later
    for f in s.tick():
        f.result()
    nxt = [p.next_due - clock.t for p in s.plan()]
    assert len(nxt) == 20 and all(24.0 <= n <= 36.0 for n in nxt), nxt
    assert s.due() == []
    st = s.status()
    assert not st.success and "absent" in st.error
    # counters exist at 0 for every target from the start (increase() needs the first point)
    assert s.counters.get("rank_gil_samples", ("j", "3")) == 0.0
    assert ("j", "3") in s.counters.snapshot()["rank_gil_held_samples"]
    # a rank that went away is forgotten
    s.update_targets([GilTarget("j", 0, 10_000_000)])
    assert [t.key for t in s.targets()] == [("j", 0)]


def test_sampling_budget_limits_the_duty_cycle() -> None:
    clock = FakeClock()
    s = GilSampler(
        PySpy(None),
        CounterStore(),
        interval_seconds=30,
        duration_seconds=5,
        clock=clock,
        rng=random.Random(3),
        max_duty=0.25,
    )
    s.update_targets(GilTarget("j", r, 10_000_000 + r) for r in range(64))
    clock.t += 31  # every rank is due
    started = 0
    for _ in range(120):  # two simulated minutes, one tick per second
        for f in s.tick():  # each fails fast (no py-spy) and reschedules
            f.result()
            started += 1
        clock.t += 1
    # 10 s of burst capacity plus 0.25 sampled s per s over 120 s = 40 s = 8 samples of 5 s
    assert 6 <= started <= 9, started


def test_non_python_rank_is_skipped_not_a_collector_failure(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuwatchd.daemon.gil")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        clock = FakeClock()
        s = GilSampler(PySpy(BINARY), CounterStore(), interval_seconds=30, duration_seconds=1, clock=clock)
        assert s.sample_now(GilTarget("sh-job", 0, sleeper.pid)) is None
        assert s.status().success  # py-spy works; this rank just is not Python
        assert next(p for p in s.plan() if p.key == ("sh-job", 0)).next_due >= clock.t + 300
        assert f"GIL sample of pid {sleeper.pid} skipped: not_python" in caplog.text
        assert s.counters.get("rank_gil_samples", ("sh-job", "0")) == 0.0
        s.close()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sample_counts_into_counters(procs: list) -> None:
    p = start(procs, "cpu4.py")
    counters = CounterStore()
    s = GilSampler(PySpy(BINARY), counters, interval_seconds=30, duration_seconds=2)
    reading = s.sample_now(GilTarget("llm-7", 3, p.pid))
    assert reading is not None and reading.pid == p.pid
    assert counters.get("rank_gil_samples", ("llm-7", "3")) == reading.samples == 99
    held = counters.get("rank_gil_held_samples", ("llm-7", "3"))
    assert held == reading.held and held / reading.samples >= 0.8
    assert reading.top_functions[0][0] == "burn (cpu4.py)"
    assert s.status().success
    s.close()


class LatestJitter(random.Random):
    """Every jitter at its latest: a first sample one whole interval away, a convoy's a second."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_convoy_pulls_the_next_sample_forward(procs: list) -> None:
    cpu4 = start(procs, "cpu4.py")
    io4 = start(procs, "io4.py")
    s = GilSampler(PySpy(BINARY), CounterStore(), interval_seconds=3600, probe_seconds=1.0, rng=LatestJitter())
    s.update_targets([GilTarget("j", 0, cpu4.pid), GilTarget("j", 1, io4.pid)])
    assert all(p.next_due >= time.monotonic() + 3000 for p in s.plan())  # far away: an hour
    assert s.due() == []  # first probe only takes the baseline
    due: list[GilTarget] = []
    deadline = time.monotonic() + 8
    while not due and time.monotonic() < deadline:  # probes every second, like the daemon's tick
        time.sleep(1.1)
        due = s.due()
    assert [t.rank for t in due] == [0]  # the convoy is due within ~1 s of its hint; io4 is not
    assert s.convoys()[("j", 0)].busy_threads >= 2
    # io4 uses too little CPU for a convoy: its threads are not even read (one stat per probe)
    io_hint = s.convoys().get(("j", 1))
    assert io_hint is None or not io_hint.convoy
    s.close()


# ----------------------------------------------------------------------------- findings


def _rank(rank: int = 3, pid: int = 4821, gpus: tuple[str, ...] = ("0",)) -> RankState:
    return RankState("llm-7", rank, pid, rank, 8, True, None, gpus=gpus)


def _gpu(util: float | None) -> GpuDevice:
    return GpuDevice(0, "GPU-aaaa", "NVIDIA H200", "0000:3b:00.0", 1 << 37, 1 << 30, util)


def _ctx(
    ranks: tuple[RankState, ...], gpus: tuple[GpuDevice, ...] = (), parts: Tracked | None = None, **extras: object
) -> FindingContext:
    cfg = Config(gil=GilConfig(held_threshold=0.8))
    parts = dataclasses.replace(parts or Tracked(), gpu=GpuOutput(gpus=gpus))
    return FindingContext(now=2000.0, config=cfg, ranks=ranks, parts=parts, **extras)  # type: ignore[arg-type]


def test_gil_saturated_fires_only_when_the_gpu_waits() -> None:
    hot = (
        GilReading(4821, 249, 240, (("collate (loader.py)", 200), ("step (train.py)", 40))),
        GilReading(4821, 249, 245, (("collate (loader.py)", 230),)),
    )
    gil = {("llm-7", 3): hot}
    (f,) = gil_finding.find(_ctx((_rank(),), (_gpu(0.12),), parts=Tracked(stall=StallOutput(gil=gil))))
    assert (f.kind, f.severity, f.job_id, f.rank, f.pid) == ("gil_saturated", "warning", "llm-7", "3", "4821")
    assert "97%" in f.explanation and "GPU 0 was 12% busy" in f.explanation
    assert "collate (loader.py) 89%" in f.explanation
    assert f.evidence["top_functions"][0][0] == "collate (loader.py)"
    # unknown utilisation still fires, saying so
    (f,) = gil_finding.find(_ctx((_rank(),), (_gpu(None),), parts=Tracked(stall=StallOutput(gil=gil))))
    assert "GPU utilisation unknown" in f.explanation
    # a busy GPU: Python is not the bottleneck
    assert list(gil_finding.find(_ctx((_rank(),), (_gpu(0.95),), parts=Tracked(stall=StallOutput(gil=gil))))) == []
    # one hot sample is not "stays above"; a cool last sample clears it
    assert list(gil_finding.find(_ctx((_rank(),), parts=Tracked(stall=StallOutput(gil={("llm-7", 3): hot[:1]}))))) == []
    cool = (*hot, GilReading(4821, 249, 50))
    assert list(gil_finding.find(_ctx((_rank(),), parts=Tracked(stall=StallOutput(gil={("llm-7", 3): cool}))))) == []
    # readings of an earlier PID of the same rank do not count
    assert list(gil_finding.find(_ctx((_rank(pid=99),), parts=Tracked(stall=StallOutput(gil=gil))))) == []


def test_gil_saturated_sees_the_gpu_a_discovered_rank_holds() -> None:
    """A rank found by discovery (torchrun's environment) names no GPU: the GPU its tree holds
    memory on is its own, as for the stall rules, so a busy one means Python is not the
    bottleneck (read through the rank file's GPUs only, it was "GPU utilisation unknown" and
    fired)."""
    hot = (GilReading(4821, 249, 240), GilReading(4821, 249, 245))
    held = (GpuProcessRow(0, "GPU-aaaa", 4821, 1 << 30, "python", "u", "llm-7", "3"),)
    ctx = _ctx(
        (_rank(gpus=()),), (_gpu(0.95),), gpu_processes=held, parts=Tracked(stall=StallOutput(gil={("llm-7", 3): hot}))
    )
    assert list(gil_finding.find(ctx)) == []
    ctx = _ctx(
        (_rank(gpus=()),), (_gpu(0.12),), gpu_processes=held, parts=Tracked(stall=StallOutput(gil={("llm-7", 3): hot}))
    )
    (f,) = gil_finding.find(ctx)
    assert "GPU 0 was 12% busy" in f.explanation


def test_rank_stalled_explains_frames_and_suspect() -> None:
    frames = ("all_reduce (distributed_c10d.py:2501)", "step (train.py:88)", "<module> (train.py:120)")
    peer = StallVerdict(
        "llm-7",
        0,
        100,
        True,
        1000.0,
        True,
        "stack",
        400.0,
        frames,
        "21 threads: 20 S futex_do_wait, 1 R",
        ("all_reduce (distributed_c10d.py)",),
    )
    odd = StallVerdict(
        "llm-7",
        3,
        103,
        True,
        1000.0,
        True,
        "heartbeat",
        400.0,
        ("load_batch (data.py:41)",),
        "5 threads: 5 S",
        ("load_batch (data.py)",),
        suspect=True,
        suspect_reason="stuck in load_batch (data.py), while 3 peer(s) are stuck in all_reduce (distributed_c10d.py)",
    )
    ranks = (
        RankState("llm-7", 0, 100, 0, 4, True, None, stalled=True),
        RankState("llm-7", 3, 103, 3, 4, True, None, stalled=True),
    )
    found = {
        f.rank: f
        for f in stall_finding.find(
            _ctx(ranks, parts=Tracked(stall=StallOutput(verdicts={("llm-7", 0): peer, ("llm-7", 3): odd})))
        )
    }
    assert set(found) == {"0", "3"}
    f0 = found["0"]
    assert f0.kind == "rank_stalled" and f0.severity == "page"
    assert "made no progress for 6m40s (last progress 00:16:40 UTC)" in f0.explanation
    assert "all_reduce (distributed_c10d.py:2501) <- step (train.py:88)" in f0.explanation
    assert "suspect: rank 3 (pid 103) stuck in load_batch" in f0.explanation
    assert f0.evidence["suspect_ranks"] == [3]
    assert "odd one out" in found["3"].explanation and "no heartbeat" in found["3"].explanation
    # the join decides alive/stalled: a rank it does not call stalled has no finding
    calm = (RankState("llm-7", 0, 100, 0, 4, True, None, stalled=False),)
    assert list(stall_finding.find(_ctx(calm, parts=Tracked(stall=StallOutput(verdicts={("llm-7", 0): peer}))))) == []


# ----------------------------------------------------------------------------- through the daemon


def test_daemon_end_to_end_gil_and_stall(tmp_path: Path, procs: list) -> None:
    cfg_path, cfg = write_config(
        tmp_path,
        gil={"enabled": True, "interval_seconds": 2, "duration_seconds": 1, "rate_hz": 50, "timeout_seconds": 10},
        stall={"after_seconds": 1.5},
    )
    rank_dir = cfg["rank_dir"]
    cpu4 = start(procs, "cpu4.py")
    api.register_rank("gil-job", 0, pid=cpu4.pid, rank_dir=rank_dir, heartbeat=False, cuda_oom_hook=False, strict=True)
    start(procs, "rank.py", "beat_then_lock", rank_dir, "hang-job", "1")
    d = DaemonProc(cfg_path, cfg)
    try:
        d.wait_for(
            lambda: (d.value("gpuwatch_rank_gil_samples_total", job_id="gil-job", rank="0") or 0) >= 2 * 49,
            timeout=30,
            what="two GIL samples",
        )
        samples = d.value("gpuwatch_rank_gil_samples_total", job_id="gil-job", rank="0")
        held = d.value("gpuwatch_rank_gil_held_samples_total", job_id="gil-job", rank="0")
        assert samples and held is not None and held / samples >= 0.8
        assert d.value("gpuwatch_collector_success", collector="pyspy") == 1.0
        d.wait_for(
            lambda: has_finding(d, "gil_saturated", job_id="gil-job", rank="0"), timeout=20, what="gil_saturated"
        )
        d.wait_for(
            lambda: d.value("gpuwatch_rank_stalled", job_id="hang-job", rank="1") == 1.0,
            timeout=20,
            what="hang-job stalled",
        )
        assert has_finding(d, "rank_stalled", job_id="hang-job", rank="1")
        hb = os.path.join(rank_dir, "hang-job.1.hb")
        assert d.value("gpuwatch_rank_progress_timestamp_seconds", job_id="hang-job", rank="1") == pytest.approx(
            os.stat(hb).st_mtime
        )
        assert d.value("gpuwatch_rank_stalled", job_id="gil-job", rank="0") == 0.0
        text = d.text()
        assert "burn" not in text  # function names never become labels
    finally:
        assert d.stop() == 0
    log = d.log_path.read_text(errors="replace")
    assert "Traceback" not in log


def test_daemon_without_pyspy_reports_the_collector_down(tmp_path: Path, procs: list) -> None:
    cfg_path, cfg = write_config(
        tmp_path,
        gil={"enabled": True, "interval_seconds": 1, "duration_seconds": 1, "pyspy_path": str(tmp_path / "no-py-spy")},
        stall={"after_seconds": 1.0},
    )
    rank_dir = cfg["rank_dir"]
    start(procs, "rank.py", "beat_then_lock", rank_dir, "hang-job", "0")
    d = DaemonProc(cfg_path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_collector_success", collector="pyspy") == 0.0, what="pyspy collector down")
        # heartbeat-based stall detection keeps working without py-spy
        d.wait_for(
            lambda: has_finding(d, "rank_stalled", job_id="hang-job", rank="0"), what="rank_stalled without py-spy"
        )
        assert d.value("gpuwatch_rank_up", job_id="hang-job", rank="0") == 1.0
    finally:
        assert d.stop() == 0
    assert "py-spy unavailable" in d.log_path.read_text(errors="replace")


def test_daemon_with_a_hanging_pyspy_stays_healthy(tmp_path: Path, procs: list) -> None:
    """A stand-in py-spy that never exits: every run is killed at the time-out with its process
    group, the collector says why, and heartbeat stall detection and scrapes keep working."""
    pids = tmp_path / "pids"
    pids.mkdir()
    hang = tmp_path / "py-spy"
    hang.write_text(f"#!/bin/sh\necho $$ > {pids}/$$\nsleep 1000 &\necho $! > {pids}/$!\nwait\n")
    hang.chmod(0o755)
    cfg_path, cfg = write_config(
        tmp_path,
        gil={
            "enabled": True,
            "interval_seconds": 1,
            "duration_seconds": 1,
            "timeout_seconds": 2,
            "pyspy_path": str(hang),
        },
        stall={"after_seconds": 1.0},
    )
    rank_dir = cfg["rank_dir"]
    start(procs, "rank.py", "beat_then_lock", rank_dir, "hang-job", "0")
    cpu4 = start(procs, "cpu4.py")
    api.register_rank("gil-job", 0, pid=cpu4.pid, rank_dir=rank_dir, heartbeat=False, cuda_oom_hook=False, strict=True)
    d = DaemonProc(cfg_path, cfg)
    try:
        d.wait_for(
            lambda: d.value("gpuwatch_collector_success", collector="pyspy") == 0.0,
            timeout=30,
            what="pyspy collector down (timeout)",
        )
        d.wait_for(
            lambda: has_finding(d, "rank_stalled", job_id="hang-job", rank="0"),
            timeout=20,
            what="rank_stalled with a hanging py-spy",
        )
        t0 = time.monotonic()
        d.text()
        assert time.monotonic() - t0 < 1.0  # a scrape never waits for py-spy
        cycle = d.value("gpuwatch_cycle_duration_seconds")
        assert cycle is not None and cycle < 2.0  # dumps never wait for a busy py-spy slot
    finally:
        assert d.stop() == 0
    log = d.log_path.read_text(errors="replace")
    assert "timeout" in log and "Traceback" not in log
    time.sleep(0.5)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) >= 2
    alive = [
        p
        for p in started
        if os.path.exists(f"/proc/{p}") and "sleep" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
    ]
    assert alive == [], f"stand-in processes survived: {alive}"


def test_tick_after_close_starts_nothing_and_raises_nothing() -> None:
    # the daemon's scheduler thread may tick once more while shutdown closes the pool (device
    # run: "gil-sampler crashed: RuntimeError: cannot schedule new futures after shutdown")
    clock = FakeClock()
    s = GilSampler(PySpy(None), CounterStore(), interval_seconds=30, clock=clock, rng=random.Random(7))
    s.update_targets(GilTarget("j", r, 10_000_000 + r) for r in range(4))
    clock.t = 1100.0
    s.close()
    assert s.tick() == []
