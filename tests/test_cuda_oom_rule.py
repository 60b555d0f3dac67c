"""findings/cuda_oom.py on its own: a typed reading (a CUDA OOM event as the join attributed it,
join/cuda_oom.py) -> the cuda_oom finding, through the full rule list as the join runs it; then the
same finding through the real daemon: a real rank process, its event file in the rank directory,
NVML replayed from the H200 recording, and the finding's 600 s window on the daemon's clock."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuwatchd.config.schema import Config, parse_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.findings import RULES, FindingContext, cuda_oom, evaluate
from gpuwatchd.join import rank_claims
from gpuwatchd.join.cuda_oom import FINDING_SECONDS
from gpuwatchd.join.orphans import RankTrees
from gpuwatchd.join.state import JoinMemory, build_state
from gpuwatchd.model.cuda_oom import AttributedOom, CoTenant, OomEvent
from gpuwatchd.model.parts import GpuOutput, Tracked
from gpuwatchd.rank.cuda_oom import PREFIX, SUFFIX
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.nvml_fixture import fixture_source

FIX = Path(__file__).parent / "fixtures" / "nvml"
UUID = "GPU-d6a79800-1da5-699b-0f9c-f55eb218f8b2"
NO_CLAIMS = rank_claims.decide((), {}, {}, {}, {})  # a cycle without ranks


def _oom() -> AttributedOom:
    ev = OomEvent("dflash", 0, 447, 100.0, UUID, 50 << 30, None)
    tenants = (
        CoTenant(447, 2787115008, "python3", "dflash", "0"),  # the rank itself: not a co-tenant
        CoTenant(460, 1 << 30, "python3", "other", "2"),
        CoTenant(453, 59818579968, "python3", orphan_reason="reparented_to_init"),
        CoTenant(470, 5 << 20, "", orphan_reason="some_new_reason"),
        CoTenant(480, None, "nccl-proxy"),
    )
    return AttributedOom(ev, gpu="0", ns_pid=None, co_tenants=tenants)


def test_no_reading_no_finding() -> None:
    assert list(cuda_oom.find(FindingContext(now=0.0, config=Config()))) == []
    assert cuda_oom.find in RULES


def test_one_reading_is_one_warning_naming_each_co_tenant_largest_first() -> None:
    ctx = FindingContext(now=200.0, config=Config(), parts=Tracked(gpu=GpuOutput(cuda_ooms=(_oom(),))))
    (f,) = [f for f in evaluate(ctx) if f.kind == "cuda_oom"]
    assert (f.kind, f.severity, f.job_id, f.rank, f.pid) == ("cuda_oom", "warning", "dflash", "0", "447")
    assert f.since == 100.0  # the moment of the error, not the cycle's
    assert f.explanation == (
        "rank 0 of job dflash (pid 447) hit CUDA OOM on GPU 0 (tried to allocate 50.0 GiB); "
        "PID 453 (python3, not in any job, its parent died and it was adopted by init) held "
        "55.7 GiB there; PID 460 (python3, rank 2 of job other) held 1.0 GiB there; "
        "PID 470 (not in any job, some_new_reason) held 5 MiB there; "
        "PID 480 (nccl-proxy, not in any job) held an unknown amount there"
    )
    assert dict(f.evidence) == {
        "gpu": "0",
        "uuid": UUID,
        "requested_bytes": 50 << 30,
        "co_tenants": [
            {"pid": 453, "used_memory_bytes": 59818579968},
            {"pid": 460, "used_memory_bytes": 1 << 30},
            {"pid": 470, "used_memory_bytes": 5 << 20},
            {"pid": 480, "used_memory_bytes": None},
        ],
    }


def test_alone_on_an_unknown_gpu_in_a_container() -> None:
    ev = OomEvent("dflash", 1, 5000, 7.0, UUID, None, ())
    f = cuda_oom.oom_finding(AttributedOom(ev, gpu="", ns_pid=1, co_tenants=(CoTenant(5000, 1 << 30, "python3"),)))
    assert f.explanation == (
        f"rank 1 of job dflash (pid 5000 (1 in its container)) hit CUDA OOM on GPU {UUID}; "
        "no other process held memory there"
    )
    assert dict(f.evidence) == {"gpu": "", "uuid": UUID, "requested_bytes": None, "co_tenants": []}
    nameless = AttributedOom(OomEvent("j", 2, 9, 1.0, "", None, None))
    assert "hit CUDA OOM on GPU ?;" in cuda_oom.oom_finding(nameless).explanation


def test_two_ranks_two_findings_kept_by_the_join_with_their_since() -> None:
    other = dataclasses.replace(_oom(), event=OomEvent("dflash", 1, 448, 150.0, UUID, 1 << 30, None), co_tenants=())
    memory = None
    for now in (200.0, 230.0):  # the same readings on two cycles: the same two findings
        state, memory = build_state(
            now,
            Config(),
            NO_CLAIMS,
            RankTrees(),
            Tracked(gpu=GpuOutput(cuda_ooms=(_oom(), other))),
            memory or JoinMemory(),
        )
        found = sorted((f.rank, f.pid, f.since) for f in state.findings if f.kind == "cuda_oom")
        assert found == [("0", "447", 100.0), ("1", "448", 150.0)]
    state, _ = build_state(260.0, Config(), NO_CLAIMS, RankTrees(), Tracked(), memory)
    assert [f for f in state.findings if f.kind == "cuda_oom"] == []


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_the_daemon_names_the_co_tenants_and_drops_the_finding_after_its_window(
    tmp_path: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """End to end: the event file a rank wrote -> counted once, attributed with the daemon's
    reading of the GPU (no snapshot in the event) -> the cuda_oom finding, kept 600 s."""
    for _ in range(4):  # ranks 0 and 1 of the job, two processes of no job
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
    rank0, rank1, stray1, stray2 = (p.pid for p in procs)
    rank_dir = tmp_path / "ranks"
    write_rank_file(
        str(rank_dir),
        {
            "version": 1,
            "job_id": "dflash",
            "world_size": 2,
            "ranks": [{"rank": 0, "pid": rank0}, {"rank": 1, "pid": rank1}],
        },
        "dflash.json",
    )
    cfg = parse_config(
        {
            "rank_dir": str(rank_dir),
            "state_dir": str(tmp_path / "state"),
            "orphans": {"grace_seconds": 0},
            "gil": {"enabled": False},
            "discovery": {"enabled": False},
        }
    )
    clock = [1.9e9]
    # the recording's GPU 0: 447 2.6 GiB, 449 630 MiB, 450 630 MiB, 453 5.6 GiB
    pid_map = {447: rank0, 449: rank1, 450: stray2, 453: stray1}
    d = Daemon(
        cfg,
        clock=lambda: clock[0],
        parts=lambda c, s: Parts(
            nvml=NvmlSubsystem(
                c,
                s,
                source=fixture_source(str(FIX / "h200_orphan_dataloader.json"), pid_map),
                watch_xid=False,
                watch_udev=False,
            )
        ),
    )
    sub = d.parts.nvml
    assert isinstance(sub, NvmlSubsystem)
    sub.start(d)
    try:
        first = d.cycle()
        assert [f for f in first.findings if f.kind == "cuda_oom"] == []
        reasons = {o.pid: cuda_oom.REASON_TEXT.get(o.reason, o.reason) for o in first.orphans}
        assert set(reasons) == {stray1, stray2}
        event = {
            "version": 1,
            "kind": "cuda_oom",
            "job_id": "dflash",
            "rank": 0,
            "pid": rank0,
            "timestamp": clock[0] - 1,
            "device_uuid": UUID,
            "requested_bytes": 1 << 30,
            "co_tenants": None,
        }
        (rank_dir / f"{PREFIX}dflash-0-{rank0}-1{SUFFIX}").write_text(json.dumps(event))
        clock[0] += 10
        states = [d.cycle(), d.cycle()]  # read (and removed) once, kept on the next cycle
        assert d.counters.get("cuda_oom_errors", ("dflash", "0", "0")) == 1
        comm = {pid: _comm(pid) for pid in (rank1, stray1, stray2)}
        for state in states:
            (f,) = [f for f in state.findings if f.kind == "cuda_oom"]
            assert (f.severity, f.job_id, f.rank, f.pid) == ("warning", "dflash", "0", str(rank0))
            assert f.since == event["timestamp"]
            assert f.explanation == (
                f"rank 0 of job dflash (pid {rank0}) hit CUDA OOM on GPU 0 (tried to allocate "
                f"1.0 GiB); PID {stray1} ({comm[stray1]}, not in any job, {reasons[stray1]}) held "
                f"5.6 GiB there; PID {rank1} ({comm[rank1]}, rank 1 of job dflash) held 630 MiB "
                f"there; PID {stray2} ({comm[stray2]}, not in any job, {reasons[stray2]}) held "
                "630 MiB there"
            )
        clock[0] = event["timestamp"] + FINDING_SECONDS + 1
        late = d.cycle()
        assert [f for f in late.findings if f.kind == "cuda_oom"] == []
        assert d.counters.get("cuda_oom_errors", ("dflash", "0", "0")) == 1
        assert [n for n in os.listdir(rank_dir) if n.startswith(PREFIX)] == []
    finally:
        sub.stop()
