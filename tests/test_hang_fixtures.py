"""hang.py and the flight-recorder comparison on py-spy dumps and flight-recorder answers recorded
on the H200 (tests/fixtures/hang/README.md says how). The thread states and CPU shares passed in
are the ones /proc showed at the recording (quoted in bench/results/hang_shapes_device.txt)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import stall as stall_finding
from gpuwatchd.join.flight_recorder import compare, parse_response
from gpuwatchd.join.hang import analyze
from gpuwatchd.model import GpuDevice, GpuProcessRow, RankState
from gpuwatchd.model.parts import GpuOutput, StallOutput, Tracked
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.model.threads import ThreadInfo
from gpuwatchd.sources.pyspy_output import parse_dump_json

FIX = Path(__file__).parent / "fixtures" / "hang"


def dump(name: str) -> tuple:
    return parse_dump_json((FIX / f"dump_{name}.json").read_text())


def procview(stacks: tuple, state: str, wchan: str) -> list[ThreadInfo]:
    return [ThreadInfo(s.tid, s.tid, "python3", state, wchan, 0, 0, 0) for s in stacks]


def explain(stacks: tuple, shares: dict, state: str, wchan: str, util: float) -> str:
    threads = procview(stacks, state, wchan)
    a = analyze(stacks, threads, shares)
    v = StallVerdict(
        "j",
        0,
        100,
        True,
        0.0,
        True,
        "heartbeat",
        60.0,
        stuck_frames=tuple(str(f) for f in stacks[-1].frames),
        analysis=a,
    )
    r = RankState("j", 0, 100, 0, 1, True, None, stalled=True, gpus=("0",))
    gpu = GpuDevice(0, "GPU-x", "NVIDIA H200", "0000:19:00.0", 150 << 30, 1 << 30, util)
    row = GpuProcessRow(0, "GPU-x", 100, 612 << 20, "python3", "root", "j", "0")
    ctx = FindingContext(
        now=100.0,
        config=Config(),
        ranks=(r,),
        gpu_processes=(row,),
        parts=Tracked(gpu=GpuOutput(gpus=(gpu,)), stall=StallOutput(verdicts={("j", 0): v})),
    )
    (f,) = stall_finding.find(ctx)
    return f.explanation


def main_tid(stacks: tuple) -> int:
    return next(s.tid for s in stacks if s.name == "MainThread")


def test_synchronize_behind_a_busy_gpu() -> None:
    s = dump("sync_busy")
    text = explain(s, {main_tid(s): 1.0}, "R", "", 1.0)
    assert 'waiting on the GPU: "MainThread" in synchronize (torch/cuda/__init__.py:1162)' in text
    assert "the GPU is busy: a long kernel, or an NCCL kernel spinning for a peer" in text
    assert "GPU 0 100 % busy, 612.0 MiB held" in text
    assert "gpuwatchd-fr" not in text  # our own responder thread is no suspect


def test_synchronize_on_an_idle_gpu_is_a_lost_launch() -> None:
    s = dump("sync_busy")
    text = explain(s, {main_tid(s): 1.0}, "R", "", 0.0)
    assert "the GPU is idle: the work it waits for was never launched" in text
    assert "GPU 0 idle, 612.0 MiB held" in text


def test_item_spins_in_native_code_without_the_gil() -> None:
    s = dump("item_busy")
    text = explain(s, {main_tid(s): 0.98}, "R", "", 1.0)
    assert '"MainThread" burns 98% of a core in native code without the GIL at <module>' in text
    assert "the GPU is busy" in text


def test_seed_003_deadlock_recorded_on_the_gpu_node() -> None:
    s = dump("deadlock_gpu")
    a = analyze(s, procview(s, "S", "futex_do_wait"), {x.tid: 0.0 for x in s})
    assert a.kinds == ("deadlock",)
    assert set(a.patterns[0].threads) == {"loader", "writer"}
    assert '"writer" in writer (hang_shape_rank.py:65)' in a.patterns[0].text


def test_gloo_rank_waits_in_a_collective() -> None:
    s = dump("gloo_rank0")
    a = analyze(s, procview(s, "S", "futex_do_wait"), {x.tid: 0.0 for x in s})
    assert a.kinds == ("collective",)
    assert "all_reduce (torch/distributed/distributed_c10d.py:3075)" in a.patterns[0].text


def fr(rank: int) -> dict:
    return json.loads((FIX / f"fr_gloo_rank{rank}.json").read_text())


def test_flight_recorder_names_the_rank_that_never_entered() -> None:
    r0 = parse_response(fr(0), "fr-job", 0, fr(0)["pid"])
    r1 = parse_response(fr(1), "fr-job", 1, fr(1)["pid"])
    assert [(g.pg, g.last_started, g.last_completed, g.last_name) for g in r0.groups] == [
        ("0", 5, 4, "gloo:all_reduce")
    ]
    assert (r1.groups[0].last_started, r1.groups[0].last_completed) == (4, 4)
    assert compare([r0, r1]) == [
        "flight recorder: rank 1 never entered collective #5 (gloo:all_reduce) of process group 0 "
        "that rank 0 entered (last entered: rank 1 #4)"
    ]


def test_flight_recorder_desync_and_silence() -> None:
    """Derived from the recording: rank 1's collective #4 relabelled a broadcast (a desync)."""
    doc = copy.deepcopy(fr(1))
    for e in doc["trace"]["entries"]:
        if e["collective_seq_id"] == 4:
            e["profiling_name"] = "gloo:broadcast"
    r0 = parse_response(fr(0), "j", 0, 1)
    r1 = parse_response(doc, "j", 1, 2)
    out = compare([r0, r1])
    assert "desync: collective #4 of process group 0 is gloo:all_reduce on rank 0 but gloo:broadcast on rank 1" in out
    from gpuwatchd.model.parts import FrReading

    silent = FrReading("j", 2, 3, error="no answer")
    assert any("rank 2 did not answer" in x for x in compare([r0, r1, silent]))
    assert compare([r0]) == []  # one rank: nothing to compare


def test_bad_responses_are_refused_not_crashing() -> None:
    import pytest

    for bad in ([], {"version": 2}, {"version": 1, "trace": {"entries": "x"}}):
        with pytest.raises(ValueError):
            parse_response(bad, "j", 0, 1)
    junk = {
        "version": 1,
        "trace": {
            "entries": [None, {"collective_seq_id": True}, {"collective_seq_id": -3}, "x"],
            "pg_status": {"0": {"last_completed_collective": "bad"}},
        },
    }
    assert parse_response(junk, "j", 0, 1).groups == ()


def test_compile_waiting_for_the_cpp_compiler_is_compiling_not_hung() -> None:
    """Recorded while Inductor ran g++: the rank's own threads at ~0 % CPU (the compiler is a
    child process), MainThread in Popen.communicate under cpp_builder: still compiling."""
    s = dump("compile_cpu")
    a = analyze(s, procview(s, "S", "anon_pipe_read"), {x.tid: 0.0 for x in s})
    assert a.kinds == ("compiling",) and a.in_compile
    assert "still compiling, not hung" in a.patterns[0].text
    assert "waiting for the compiler in Popen.communicate (subprocess.py:" in a.patterns[0].text
    # the same frames with a busy child (tree_busy) say how busy
    busy = analyze(s, procview(s, "S", "anon_pipe_read"), {x.tid: 0.0 for x in s}, tree_busy=0.9)
    assert "with 90% of a core busy" in busy.patterns[0].text


def test_a_plain_subprocess_wait_outside_torch_compile_is_not_compiling() -> None:
    """The same wait without compile frames (a rank waiting for some child) is no compile."""
    import dataclasses

    s = dump("compile_cpu")
    main = next(x for x in s if x.name == "MainThread")
    plain = dataclasses.replace(main, frames=tuple(f for f in main.frames if not f.filename.startswith("torch/")))
    a = analyze((plain,), procview((plain,), "S", "anon_pipe_read"), {plain.tid: 0.0})
    assert "compiling" not in a.kinds and not a.in_compile
