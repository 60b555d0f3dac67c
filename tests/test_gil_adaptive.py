"""The adaptive GIL schedule: the cycle's signals (daemon/gil_signals.py), screening vs full samples
(daemon/gil.py), and the stated bound on the time to ``gil_saturated`` (``saturation_bound``)
measured on real processes with real py-spy: through the real daemon for a rank that turns
GIL-bound among healthy ones, and at the sampler for a GIL-bound rank that shows no signal."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from daemonutil import DaemonProc, has_finding, write_config
from test_gil import BINARY, start

from gpuwatchd.config.schema import Config, ConfigError, GilConfig, parse_config
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.gil import SCREEN_RATE_HZ, GilSampler
from gpuwatchd.daemon.gil_schedule import GilTarget
from gpuwatchd.daemon.gil_signals import (
    GPU_IDLE_ON_CPU,
    HEARTBEAT_SLOWING,
    STALLED,
    RankSignals,
    SignalTracker,
    saturation_bound,
)
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import gil_saturated as gil_finding
from gpuwatchd.model import GpuDevice, GpuProcessRow, NodeState, ProcessInfo, RankState
from gpuwatchd.model.parts import StallOutput, Tracked
from gpuwatchd.sources.pyspy import PySpy

# ----------------------------------------------------------------------------- signals


def _proc(pid: int, cpu: float) -> ProcessInfo:
    return ProcessInfo(pid, 1, "python", "R", 1000, "u", 1, 0.0, cpu, 1 << 20, 4, 10, 1024, 1024)


def _state(
    t: float,
    cpu: float,
    *,
    util: float | None = None,
    step: int | None = None,
    beat: float | None = None,
    stalled: bool = False,
    pid: int = 4821,
) -> NodeState:
    rank = RankState(
        "llm", 0, pid, 0, 8, True, _proc(pid, cpu), gpus=("0",), progress_timestamp=beat, stalled=stalled, step=step
    )
    gpu = GpuDevice(0, "GPU-a", "NVIDIA H200", "0000:3b:00.0", 1 << 37, 1 << 30, util)
    return NodeState(timestamp=t, ranks=(rank,), gpus=(gpu,))


def test_signals_cpu_while_the_gpu_waits() -> None:
    tr = SignalTracker(cycle_seconds=5)
    first = tr.observe(_state(100, 10.0, util=0.0))[("llm", 0)]
    assert first.cpu_cores is None and first.reasons == ()  # one reading: no rate yet
    s = tr.observe(_state(105, 14.5, util=0.0))[("llm", 0)]
    assert s.cpu_cores == pytest.approx(0.9) and s.reasons == (GPU_IDLE_ON_CPU,)
    # GPU utilisation unknown: the CPU alone makes it suspect
    assert tr.observe(_state(110, 19.0))[("llm", 0)].reasons == (GPU_IDLE_ON_CPU,)
    # the GPU busy: healthy whatever the CPU (gil_saturated cannot fire for it)
    busy = tr.observe(_state(115, 23.5, util=0.95))[("llm", 0)]
    assert busy.gpu_busy and busy.reasons == ()
    # a quiet process on an idle GPU (the device's torch holders): healthy
    assert tr.observe(_state(120, 23.55, util=0.0))[("llm", 0)].reasons == ()


def test_signals_see_the_gpu_a_discovered_rank_holds() -> None:
    """A discovered rank names no GPU: the busy GPU its tree holds memory on makes it healthy
    for the GIL schedule, as for gil_saturated (not "GPU idle while on CPU")."""
    tr = SignalTracker(cycle_seconds=5)
    for t, cpu in ((100, 10.0), (105, 14.5)):
        rank = RankState("llm", 0, 4821, 0, 8, True, _proc(4821, cpu), gpus=())
        gpu = GpuDevice(0, "GPU-a", "NVIDIA H200", "0000:3b:00.0", 1 << 37, 1 << 30, 0.95)
        row = GpuProcessRow(0, "GPU-a", 4821, 1 << 30, "python", "u", "llm", "0")
        s = tr.observe(NodeState(timestamp=t, ranks=(rank,), gpus=(gpu,), gpu_processes=(row,)))[("llm", 0)]
    assert s.gpu_busy and s.reasons == ()


def test_a_ranks_gpus_from_the_index_of_held_gpus_are_those_from_its_rows() -> None:
    """``held_by_rank`` (made once a cycle for the signals of every rank) gives each rank the
    GPUs that filtering the rows for it gives: its own rows only, not another job's rank of the
    same number, not a process in no rank's tree; the GPUs its rank file names besides."""
    from gpuwatchd.model.gpus import held_by_rank, rank_gpu_devices

    gpus = [GpuDevice(i, f"GPU-{i}", "NVIDIA H200", f"0000:{i:02x}:00.0", 1 << 37, 1 << 30, 0.1 * i) for i in range(4)]
    rows = (
        GpuProcessRow(1, "GPU-1", 11, 1 << 30, "python", "u", "llm", "0"),
        GpuProcessRow(2, "GPU-2", 12, 1 << 30, "python", "u", "llm", "1"),
        GpuProcessRow(3, "GPU-3", 13, 1 << 30, "python", "u", "other", "0"),
        GpuProcessRow(0, "GPU-0", 14, 1 << 30, "python", "u", "", ""),
    )
    ranks = [
        RankState("llm", 0, 11, 0, 2, True, _proc(11, 1.0), gpus=("0",)),
        RankState("llm", 1, 12, 1, 2, True, _proc(12, 1.0), gpus=()),
        RankState("other", 0, 13, 0, 1, True, _proc(13, 1.0), gpus=("GPU-2",)),
        RankState("idle", 0, 15, 0, 1, True, _proc(15, 1.0), gpus=()),
    ]
    held = held_by_rank(rows)
    got = [[g.index for g in rank_gpu_devices(r, gpus, rows, held)] for r in ranks]
    assert got == [[g.index for g in rank_gpu_devices(r, gpus, rows)] for r in ranks]
    assert got == [[0, 1], [2], [2, 3], []]


def test_signals_heartbeat_slowing_and_stalled() -> None:
    tr = SignalTracker(cycle_seconds=5)
    t, step = 100.0, 0

    def cpu(at: float) -> float:  # 0.2 of a core: on CPU, below the GPU-idle signal's 0.3
        return 0.2 * (at - 100)

    for _ in range(6):  # 10 steps per second, heartbeat fresh
        assert tr.observe(_state(t, cpu(t), step=step, beat=t - 0.1))[("llm", 0)].reasons == ()
        t, step = t + 5, step + 50
    slow = tr.observe(_state(t, cpu(t), step=step - 40, beat=t - 0.1))[("llm", 0)]
    assert slow.reasons == (HEARTBEAT_SLOWING,)  # 2 steps per second against 10
    # a heartbeat that stopped: older than 3x its usual age plus a cycle
    late = tr.observe(_state(t + 5, cpu(t + 5), beat=t - 0.1 - 30))[("llm", 0)]
    assert HEARTBEAT_SLOWING in late.reasons
    stalled = tr.observe(_state(t + 10, cpu(t + 10), stalled=True))[("llm", 0)]
    assert STALLED in stalled.reasons
    # off CPU, a slow or stalled rank waits on something else: no GIL signal
    idle = tr.observe(_state(t + 15, cpu(t + 10), beat=t - 60, stalled=True))[("llm", 0)]
    assert idle.reasons == ()
    # a rank that went (or whose pid changed) is forgotten: no rate across two processes
    assert tr.observe(NodeState(timestamp=t + 15)) == {}
    assert tr.observe(_state(t + 20, 99.0, pid=999))[("llm", 0)].cpu_cores is None


# ----------------------------------------------------------------------------- schedule


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _healthy(pid: int) -> RankSignals:
    return RankSignals(pid, 0.0, False)


def _unknown(pid: int) -> RankSignals:
    """No signal, and its CPU not yet known (the first cycles of a rank)."""
    return RankSignals(pid, None, False)


def test_healthy_ranks_are_spread_over_the_healthy_interval_and_suspects_pulled_forward() -> None:
    clock = FakeClock()
    s = GilSampler(
        PySpy(None),
        CounterStore(),
        interval_seconds=30,
        clock=clock,
        rng=random.Random(5),
        healthy_interval_seconds=1800,
    )
    s.update_targets(GilTarget("j", r, 10_000_000 + r) for r in range(64))
    s.update_signals({("j", r): _healthy(10_000_000 + r) for r in range(64)})
    plan = {p.key: p for p in s.plan()}
    dues = sorted(p.next_due - clock.t for p in plan.values())
    assert dues[0] >= 0 and dues[-1] <= 1800 and dues[-1] - dues[0] > 900  # no start-up burst
    assert not any(p.full for p in plan.values()) and not any(p.reasons for p in plan.values())
    # one rank turns suspect: due at once, and its sample is a full one
    s.update_signals({("j", 7): RankSignals(10_000_007, 0.9, False, (GPU_IDLE_ON_CPU,))})
    p7 = next(p for p in s.plan() if p.key == ("j", 7))
    assert p7.full and p7.reasons == (GPU_IDLE_ON_CPU,) and p7.next_due == clock.t
    assert [t.rank for t in s.due()] == [7]
    # signals of another pid (a reused key) are ignored
    s.update_signals({("j", 8): RankSignals(1, 0.9, False, (GPU_IDLE_ON_CPU,))})
    assert not next(p for p in s.plan() if p.key == ("j", 8)).full


def test_an_idle_rank_is_screened_only_once_it_is_on_cpu() -> None:
    """A healthy rank below CPU_SUSPECT_CORES cannot hold the GIL HOT_RATIO of the time (py-spy
    counts a held tick only while the holder runs): its screening waits, overdue, and runs at
    the first cycle that finds it on CPU (its GPU busy: healthy, so a screening, not a full
    sample). Fails on the code before: the idle rank was due at once."""
    clock = FakeClock()
    s = GilSampler(
        PySpy(None),
        CounterStore(),
        interval_seconds=30,
        clock=clock,
        rng=random.Random(5),
        healthy_interval_seconds=1800,
    )
    s.update_targets([GilTarget("j", 0, 10_000_000), GilTarget("j", 1, 10_000_001)])
    s.update_signals({("j", 0): RankSignals(10_000_000, 0.08, False), ("j", 1): _unknown(10_000_001)})
    clock.t += 2200  # both overdue
    assert [t.rank for t in s.due()] == [1]  # the unknown one as before; the idle one waits
    s.update_signals({("j", 0): RankSignals(10_000_000, 1.0, True)})  # on CPU, its GPU busy
    plan = next(p for p in s.plan() if p.key == ("j", 0))
    assert not plan.full and not plan.reasons
    assert sorted(t.rank for t in s.due()) == [0, 1]


def test_a_screening_fits_the_budget_when_full_samples_are_shorter() -> None:
    """duration 0.3 s (tests): the token bucket holds 0.6 s, so a 1 s screening never ran."""
    clock = FakeClock()
    s = GilSampler(
        PySpy(None),
        CounterStore(),
        interval_seconds=0.5,
        duration_seconds=0.3,
        clock=clock,
        max_duty=0.2,
        healthy_interval_seconds=0.5,
    )
    s.update_targets([GilTarget("j", 0, 10_000_000)])
    clock.t += 1
    assert [t.rank for t in s.due()] == [0]


def test_a_gil_bound_screening_asks_for_the_full_sample_at_once(procs: list) -> None:
    cpu4 = start(procs, "cpu4.py")
    clock = FakeClock()
    counters = CounterStore()
    s = GilSampler(
        PySpy(BINARY), counters, interval_seconds=30, duration_seconds=2, clock=clock, healthy_interval_seconds=600
    )
    target = GilTarget("j", 0, cpu4.pid)
    s.update_targets([target])
    s.update_signals({target.key: _unknown(cpu4.pid)})  # looks healthy: its CPU not yet seen
    clock.t += 600
    futures = s.tick()
    assert len(futures) == 1
    futures[0].result(timeout=30)
    screen = s.latest(target.key)
    assert screen is not None and screen.samples == SCREEN_RATE_HZ - 1  # 1 s at 20 Hz
    assert screen.held / screen.samples >= 0.8
    plan = s.plan()[0]
    assert plan.full and "gil_bound" in plan.reasons and plan.next_due == clock.t
    futures = s.tick()
    futures[0].result(timeout=30)
    full = s.latest(target.key)
    assert full is not None and full.samples == 2 * 50 - 1 and full.held / full.samples >= 0.8
    assert counters.get("rank_gil_samples", ("j", "0")) == screen.samples + full.samples
    # the next full sample comes after the (suspect) interval, not the healthy one
    assert 24 <= s.plan()[0].next_due - clock.t <= 36
    s.close()


def test_a_rank_whose_finding_is_up_is_sampled_less_until_its_signals_change(procs: list) -> None:
    cpu4 = start(procs, "cpu4.py")
    clock = FakeClock()
    s = GilSampler(
        PySpy(BINARY),
        CounterStore(),
        interval_seconds=30,
        duration_seconds=1,
        clock=clock,
        healthy_interval_seconds=600,
        confirmed_ratio=0.8,
    )
    target = GilTarget("j", 0, cpu4.pid)
    s.update_targets([target])
    on_cpu = {target.key: RankSignals(cpu4.pid, 1.0, False, (GPU_IDLE_ON_CPU,))}
    s.update_signals(on_cpu)  # turns suspect: due at once
    (future,) = s.tick()
    future.result(timeout=30)
    assert 24 <= s.plan()[0].next_due - clock.t <= 36  # GIL-bound once: the interval
    clock.t = s.plan()[0].next_due
    (future,) = s.tick()
    future.result(timeout=30)  # twice: gil_saturated would be up
    assert 96 <= s.plan()[0].next_due - clock.t <= 144  # 4 intervals +-20 %, not one
    clock.t += 60
    assert s.due() == []
    s.update_signals(on_cpu)  # the same signals: no change
    assert s.due() == []
    # one more signal (a GIL-bound rank's heartbeat flickers): not a turn, no sample pulled in
    s.update_signals({target.key: RankSignals(cpu4.pid, 1.0, False, (GPU_IDLE_ON_CPU, HEARTBEAT_SLOWING))})
    assert s.due() == []
    for _ in range(2):  # its CPU drops for two cycles: a loaded node, maybe
        s.update_signals({target.key: _healthy(cpu4.pid)})
        assert s.due() == []
    s.update_signals({target.key: _healthy(cpu4.pid)})  # three: recovering?
    assert [t.rank for t in s.due()] == [0]  # look again now, so the finding clears soon
    s.close()


def test_config_healthy_interval() -> None:
    assert Config().gil.healthy_interval_seconds == 1800
    with pytest.raises(ConfigError, match=r"gil\.healthy_interval_seconds: must be at least"):
        parse_config({"gil": {"interval_seconds": 60, "healthy_interval_seconds": 30}})
    with pytest.raises(ConfigError, match=r"gil\.healthy_interval_seconds"):
        parse_config({"gil": {"healthy_interval_seconds": "often"}})


def test_bound_formula() -> None:
    g = GilConfig()
    # defaults, 64 ranks, one suspect: 3*5 + 2.4*30 + 2*5 + (3*5 + 1)/0.2
    assert saturation_bound(g, 5, 64, signals=True) == pytest.approx(177.0)
    # no signal: 1.2*1800 + 5 + 1 + 5 + (3*5 + 64)/0.2
    assert saturation_bound(g, 5, 64, signals=False) == pytest.approx(2566.0)
    assert saturation_bound(g, 5, 64, signals=True, suspects=64) > saturation_bound(g, 5, 64, signals=True)


# ----------------------------------------------------------------------------- the bound, for real


def _wait(pred, bound: float, what: str) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    deadline = t0 + bound + 5  # fail clearly past the bound, never hang
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {bound:.1f} s")


def test_a_rank_that_turns_gil_bound_among_healthy_ones_within_the_bound(tmp_path: Path, procs: list) -> None:
    gil = {
        "enabled": True,
        "interval_seconds": 2,
        "duration_seconds": 1,
        "rate_hz": 50,
        "healthy_interval_seconds": 600,
        "timeout_seconds": 10,
    }
    cfg_path, cfg = write_config(tmp_path, gil=gil)
    rank_dir = cfg["rank_dir"]
    healthy = [start(procs, "rank.py", "beat", rank_dir, "job", str(r)) for r in (1, 2, 3)]
    turning = start(procs, "turns_gil_bound.py", rank_dir, "job", "0")
    d = DaemonProc(cfg_path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id="job", rank="0") == 1.0, timeout=20, what="rank 0 up")
        time.sleep(2)  # a few cycles of the healthy rank (its first screening: within 600 s)
        os.kill(turning.pid, signal.SIGUSR1)  # it becomes GIL-saturated now
        gcfg = parse_config(cfg).gil
        bound = saturation_bound(gcfg, cfg["interval_seconds"], 4, signals=True)
        took = _wait(lambda: has_finding(d, "gil_saturated", job_id="job", rank="0"), bound, "gil_saturated")
        assert took <= bound, (took, bound)
        for r in (1, 2, 3):
            assert not has_finding(d, "gil_saturated", job_id="job", rank=str(r))
        assert all(p.poll() is None for p in healthy)
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.log_path.read_text(errors="replace")


def test_a_gil_bound_rank_without_signals_within_the_bound(procs: list) -> None:
    """The worst case: every signal says healthy, only its screening can find it."""
    cpu4 = start(procs, "cpu4.py")
    quiet = [start(procs, "io4.py") for _ in range(2)]
    g = GilConfig(interval_seconds=2, duration_seconds=1, healthy_interval_seconds=4)
    s = GilSampler(
        PySpy(BINARY),
        CounterStore(),
        interval_seconds=g.interval_seconds,
        duration_seconds=g.duration_seconds,
        max_duty=0.2,
        probe_seconds=0.5,
        healthy_interval_seconds=g.healthy_interval_seconds,
    )
    targets = [GilTarget("j", 0, cpu4.pid)] + [GilTarget("j", i + 1, p.pid) for i, p in enumerate(quiet)]
    s.update_targets(targets)
    bound = saturation_bound(g, 0.0, len(targets), signals=False)
    ctx_rank = RankState("j", 0, cpu4.pid, 0, 3, True, None)

    def raised() -> bool:
        s.update_signals({t.key: _unknown(t.pid) for t in targets})  # no signal, every cycle
        s.tick()
        ctx = FindingContext(
            now=time.time(), config=Config(), ranks=(ctx_rank,), parts=Tracked(stall=StallOutput(gil=s.readings()))
        )
        return any(f.kind == "gil_saturated" for f in gil_finding.find(ctx))

    try:
        took = _wait(raised, bound, "gil_saturated without signals")
        assert took <= bound, (took, bound)
        assert not any(p.full for p in s.plan() if p.key != ("j", 0))
    finally:
        s.close()
