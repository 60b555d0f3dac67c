"""sources/memcg.py, memory_tracker.py, findings/rank_memory_pressure.py: the v2 hierarchy from a fixture tree
(tests/fixtures/memcg/README.md), the v1 hierarchy of this machine for real, hostile files."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oom_helpers import MemCgroup

from gpuwatchd.config.schema import Config, ConfigError, MemoryConfig, parse_config
from gpuwatchd.daemon.memory_evidence import snapshot_event, worse
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import rank_memory_pressure as finding
from gpuwatchd.join.memory_tracker import MAX_POINTS, MemoryTracker, slope
from gpuwatchd.model import (
    CgroupMemory,
    CgroupPaths,
    NodeMemoryState,
    ProcessInfo,
    RankMemory,
    RankState,
    TreeProcessMemory,
)
from gpuwatchd.model.kernel import LogRecord
from gpuwatchd.model.parts import MemoryOutput, Tracked
from gpuwatchd.model.threads import Frame, ThreadStack
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import memcg
from gpuwatchd.sources.kernel_lines import parse_message
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.units import fmt_duration, fmt_span

FIX = Path(__file__).parent / "fixtures" / "memcg" / "v2"
GiB = 1 << 30
TASK = "/system.slice/slurmstepd.scope/job_7/step_0/user/task_3"


def ctx_for(m: RankMemory, now: float = 0.0, alive: bool = True) -> FindingContext:
    """The finding's context with ``m``'s rank accepted by the join (alive or not)."""
    rank = RankState(m.job_id, m.rank, m.pid, None, None, alive, None)
    return FindingContext(now=now, config=Config(), ranks=(rank,), parts=Tracked(memory=MemoryOutput(rank_memory=(m,))))


def cgroup_of(paths: HostPaths, pid: int) -> CgroupPaths | None:
    """What the daemon's process view reads for a rank (ProcfsReader.cgroup, parsed)."""
    text = ProcfsReader(paths).cgroup(pid)
    return memcg.parse_cgroup_file(text) if text is not None else None


def v2_reader(root: Path = FIX) -> memcg.MemcgReader:
    return memcg.MemcgReader(HostPaths(procfs=str(root / "proc")), str(root / "sys" / "fs" / "cgroup"))


def test_v2_fixture_tightest_level_high_and_psi() -> None:
    r = v2_reader()
    assert r.available and not r.v1
    where = cgroup_of(r.paths, 4242)
    assert where == CgroupPaths("", TASK)
    got = r.read(where)
    assert got is not None
    # the job's 80 GiB on job_7 bounds the task (max below it); working set = current - inactive
    assert (got.version, got.path, got.limit_bytes) == (2, "/system.slice/slurmstepd.scope/job_7", 80 * GiB)
    assert got.usage_bytes == int(74.6 * GiB)
    assert got.working_set_bytes == int(74.6 * GiB) - int(0.2 * GiB)
    assert got.high_bytes == 76 * GiB
    assert got.pressure is not None and got.pressure.some_avg10 == 0.125  # the task's own PSI
    assert got.pressure.full_total_seconds == 1.234567
    node = r.node()
    assert node is not None and node.available_bytes == 41943040 * 1024
    assert node.pressure is not None and node.pressure.some_total_seconds == 5.0


def test_v2_fixture_finding_in_words() -> None:
    r = v2_reader()
    cg = r.read(CgroupPaths("", TASK))
    t = MemoryTracker()
    p = ProcessInfo(4242, 1, "python", "S", 0, "root", 1, 1.0, 1.0, int(60 * GiB), 40, 10, 1024, 4096)
    m = t.observe(1000.0, ("llm-7", 3, 4242, 1), (4242,), {4242: p}, cg, 300, 60)
    (f,) = finding.find(ctx_for(m, 1000.0))
    assert (f.kind, f.severity, f.job_id, f.rank, f.pid) == ("rank_memory_pressure", "warning", "llm-7", "3", "4242")
    assert f.evidence["reason"] == "share"
    assert f.explanation.startswith(
        "rank 3 of job llm-7 (pid 4242) is at 93 % of the 80.0 GiB limit of memory cgroup "
        "/system.slice/slurmstepd.scope/job_7 (working set 74.4 GiB); it is not growing"
    )


def test_v1_real_cgroup_of_a_real_process() -> None:
    cg = MemCgroup("gwmemory_v1", 96 << 20)
    try:
        child = cg.spawn("import sys; x = bytearray(40 << 20); print(flush=True); sys.stdin.read()")
        assert child.stdout is not None
        child.stdout.readline()
        r = memcg.MemcgReader()
        assert r.v1
        where = cgroup_of(r.paths, child.pid)
        assert where is not None and where.memory_v1 == cg.kernel_path
        got = r.read(where)
        assert got is not None and (got.version, got.path, got.limit_bytes) == (1, cg.kernel_path, 96 << 20)
        assert 40 << 20 <= got.usage_bytes <= 96 << 20 and got.working_set_bytes <= got.usage_bytes
        assert cgroup_of(r.paths, 2**22 + 12345) is None  # no such process
    finally:
        cg.remove()


@pytest.mark.parametrize("content", ["", "abc", "-5", "9" * 40, "\x00\x01", "12 34", "max\nmax"])
def test_hostile_cgroup_files_never_raise(tmp_path: Path, content: str) -> None:
    root = tmp_path / "t"
    shutil.copytree(FIX, root)
    job = root / "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7"
    for name in ("memory.current", "memory.max", "memory.high", "memory.stat", "memory.pressure"):
        (job / name).write_text(content)
    (root / "proc/pressure/memory").write_text(content)
    got = v2_reader(root).read(CgroupPaths("", TASK))
    assert got is not None and got.path == TASK  # the damaged level is skipped, the task read
    v2_reader(root).node()


def test_paths_cannot_leave_the_hierarchy_and_depth_is_bounded(tmp_path: Path) -> None:
    r = v2_reader()
    assert r.read(CgroupPaths("", "/../../../../proc/4242")) is None
    deep = "/" + "/".join(f"d{i}" for i in range(50))
    assert r.read(CgroupPaths("", deep)) is None
    big = tmp_path / "big"
    big.write_text("some avg10=1.00 avg60=0 avg300=0 total=1\n" + "x" * (1 << 20))
    assert memcg.parse_psi(memcg.read_capped(str(big))) is not None  # read is capped, head still parses


def test_own_limit_is_the_smallest_on_the_path_v2(tmp_path: Path) -> None:
    """The daemon's own limit (gpuwatch_process_memory_limit_bytes): under systemd a slice's
    limit tighter than the unit's MemoryMax= wins; in a pod's cgroup namespace the path is "/"
    and the limit is the namespace root's memory.max; without a limit, None."""
    root = tmp_path / "cg"
    unit = root / "system.slice" / "gpuwatchd.service"
    unit.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "system.slice" / "memory.max").write_text("max\n")
    (unit / "memory.max").write_text(f"{256 << 20}\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/system.slice/gpuwatchd.service\n")
    r = memcg.MemcgReader(cgroup_root=str(root))
    assert r.own_limit_bytes(str(own)) == 256 << 20
    (root / "system.slice" / "memory.max").write_text(f"{200 << 20}\n")
    assert r.own_limit_bytes(str(own)) == 200 << 20
    own.write_text("0::/\n")
    assert r.own_limit_bytes(str(own)) is None  # a host's root cgroup has no memory.max
    (root / "memory.max").write_text(f"{512 << 20}\n")  # a pod's namespace root has one
    assert r.own_limit_bytes(str(own)) == 512 << 20
    assert r.own_limit_bytes(str(tmp_path / "absent")) is None


def test_cgroup_file_parsing() -> None:
    text = "12:memory:/slurm/uid_0/job_7\n11:cpu,cpuacct:/x\n0::/user.slice\n"
    assert memcg.parse_cgroup_file(text) == CgroupPaths("/slurm/uid_0/job_7", "/user.slice", "/x")
    assert memcg.parse_cgroup_file("garbage\n\n::\n") == CgroupPaths("", "")


def test_slope_and_growth_need_the_minimum_window() -> None:
    assert slope([(0, 0), (1, 2), (2, 4)]) == pytest.approx(2.0)
    assert slope([(1, 5)]) is None and slope([(1, 5), (1, 6)]) is None
    t = MemoryTracker()
    cg = CgroupMemory(1, "/x", 0, 0, 100 << 20)
    for i in range(5):
        p = ProcessInfo(7, 1, "python", "S", 0, "root", 1, 0.0, 1.0, (10 + i) << 20, 1, 1, 1, 1)
        c = CgroupMemory(1, "/x", (10 + i) << 20, (10 + i) << 20, 100 << 20)
        m = t.observe(100.0 + i, ("j", 0, 7, 1), (7,), {7: p}, c, 300, 3.5)
        assert (m.cgroup_growth_bytes_per_second is None) == (i < 4)
    assert m.cgroup_growth_bytes_per_second == pytest.approx(1 << 20)
    assert m.top[0].gained_bytes == 4 << 20 and not m.top[0].worker
    t.forget([], [])
    assert t.observe(200.0, ("j", 0, 7, 1), (7,), {7: p}, cg, 300, 3.5).cgroup_growth_bytes_per_second is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.5, 30.0), st.one_of(st.none(), st.integers(0, 1 << 40)), st.integers(0, 1 << 40)),
        min_size=1,
        max_size=400,
    ),
    st.floats(1.7e9, 1.9e9),
    st.sampled_from([(300.0, 60.0), (60.0, 0.0), (1e5, 10.0)]),
)
def test_sliding_fit_is_the_textbook_slope_over_the_window(
    steps: list[tuple[float, int | None, int]], start: float, windows: tuple[float, float]
) -> None:
    """The tracker's growth rates (sums that slide with the window) against ``slope`` over the
    same points, each cycle, at epoch-sized times and values up to a TiB, past MAX_POINTS."""
    window, min_window = windows
    t = MemoryTracker()
    now, points = start, []
    for dt, ws, rss in steps:
        now += dt
        p = ProcessInfo(7, 1, "python", "S", 0, "root", 1, 0.0, 1.0, rss, 1, 1, 1, 1)
        c = None if ws is None else CgroupMemory(1, "/x", ws, ws, 1 << 41)
        m = t.observe(now, ("j", 0, 7, 1), (7,), {7: p}, c, window, min_window)
        points = [*points, (now, ws, rss)][-MAX_POINTS:]
        points = [q for q in points if q[0] >= now - window]
        spans = now - points[0][0] >= min_window
        want_rss = slope((q[0], float(q[2])) for q in points) if spans else None
        ok_ws = spans and c is not None and all(q[1] is not None for q in points)
        want_ws = slope((q[0], float(q[1] or 0)) for q in points) if ok_ws else None
        for got, want in ((m.tree_growth_bytes_per_second, want_rss), (m.cgroup_growth_bytes_per_second, want_ws)):
            assert (got is None) == (want is None)
            if want is not None:
                assert got == pytest.approx(want, rel=1e-6, abs=1e-3)


def test_sliding_fit_does_not_drift_with_uptime() -> None:
    """35 days of 30 s cycles on a TiB-sized tree: the sums are rebuilt from the window's points
    (relative to its oldest), so the rate is still the textbook one to 1e-12 (without the rebuild:
    3e-8 and growing)."""
    rnd = random.Random(7)
    t, now, points = MemoryTracker(), 1.8e9, []
    for i in range(100_000):
        now += 30
        rss = (1 << 40) + rnd.randrange(1 << 36) + 30 * i
        p = ProcessInfo(7, 1, "python", "S", 0, "root", 1, 0.0, 1.0, rss, 1, 1, 1, 1)
        m = t.observe(now, ("j", 0, 7, 1), (7,), {7: p}, None, 300, 60)
        points = [*points[-10:], (now, float(rss))]
    assert m.tree_growth_bytes_per_second == pytest.approx(slope(points), rel=1e-12)


def test_assess_reasons_and_steady_near_limit() -> None:
    base = RankMemory(
        "j",
        1,
        9,
        50 << 30,
        cgroup="/c",
        cgroup_version=2,
        usage_bytes=70 << 30,
        working_set_bytes=70 << 30,
        limit_bytes=80 << 30,
    )
    steady = RankMemory(**{**base.__dict__, "cgroup_growth_bytes_per_second": 0.0})
    assert finding.assess(steady, None, 0.9, 900) is None  # 87.5 %, flat: nothing
    growing = RankMemory(**{**base.__dict__, "cgroup_growth_bytes_per_second": float(20 << 20)})
    a = finding.assess(growing, None, 0.9, 900)
    assert a is not None and a["reason"] == "limit_trend" and a["seconds_to_limit"] == pytest.approx(512)
    text = finding.explain(growing, None, a, 0.0)
    assert "grows 20.0 MiB/s: it reaches the limit in about 9 minutes" in text
    assert finding.assess(growing, None, 0.9, 300) is None  # beyond the horizon
    node = NodeMemoryState(256 << 30, 4 << 30)
    free = RankMemory("j", 2, 10, 100 << 30, tree_growth_bytes_per_second=float(64 << 20))
    n = finding.assess(free, node, 0.9, 900)
    assert n is not None and n["reason"] == "node_trend" and n["seconds_to_node_end"] == pytest.approx(64)
    assert "the node runs out of memory in about 65 seconds" in finding.explain(free, node, n, 0.0)
    assert fmt_duration(7200) == "about 2.0 hours" and fmt_span(300) == "5 min"


def test_snapshot_event_is_bounded_and_names_the_grower() -> None:
    m = RankMemory(
        "llm-7",
        3,
        48213,
        80 << 30,
        cgroup="/job_7",
        limit_bytes=80 << 30,
        working_set_bytes=int(74.4 * GiB),
        top=(TreeProcessMemory(48222, "pt_data_worker", 9 << 30, 9 << 30, 300.0, True),),
    )
    (f1,) = list(finding.find(ctx_for(m)))
    frames = tuple(Frame(f"fn{i}" * 50, "x.py", i) for i in range(100))
    stacks = tuple(ThreadStack(i, i, "t" * 500, False, i == 3, frames if i else ()) for i in range(50))
    ev = snapshot_event(f1, m, time.mktime((2026, 12, 1, 14, 21, 50, 0, 0, -1)), stacks, "", 1)
    # the GIL owner's innermost frame, cut to a readable length
    assert ev.summary.startswith("at 14:21:50, at 93 % of 80.0 GiB, rank 3 was in fn0fn0")
    assert len(ev.summary) < 300
    assert ev.summary.endswith("worker 48222 (pt_data_worker) had grown 9.0 GiB in 5 min")
    assert len(ev.to_json()) < 20000 and len(ev.fields["threads"]) == 4
    none = snapshot_event(f1, m, 0.0, None, "permission_denied: ptrace", 2)
    assert "(stack unavailable: permission_denied: ptrace)" in none.summary
    assert worse(f1.__class__(**{**f1.__dict__, "evidence": {"share": 0.97}}), f1)  # 7 -> 3 % left
    assert not worse(f1.__class__(**{**f1.__dict__, "evidence": {"share": 0.95}}), f1)
    assert not worse(f1, f1)


def test_config_keys() -> None:
    cfg = parse_config(
        {
            "memory": {
                "ratio_threshold": 0.8,
                "horizon_seconds": 60,
                "window_seconds": 120,
                "min_window_seconds": 30,
                "cgroup_root": "/host/sys/fs/cgroup",
            }
        }
    )
    assert cfg.memory == MemoryConfig(
        ratio_threshold=0.8,
        horizon_seconds=60,
        window_seconds=120,
        min_window_seconds=30,
        cgroup_root="/host/sys/fs/cgroup",
    )
    with pytest.raises(ConfigError) as e:
        parse_config(
            {
                "memory": {
                    "ratio_threshold": 2,
                    "window_seconds": 10,
                    "min_window_seconds": 60,
                    "cgroup_root": "rel",
                    "snapshots": 1,
                }
            }
        )
    text = str(e.value)
    for key in (
        "memory.ratio_threshold",
        "memory.min_window_seconds",
        "memory.cgroup_root",
        "memory.snapshots: unknown key",
    ):
        assert key in text


def test_node_reader_on_this_machine() -> None:
    node = memcg.MemcgReader().node()
    assert node is not None and 0 < node.available_bytes <= node.total_bytes
    out = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, check=True)
    assert out.stdout == b"1\n" and os.path.exists("/proc/pressure/memory") == (node.pressure is not None)


def test_kill_links_to_the_last_snapshot_of_its_rank_across_a_restart(tmp_path: Path) -> None:
    from gpuwatchd.counters import CounterStore
    from gpuwatchd.events.bus import EventBus
    from gpuwatchd.events.log import JsonlSink
    from gpuwatchd.join.kernel_events import KernelEventProcessor
    from gpuwatchd.join.rank_trees import TreeMember

    def processor() -> KernelEventProcessor:
        return KernelEventProcessor(
            CounterStore(), str(tmp_path), parse=parse_message, bus=EventBus([JsonlSink(str(tmp_path))]), boot_id="boot"
        )

    now = time.time()
    m = RankMemory(
        "llm-7",
        3,
        4321,
        80 << 30,
        cgroup="/job_7",
        limit_bytes=80 << 30,
        working_set_bytes=76 << 30,
        top=(TreeProcessMemory(4400, "pt_data_worker", 9 << 30, 9 << 30, 300.0, True),),
    )
    (f,) = finding.find(ctx_for(m, now))
    p = processor()
    other = RankMemory(**{**m.__dict__, "pid": 9999})  # same job and rank, another process
    p.record_event(snapshot_event(f, m, now - 60, None, "absent", 1))
    p.record_event(snapshot_event(f, m, now - 30, None, "absent", 2))
    p.record_event(snapshot_event(f, other, now - 10, None, "absent", 3))
    p2 = processor()  # restarted: the snapshots come back from the event log
    p2.record.update([TreeMember(4400, now - 100, "llm-7", 3, 4321, True, "pt_data_worker", now)], now)
    line = (
        "Memory cgroup out of memory: Killed process 4400 (pt_data_worker) total-vm:1kB, "
        "anon-rss:9437184kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0"
    )
    (kill,) = p2.handle(LogRecord(line, "kernel", "boot", 10**9, now, "test"))
    assert kill.fields["memory_snapshot"].endswith(":2")  # the last of this rank process, not 9999's
    assert "rank 3 (stack unavailable: absent); worker 4400 (pt_data_worker) had grown 9.0 GiB" in kill.summary


def test_only_accepted_live_ranks_get_the_finding() -> None:
    m = RankMemory("j", 1, 9, 50 << 30, cgroup="/c", working_set_bytes=79 << 30, limit_bytes=80 << 30)
    assert len(list(finding.find(ctx_for(m)))) == 1
    assert list(finding.find(ctx_for(m, alive=False))) == []  # dead (or its PID reused)
    refused = FindingContext(
        now=0.0, config=Config(), parts=Tracked(memory=MemoryOutput(rank_memory=(m,)))
    )  # not accepted
    assert list(finding.find(refused)) == []


def test_join_exports_host_memory_of_accepted_live_ranks_only() -> None:
    from gpuwatchd.join import rank_claims
    from gpuwatchd.join.orphans import trees_from_entries
    from gpuwatchd.join.state import JoinMemory, build_state
    from gpuwatchd.model import RankEntry
    from gpuwatchd.model.parts import MemoryOutput, Tracked

    me = ProcessInfo(os.getpid(), 1, "python", "S", 0, "root", 1, 1.0, 1.0, 1 << 20, 1, 1, 1, 1)
    claimed = RankMemory("j", 0, os.getpid(), 1 << 20)
    stranger = RankMemory("j", 1, 4242, 1 << 20)  # a claim the join never accepted
    processes = {os.getpid(): me}
    claims = rank_claims.decide((RankEntry("j", 0, os.getpid()),), processes, {}, {}, {})
    trees = trees_from_entries(claims.accepted, processes, {})
    state, _ = build_state(
        1.0,
        Config(),
        claims,
        trees,
        Tracked(memory=MemoryOutput((claimed, stranger))),
        JoinMemory(),
        processes=processes,
    )
    assert state.rank_memory == (claimed,)


def test_above_memory_high_is_said() -> None:
    m = RankMemory(
        "j",
        1,
        9,
        50 << 30,
        cgroup="/c",
        cgroup_version=2,
        working_set_bytes=79 << 30,
        limit_bytes=80 << 30,
        high_bytes=78 << 30,
    )
    (f,) = finding.find(ctx_for(m))
    assert f.explanation.endswith("; it is above its memory.high of 78.0 GiB: the kernel throttles it")
