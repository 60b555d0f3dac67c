"""CUDA OOM: the rank-side hook writes an event, the daemon counts it and names the co-tenants.

The rank side runs in a real subprocess that dies of an uncaught error carrying the exact text
PyTorch printed on the H200 (torch 2.11, recorded in tests/fixtures/nvml/README.md); the allocator
observer path is exercised on the GPU (tests/gpu/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gpuwatchd.counters import CounterStore
from gpuwatchd.findings import cuda_oom as oom_rule
from gpuwatchd.join import cuda_oom as oom_reader
from gpuwatchd.model import Finding, GpuDevice, GpuProcessRow, NodeState, Orphan
from gpuwatchd.model.cuda_oom import OomEvent
from gpuwatchd.rank import cuda_oom
from gpuwatchd.sources import cuda_oom_events as oom_files

UUID = "GPU-d6a79800-1da5-699b-0f9c-f55eb218f8b2"
TORCH_TEXT = (
    "CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total capacity of 139.80 GiB "
    "of which 129.84 GiB is free. Process 449 has 630.00 MiB memory in use. Process 453 has "
    "5.60 GiB memory in use."
)
ROOT = Path(__file__).resolve().parent.parent
CLAIMS = {("dflash", 0): frozenset({os.getuid()})}  # this uid's rank 0 of job dflash


def _rank_script(rank_dir: Path, body: str) -> str:
    return textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from gpuwatchd.rank import cuda_oom
        print(cuda_oom.install_hook({str(rank_dir)!r}, "dflash", 0), flush=True)
    """) + textwrap.dedent(body)


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_uncaught_torch_style_oom_writes_one_event_and_still_crashes(tmp_path: Path) -> None:
    body = f"""
        class OutOfMemoryError(RuntimeError):
            pass
        raise OutOfMemoryError({TORCH_TEXT!r})
    """
    r = _run(_rank_script(tmp_path, body))
    assert r.returncode == 1
    assert "OutOfMemoryError: CUDA out of memory" in r.stderr  # the original hook still prints
    assert "excepthook" in r.stdout
    (name,) = os.listdir(tmp_path)
    assert name.startswith("cuda_oom-dflash-0-") and name.endswith(".event")
    doc = json.loads((tmp_path / name).read_text())
    assert doc["kind"] == "cuda_oom" and doc["job_id"] == "dflash" and doc["rank"] == 0
    assert doc["requested_bytes"] == 200 * (1 << 30)
    assert doc["message"].startswith("CUDA out of memory. Tried to allocate 200.00 GiB")


def test_other_errors_and_threads(tmp_path: Path) -> None:
    body = """
        import threading
        t = threading.Thread(target=lambda: (_ for _ in ()).throw(
            RuntimeError("CUDA error: out of memory")))
        t.start(); t.join()
        raise ValueError("not an OOM")
    """
    r = _run(_rank_script(tmp_path, body))
    assert r.returncode == 1 and "ValueError: not an OOM" in r.stderr
    events = [n for n in os.listdir(tmp_path) if n.endswith(".event")]
    assert len(events) == 1  # the thread's CUDA error, not the ValueError


def test_observer_records_at_allocation_time(tmp_path: Path) -> None:
    hook = cuda_oom.OomHook(str(tmp_path), "j", 3)
    path = cuda_oom.record_event(
        hook, device=None, requested_bytes=50 << 30, free_bytes=38 << 30, source="allocator", now=10.0
    )
    assert path is not None
    events, problems = oom_files.read_events(str(tmp_path))
    assert problems == [] and len(events) == 1
    ev = events[0]
    assert (ev.job_id, ev.rank, ev.requested_bytes, ev.timestamp) == ("j", 3, 50 << 30, 10.0)
    assert os.listdir(tmp_path) == []  # consumed


def test_bad_event_files_are_skipped_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "cuda_oom-a.event").write_text("{not json")
    (tmp_path / "cuda_oom-b.event").write_text(json.dumps({"kind": "other"}))
    (tmp_path / "cuda_oom-c.event").write_bytes(b"x" * (cuda_oom.MAX_EVENT_BYTES + 10))
    os.symlink("/etc/passwd", tmp_path / "cuda_oom-d.event")
    (tmp_path / "dflash.json").write_text("{}")  # a rank file: not ours
    events, problems = oom_files.read_events(str(tmp_path))
    assert events == [] and len(problems) == 4
    assert os.listdir(tmp_path) == ["dflash.json"]


def _state() -> NodeState:
    gpu = GpuDevice(0, UUID, "NVIDIA H200", "00000000:00:06.0", 150754820096, 10788405248, 0.01)
    rows = (
        GpuProcessRow(0, UUID, 447, 2787115008, "python3", "root", "dflash", "0"),
        GpuProcessRow(0, UUID, 453, 59818579968, "python3", "root", "", ""),
        GpuProcessRow(0, UUID, 460, 1 << 30, "python3", "alice", "other", "2"),
    )
    orphan = Orphan(0, UUID, 453, 59818579968, "python3", "root", "reparented_to_init", 1.0)
    return NodeState(timestamp=5.0, gpus=(gpu,), gpu_processes=rows, orphans=(orphan,))


def _explain(ev: OomEvent, state: NodeState) -> tuple[str, Finding]:
    """(gpu label, finding): the join attributes the event, the ``cuda_oom`` rule words it."""
    oom = oom_reader.attribute(ev, state)
    return oom.gpu, oom_rule.oom_finding(oom)


def test_explanation_names_the_co_tenant_and_why_it_is_there() -> None:
    ev = OomEvent("dflash", 0, 447, 100.0, UUID, 50 << 30, ((447, 2787115008), (453, 59818579968), (460, 1 << 30)))
    gpu, f = _explain(ev, _state())
    assert gpu == "0"
    assert f.kind == "cuda_oom" and (f.job_id, f.rank, f.pid) == ("dflash", "0", "447")
    assert f.explanation == (
        "rank 0 of job dflash (pid 447) hit CUDA OOM on GPU 0 (tried to allocate 50.0 GiB); "
        "PID 453 (python3, not in any job, its parent died and it was adopted by init) held "
        "55.7 GiB there; PID 460 (python3, rank 2 of job other) held 1.0 GiB there"
    )


def test_a_rank_in_a_container_is_named_by_its_host_pid() -> None:
    """The rank wrote the PID its container sees (1); NVML's co-tenant list has host PIDs."""
    import dataclasses

    from gpuwatchd.model import RankState

    rank = RankState("dflash", 0, 447, 0, 1, True, None, ns_pid=1)
    state = dataclasses.replace(_state(), ranks=(rank,))
    ev = OomEvent("dflash", 0, 1, 100.0, UUID, 50 << 30, ((447, 2787115008), (460, 1 << 30)))
    _, f = _explain(ev, state)
    assert f.pid == "447"
    assert f.explanation == (
        "rank 0 of job dflash (pid 447 (1 in its container)) hit CUDA OOM on GPU 0 (tried to "
        "allocate 50.0 GiB); PID 460 (python3, rank 2 of job other) held 1.0 GiB there"
    )


def test_without_snapshot_the_daemons_reading_is_used() -> None:
    ev = OomEvent("dflash", 0, 447, 100.0, UUID, None, None)
    _, f = _explain(ev, _state())
    assert "PID 453" in f.explanation and "55.7 GiB" in f.explanation
    assert "tried to allocate" not in f.explanation


def test_tracker_counts_and_expires(tmp_path: Path) -> None:
    now = [1000.0]
    counters = CounterStore()
    tr = oom_reader.OomTracker(clock=lambda: now[0])
    files = oom_files.OomEventFiles(str(tmp_path))
    hook = cuda_oom.OomHook(str(tmp_path), "dflash", 0)
    cuda_oom.record_event(hook, device=None, requested_bytes=1 << 30, source="allocator", now=1000.0)
    (f,) = tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS)
    assert counters.get("cuda_oom_errors", ("dflash", "0", "")) == 1  # no UUID: GPU unknown
    assert f.since == 1000.0
    now[0] = 1000.0 + oom_reader.FINDING_SECONDS + 1
    assert tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS) == []
    assert counters.get("cuda_oom_errors", ("dflash", "0", "")) == 1


def test_the_rank_directory_is_listed_only_when_a_file_came_or_went(tmp_path: Path) -> None:
    """The rank directory used to be listed every cycle (rank files and heartbeats: about 130
    entries at 64 ranks) to find event files; it is now listed when its mtime says a file came or
    went, or changed so recently that a file made in the same timestamp tick could hide."""
    counters = CounterStore()
    tr = oom_reader.OomTracker()
    files = oom_files.OomEventFiles(str(tmp_path))
    (tmp_path / "j.0.hb").write_text("1")
    old = os.stat(tmp_path).st_mtime - 60
    os.utime(tmp_path, (old, old))  # settled a minute ago
    for _ in range(3):
        assert tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS) == []
    assert files.scans == 1
    (tmp_path / "j.0.hb").write_text("2")  # a heartbeat, written in place: no listing
    tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS)
    assert files.scans == 1
    hook = cuda_oom.OomHook(str(tmp_path), "dflash", 0)
    cuda_oom.record_event(hook, device=None, requested_bytes=1 << 30, source="allocator")
    # the event file changed the directory
    assert len(tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS)) == 1
    assert files.scans == 2 and counters.get("cuda_oom_errors", ("dflash", "0", "")) == 1
    cuda_oom.record_event(hook, device=None, requested_bytes=1 << 30, source="allocator")
    mtime = os.stat(tmp_path).st_mtime_ns
    tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS)  # (and removed it: listed again next time)
    assert counters.get("cuda_oom_errors", ("dflash", "0", "")) == 2
    cuda_oom.record_event(hook, device=None, requested_bytes=1 << 30, source="allocator")
    os.utime(tmp_path, ns=(mtime, mtime))  # a coarse clock: the mtime did not move, but is recent
    tr.observe(files.read(), counters.inc, _state(), claims=CLAIMS)
    assert counters.get("cuda_oom_errors", ("dflash", "0", "")) == 3  # not missed
