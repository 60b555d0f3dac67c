"""Orphan detection on real processes of this host, with GPU memory from the H200 recording.

The recorded PIDs (447 rank, 453 nohup'ed 5 GiB holder, 449/450 DataLoader ranks) are mapped onto
live local processes in the same situation: a registered rank, a child whose wrapper was killed
(reparented to init), a zombie, a PID that no longer exists, and so on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import FindingContext
from gpuwatchd.findings import orphan_gpu_memory as orphan_rule
from gpuwatchd.join.orphans import OrphanTracker, RankTrees, offenders, trees_from_entries
from gpuwatchd.model import DEFUNCT, JOB_ENDED, REPARENTED, UNREGISTERED, RankEntry
from gpuwatchd.model.parts import GpuOutput, Tracked
from gpuwatchd.sources.nvml_fixture import fixture_source
from gpuwatchd.sources.procfs import ProcfsReader

H200 = Path(__file__).parent / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
procfs = ProcfsReader()


def _sleep() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _orphan_of_killed_wrapper() -> tuple[int, subprocess.Popen[bytes]]:
    """sh (the wrapper) starts a nohup'ed child and waits; returns (child pid, wrapper)."""
    wrapper = subprocess.Popen(
        ["sh", "-c", f"nohup {sys.executable} -c 'import time; time.sleep(120)' >/dev/null 2>&1 & echo $!; wait"],
        stdout=subprocess.PIPE,
    )
    assert wrapper.stdout is not None
    child = int(wrapper.stdout.readline())
    return child, wrapper


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _wait_ppid(pid: int, not_ppid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        info = procfs.read_process(pid)
        if info is not None and info.ppid != not_ppid:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} was not reparented")


def _cycle(source, entries, tracker, now):  # type: ignore[no-untyped-def]
    devices, gpu = source.read()
    pids = {e.pid for e in entries} | {p.pid for p in gpu}
    processes = procfs.read_many(pids)
    desc = {e.pid: tuple(procfs.descendants(e.pid)) for e in entries}
    processes = {**processes, **procfs.read_many(k for ks in desc.values() for k in ks)}
    trees = trees_from_entries(entries, processes, desc)
    return tracker.update(gpu, processes, trees, now), processes, devices


def test_seed_scenario_reparented_holder_after_grace(procs: list) -> None:
    rank = _sleep()
    procs.append(rank)
    child, wrapper = _orphan_of_killed_wrapper()
    procs.append(wrapper)
    source = fixture_source(str(H200), pid_map={447: rank.pid, 453: child, 449: rank.pid, 450: rank.pid})
    entries = [RankEntry(job_id="dflash", rank=0, pid=rank.pid)]
    tracker = OrphanTracker(grace_seconds=60)
    t0 = 1000.0
    found, _, _ = _cycle(source, entries, tracker, t0)
    assert found == ()  # the child still has its wrapper: unregistered, but within grace
    wrapper.send_signal(signal.SIGKILL)
    wrapper.wait()
    _wait_ppid(child, wrapper.pid)
    found, _, _ = _cycle(source, entries, tracker, t0 + 30)
    assert found == ()  # still within the 60 s grace period
    found, processes, _ = _cycle(source, entries, tracker, t0 + 61)
    try:
        assert [(o.pid, o.reason, o.used_memory_bytes, o.gpu_index) for o in found] == [
            (child, REPARENTED, 6008340480, 0)
        ]
        o = found[0]
        assert o.comm == processes[child].comm and o.user == "root"
        assert o.first_seen == t0
        ctx = FindingContext(
            now=t0 + 61 + 0.0, config=Config(), processes=processes, parts=Tracked(gpu=GpuOutput(orphans=found))
        )
        (finding,) = list(orphan_rule.find(ctx))
        text = finding.explanation
        assert finding.kind == "orphan_gpu_memory" and finding.pid == str(child)
        for part in (
            f"PID {child}",
            "user root",
            o.comm,
            "5.6 GiB",
            "GPU 0",
            "running",
            "adopted by init",
            "stale for 61 s",
        ):
            assert part in text, (part, text)
    finally:
        os.kill(child, signal.SIGKILL)


def test_job_ended_when_rank_file_removed_but_process_lives(procs: list) -> None:
    rank = _sleep()
    procs.append(rank)
    source = fixture_source(str(H200), pid_map={447: rank.pid, 453: _dead_pid(), 449: rank.pid, 450: rank.pid})
    tracker = OrphanTracker(grace_seconds=0)
    entries = [RankEntry(job_id="llm-7", rank=0, pid=rank.pid)]
    found, _, _ = _cycle(source, entries, tracker, 10.0)
    assert [o.reason for o in found] == [DEFUNCT]  # the recorded PID that /proc lacks
    found, _, _ = _cycle(source, [], tracker, 20.0)  # the job's rank file is gone
    reasons = {o.pid: o.reason for o in found}
    assert reasons[rank.pid] == JOB_ENDED
    assert tracker.past_job(rank.pid, procfs.read_process(rank.pid).start_ticks) == "llm-7"


def test_unregistered_only_when_some_rank_is_registered(procs: list) -> None:
    rank, stranger = _sleep(), _sleep()
    procs += [rank, stranger]
    source = fixture_source(str(H200), pid_map={447: rank.pid, 453: stranger.pid, 449: rank.pid, 450: rank.pid})
    found, _, _ = _cycle(source, [RankEntry(job_id="j", rank=0, pid=rank.pid)], OrphanTracker(0), 1.0)
    assert [(o.pid, o.reason) for o in found] == [(stranger.pid, UNREGISTERED)]
    # no job registered at all: the daemon cannot tell, and says nothing
    found, _, _ = _cycle(source, [], OrphanTracker(0), 1.0)
    assert found == ()


def test_zombie_and_missing_pid_are_defunct(procs: list) -> None:
    zombie = subprocess.Popen(["true"])
    procs.append(zombie)
    deadline = time.monotonic() + 5
    while procfs.read_process(zombie.pid).state != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    gone = _dead_pid()
    source = fixture_source(str(H200), pid_map={447: zombie.pid, 453: gone, 449: gone, 450: gone})
    _devices, gpu = source.read()
    processes = procfs.read_many(p.pid for p in gpu)
    assert gone not in processes  # NVML lists it, /proc lacks it
    got = offenders(gpu, processes, RankTrees(), now=5.0)
    assert {(o.pid, o.reason) for o in got} == {(zombie.pid, DEFUNCT), (gone, DEFUNCT)}
    assert next(o for o in got if o.pid == gone).comm == ""


def test_rank_descendants_are_not_orphans(procs: list) -> None:
    # a rank whose child (e.g. a compile worker) holds GPU memory is fine
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; c=subprocess.Popen([sys.executable,'-c',"
            "'import time; time.sleep(120)']); print(c.pid, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    procs.append(rank)
    assert rank.stdout is not None
    child = int(rank.stdout.readline())
    try:
        source = fixture_source(str(H200), pid_map={447: rank.pid, 453: child, 449: child, 450: child})
        found, _, _ = _cycle(source, [RankEntry(job_id="j", rank=0, pid=rank.pid)], OrphanTracker(0), 1.0)
        assert found == ()
    finally:
        os.kill(child, signal.SIGKILL)


def test_pid_reuse_restarts_the_grace_period(procs: list) -> None:
    from gpuwatchd.model import GpuProcess

    a = _sleep()
    procs.append(a)
    info = procfs.read_process(a.pid)
    gp = GpuProcess(gpu_index=0, uuid="GPU-x", pid=a.pid, used_memory_bytes=1 << 30)
    trees = RankTrees(known_jobs=frozenset({"j"}))
    tracker = OrphanTracker(grace_seconds=10)
    assert tracker.update([gp], {a.pid: info}, trees, 0.0) == ()
    reused = info.__class__(**{**info.__dict__, "start_ticks": info.start_ticks + 1})
    assert tracker.update([gp], {a.pid: reused}, trees, 11.0) == ()  # new process: new grace
    assert len(tracker.update([gp], {a.pid: reused}, trees, 21.5)) == 1


def test_adoption_by_a_sub_reaper_is_noticed_as_reparenting(procs: list) -> None:
    """Where a sub-reaper (systemd --user, a container init) adopts the orphan, PPID is not 1;
    the tracker still sees the parent change since first sight."""
    from dataclasses import replace

    from gpuwatchd.model import GpuProcess

    a = _sleep()
    procs.append(a)
    info = procfs.read_process(a.pid)
    gp = GpuProcess(gpu_index=0, uuid="GPU-x", pid=a.pid, used_memory_bytes=5 << 30)
    trees = RankTrees(known_jobs=frozenset({"j"}))
    tracker = OrphanTracker(grace_seconds=0)
    assert [o.reason for o in tracker.update([gp], {a.pid: info}, trees, 0.0)] == [UNREGISTERED]
    adopted = replace(info, ppid=info.ppid + 100000)  # the sub-reaper's PID
    assert [o.reason for o in tracker.update([gp], {a.pid: adopted}, trees, 1.0)] == [REPARENTED]


def test_a_reused_pid_is_no_rank_once_the_join_knows_the_ranks_start(procs: list) -> None:
    """Liveness is one rule computed once per cycle (``trees_from_entries``, the daemon's
    ``Ranks.trees``): a claim without a start time whose PID now names another process is dead
    by the start time the join first saw, for the NVML part's orphans as for the join (which
    alone knew it: the GPU memory of the PID's new process was the dead rank's)."""
    holder = _sleep()
    procs.append(holder)
    processes = procfs.read_many([holder.pid])
    e = RankEntry(job_id="j", rank=0, pid=holder.pid)  # registered without start_ticks
    assert trees_from_entries([e], processes, {}).owner == {holder.pid: ("j", 0)}
    first_seen = {e.rank_process: processes[holder.pid].start_ticks - 1}  # another process then
    trees = trees_from_entries([e], processes, {}, first_seen)
    assert trees.owner == {} and trees.alive == frozenset() and trees.known_jobs == {"j"}
