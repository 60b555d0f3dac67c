"""The join and the core finding rules, as pure functions over readings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gpuwatchd.config.schema import Config, FdsConfig
from gpuwatchd.join import rank_claims
from gpuwatchd.join.orphans import trees_from_entries
from gpuwatchd.join.state import JoinMemory, build_state
from gpuwatchd.model import BadRankFile, GpuProcess, ProcessInfo, RankEntry
from gpuwatchd.model.parts import GpuOutput, Tracked

CFG = Config()


def proc(
    pid: int,
    *,
    uid: int = 1000,
    start: int = 100,
    fds: int | None = 10,
    soft: int | None = 1024,
    state: str = "S",
    comm: str = "python",
) -> ProcessInfo:
    return ProcessInfo(
        pid=pid,
        ppid=1,
        comm=comm,
        state=state,
        uid=uid,
        user=f"u{uid}",
        start_ticks=start,
        start_time=1000.0 + start,
        cpu_seconds=1.0,
        rss_bytes=1 << 20,
        threads=4,
        open_fds=fds,
        max_fds_soft=soft,
        max_fds_hard=4096,
    )


def entry(
    rank: int,
    pid: int,
    *,
    owner: int | None = 1000,
    job: str = "llm-7",
    source: str = "rankfile",
    start: int | None = None,
) -> RankEntry:
    return RankEntry(
        job_id=job,
        rank=rank,
        pid=pid,
        owner_uid=owner,
        source=source,
        path=f"/r/{job}.{rank}.json",
        start_ticks=start,
        world_size=16,
    )


def run(
    now: float,
    entries: list[RankEntry],
    procs: list[ProcessInfo],
    memory: JoinMemory | None = None,
    config: Config = CFG,
    parts: Tracked | None = None,
    **kw: object,
):  # type: ignore[no-untyped-def]
    """One cycle as the daemon runs it: the claims decided, then the join."""
    memory = memory or JoinMemory()
    processes = {p.pid: p for p in procs}
    claims = rank_claims.decide(tuple(entries), processes, memory.job_owners, memory.claimant_uids, memory.start_ticks)
    descendants: Mapping[int, tuple[int, ...]] = kw.get("descendants", {})  # type: ignore[assignment]
    trees = trees_from_entries(claims.accepted, processes, descendants, memory.start_ticks)
    return build_state(now, config, claims, trees, parts or Tracked(), memory, processes=processes, **kw)  # type: ignore[arg-type]


def kinds(state) -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return {(f.kind, f.rank) for f in state.findings}


def test_alive_and_dead_and_peers() -> None:
    s, mem = run(1200, [entry(0, 10), entry(1, 11)], [proc(10)])  # rank 0 started at 1100
    up = {r.rank: r.alive for r in s.ranks}
    assert up == {0: True, 1: False}
    # seen dead with no exit read: it waits EXIT_READ_GRACE_SECONDS for the exit watcher's record
    assert not [f for f in s.findings if f.kind == "rank_down"]
    s, _ = run(1206, [entry(0, 10), entry(1, 11)], [proc(10)], mem)
    (down,) = [f for f in s.findings if f.kind == "rank_down"]
    assert down.rank == "1" and down.severity == "page" and "1 peer(s)" in down.explanation


def test_pid_reuse_is_detected_by_start_time() -> None:
    s, mem = run(10, [entry(0, 10)], [proc(10, start=100)])
    assert s.ranks[0].alive
    s, mem = run(15, [entry(0, 10)], [proc(10, start=999)], mem)  # same PID, another process
    assert not s.ranks[0].alive
    s, mem = run(21, [entry(0, 10)], [proc(10, start=999)], mem)  # past the exit-read grace
    assert not s.ranks[0].alive and ("rank_down", "0") in kinds(s)
    # the declared start time in the rank file wins from the first cycle on
    s, _ = run(10, [entry(0, 10, start=5)], [proc(10, start=100)])
    assert not s.ranks[0].alive


def test_zombie_is_dead() -> None:
    s, _ = run(10, [entry(0, 10)], [proc(10, state="Z")])
    assert not s.ranks[0].alive


def test_died_at_is_remembered() -> None:
    s, mem = run(10, [entry(0, 10)], [])
    s, mem = run(20, [entry(0, 10)], [], mem)
    assert s.ranks[0].died_at == 10
    f = next(f for f in s.findings if f.kind == "rank_down")
    assert f.since == 10


def test_trust_rank_file_of_another_user_is_refused() -> None:
    s, _ = run(10, [entry(0, 10, owner=1001)], [proc(10, uid=1000)])
    assert s.ranks == ()
    (bad,) = [f for f in s.findings if f.kind == "bad_rank_file"]
    assert "owner uid 1001 may not claim pid 10" in bad.explanation
    s, _ = run(10, [entry(0, 10, owner=0)], [proc(10, uid=1000)])  # root may register anyone
    assert s.ranks[0].alive


def test_rank_file_wins_over_discovery_and_duplicates_reported() -> None:
    s, _ = run(10, [entry(0, 10, source="environ", owner=None), entry(0, 10), entry(0, 12)], [proc(10), proc(12)])
    assert [(r.rank, r.pid) for r in s.ranks] == [(0, 10)]
    assert any(f.kind == "bad_rank_file" and "already claimed" in f.explanation for f in s.findings)


def test_fd_ratio_and_growth() -> None:
    s, _ = run(10, [entry(0, 10)], [proc(10, fds=930, soft=1024)])
    assert ("fd_exhaustion", "0") in kinds(s)
    # 500/1024 is fine ...
    cfg = replace(CFG, fds=FdsConfig(min_window_seconds=60))
    s, mem = run(0, [entry(0, 10)], [proc(10, fds=500)], config=cfg)
    assert ("fd_exhaustion", "0") not in kinds(s)
    # ... until it grows 1 fd/s, reaching 1024 in ~8 min (< 1 h)
    s, mem = run(30, [entry(0, 10)], [proc(10, fds=530)], mem, config=cfg)
    assert ("fd_exhaustion", "0") not in kinds(s)  # window too short to call it a trend
    s, mem = run(60, [entry(0, 10)], [proc(10, fds=560)], mem, config=cfg)
    (f,) = [f for f in s.findings if f.kind == "fd_exhaustion"]
    assert "growing by 60.0/min" in f.explanation and f.evidence["fds_per_second"] == 1.0
    # slow growth (limit reached in > 1 h) is not a finding
    s, mem = run(0, [entry(1, 11)], [proc(11, fds=100)], config=cfg)
    s, mem = run(600, [entry(1, 11)], [proc(11, fds=110)], mem, config=cfg)
    assert ("fd_exhaustion", "1") not in kinds(s)
    # unknown limits or fds: no finding, no crash
    s, _ = run(0, [entry(2, 12)], [proc(12, fds=None, soft=None)])
    assert s.ranks[0].alive and not s.findings


def test_nccl_findings_from_flags() -> None:
    s, _ = run(
        10,
        [entry(0, 10), entry(1, 11)],
        [proc(10), proc(11)],
        env_flags={10: ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_DESYNC_DEBUG"), 11: ("TORCH_NCCL_ASYNC_ERROR_HANDLING=0",)},
    )
    k = kinds(s)
    assert ("nccl_legacy_env", "0") in k and ("nccl_error_handling_off", "1") in k
    legacy = next(f for f in s.findings if f.kind == "nccl_legacy_env")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in legacy.explanation and "NCCL_DESYNC_DEBUG" in legacy.explanation


def test_gpu_processes_attributed_to_rank_trees() -> None:
    worker = proc(20, comm="pt_data_worker")
    s, _ = run(
        10,
        [entry(0, 10)],
        [proc(10), worker, proc(30, comm="stale")],
        descendants={10: (20,)},
        parts=Tracked(
            gpu=GpuOutput(
                holders=(
                    GpuProcess(0, "GPU-a", 10, 40 << 30),
                    GpuProcess(0, "GPU-a", 20, 1 << 30),
                    GpuProcess(1, "GPU-b", 30, 55 << 30),
                    GpuProcess(1, "GPU-b", 31, None),
                )
            )
        ),
    )
    rows = {(r.pid, r.job_id, r.rank, r.comm) for r in s.gpu_processes}
    assert rows == {
        (10, "llm-7", "0", "python"),
        (20, "llm-7", "0", "pt_data_worker"),
        (30, "", "", "stale"),
        (31, "", "", ""),
    }
    assert s.ranks[0].tree == (10, 20)


def test_bad_files_become_findings_and_finding_since_is_stable() -> None:
    bad = (BadRankFile("/r/x.json", "is not valid JSON"),)
    s, mem = run(10, [], [], bad_files=bad)
    s, mem = run(20, [], [], mem, bad_files=bad)
    (f,) = s.findings
    assert f.kind == "bad_rank_file" and f.since == 10 and "/r/x.json" in f.explanation
