"""rank_memory_pressure for real: ranks in real memory cgroups (v1 on this machine), the real
daemon cycle (rank files, /proc, the memory and kernel-log subsystems), real py-spy snapshots, a
real kernel OOM kill read from /dev/kmsg, and `gpuwatchd events` run as a command."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_oom_helpers import MemCgroup

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.kernel_log import KernelLogSubsystem
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import Subsystem
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import JsonlSink, read_events
from gpuwatchd.model import Finding, NodeState
from gpuwatchd.model.events import Event
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.pyspy import PySpy, resolve_pyspy

REPO = Path(__file__).resolve().parent.parent
LIMIT = 192 << 20
STEP, PERIOD = 2 << 20, 0.25  # the worker grows 8 MiB/s: from ~30 MiB to the limit in ~20 s

# The rank waits on its DataLoader-like worker in load_shard(); the worker grows without end.
RANK_PROGRAM = f'''\
import subprocess, sys

WORKER = """
import sys, time
held = []
print(flush=True)
while True:
    held.append(bytearray({STEP}))
    time.sleep({PERIOD})
"""


def load_shard(worker):
    return worker.stdout.readline()


def main():
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE)
    print(worker.pid, flush=True)
    while True:
        if not load_shard(worker):
            sys.stdin.readline()  # the worker died: stay alive, as a rank waiting in a collective


main()
'''
STEADY_LIMIT = 256 << 20
STEADY_PROGRAM = "import sys; held = bytearray(200 << 20); print(flush=True); sys.stdin.read()"


UNIFIED = Path("/sys/fs/cgroup/unified")  # this host's v2 hierarchy (hybrid): PSI, no controllers


@pytest.fixture
def cgroups() -> Iterator[tuple[MemCgroup, MemCgroup, Path]]:
    """The growing rank's v1 memory cgroup, the steady rank's, and a v2 cgroup for the growing
    rank's own PSI (memory.pressure)."""
    grow, steady = MemCgroup("gwmemory_grow", LIMIT), MemCgroup("gwmemory_steady", STEADY_LIMIT)
    psi = UNIFIED / f"gwmemory_psi_{uuid.uuid4().hex[:8]}"
    psi.mkdir()
    try:
        yield grow, steady, psi
    finally:
        grow.remove()
        steady.remove()
        for _ in range(100):  # empty once the killed tree is reaped
            try:
                psi.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def daemon(tmp_path: Path, **memory: float) -> tuple[Daemon, list[Subsystem]]:
    cfg_file = tmp_path / "config.yaml"
    settings = {
        "min_window_seconds": 4,
        "window_seconds": 30,
        "horizon_seconds": 120,
        "snapshot_min_interval_seconds": 2,
        **memory,
    }
    cfg_file.write_text(
        f"rank_dir: {tmp_path / 'ranks'}\nstate_dir: {tmp_path / 'state'}\ninterval_seconds: 0.5\n"
        "kernel_log: kmsg\ngil:\n  enabled: false\ndiscovery:\n  enabled: false\n"
        "nvml:\n  enabled: false\nmemory:\n" + "".join(f"  {k}: {v}\n" for k, v in settings.items())
    )
    (tmp_path / "ranks").mkdir(exist_ok=True)
    cfg = load_config(str(cfg_file))
    d = Daemon(
        cfg,
        services=Services.build(cfg, bus=EventBus([JsonlSink(cfg.state_dir)])),
        parts=lambda c, s: Parts(
            kernel_log=KernelLogSubsystem(c, s),
            memory=MemorySubsystem(c, s, spy=PySpy(resolve_pyspy(), max_concurrent=1)),
        ),
    )
    subs = d.subsystems
    for sub in subs:
        sub.start(d)
    return d, subs


def register(tmp_path: Path, job: str, rank: int, pid: int) -> None:
    write_rank_file(
        str(tmp_path / "ranks"),
        {"version": 1, "job_id": job, "world_size": 8, "ranks": [{"rank": rank, "pid": pid}]},
        f"{job}-{rank}.json",
    )


def events(tmp_path: Path) -> list[Event]:
    return list(read_events(str(tmp_path / "state" / "events.jsonl")))


def pressure(state: NodeState, job: str) -> list[Finding]:
    return [f for f in state.findings if f.kind == "rank_memory_pressure" and f.job_id == job]


def test_growing_rank_warned_before_its_oom_kill_with_evidence(
    tmp_path: Path, cgroups: tuple[MemCgroup, MemCgroup, Path]
) -> None:
    grow_cg, steady_cg, psi_cg = cgroups
    (tmp_path / "data.py").write_text(RANK_PROGRAM)
    job, steady_job = f"llm-{uuid.uuid4().hex[:6]}", f"calm-{uuid.uuid4().hex[:6]}"
    d, subs = daemon(tmp_path)

    def enter() -> None:  # in the child before exec: the v1 memory cgroup and the v2 one
        for procs in (Path(grow_cg.path) / "cgroup.procs", psi_cg / "cgroup.procs"):
            procs.write_text(str(os.getpid()))

    rank = subprocess.Popen(
        [sys.executable, str(tmp_path / "data.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=enter
    )
    grow_cg.procs.append(rank)
    steady = steady_cg.spawn(STEADY_PROGRAM)
    try:
        assert rank.stdout is not None and steady.stdout is not None
        worker = int(rank.stdout.readline())
        steady.stdout.readline()  # its 200 MiB are held: ~82 % of the limit, and steady
        register(tmp_path, job, 3, rank.pid)
        register(tmp_path, steady_job, 0, steady.pid)
        first: tuple[float, Finding] | None = None
        last_reading = None
        steady_findings: list[Finding] = []
        kill: Event | None = None
        deadline = time.monotonic() + 90
        while kill is None and time.monotonic() < deadline:
            state = d.cycle()
            steady_findings += pressure(state, steady_job)
            found = pressure(state, job)
            last_reading = next((m for m in state.rank_memory if m.job_id == job), last_reading)
            if found and first is None:
                first = (time.time(), found[0])
            kill = next((e for e in events(tmp_path) if e.kind == "oom_kill" and e.job_id == job), None)
            time.sleep(0.5)
        assert kill is not None, "the worker was never OOM-killed"
        state = d.cycle()  # the finding the kill raises
        ps = subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "ps", "--config.file", str(tmp_path / "config.yaml")],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=True,
        ).stdout
    finally:
        for s in subs:
            s.stop()
        for p in (rank, steady):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    # -- warned before the kill, with a sensible time to the limit ---------------------------------
    assert first is not None, "no rank_memory_pressure before the kill"
    raised_at, f = first
    assert f.severity == "warning" and (f.rank, f.pid) == ("3", str(rank.pid))
    assert f.evidence["reason"] in ("limit_trend", "share")
    ttl = float(f.evidence["seconds_to_limit"])
    remaining = kill.time - raised_at
    assert remaining > 0 and 0.4 * ttl <= remaining <= 2.5 * ttl + 5, (ttl, remaining)
    assert f"of the 192.0 MiB limit of memory cgroup {grow_cg.kernel_path}" in f.explanation
    assert "it reaches the limit in about" in f.explanation
    print("\nFINDING:", f.explanation)
    # -- the rank's own PSI (its v2 cgroup) saw the reclaim stalls before the kill --------------------
    assert last_reading is not None and last_reading.pressure_some_seconds is not None
    print("PSI some total of the rank's cgroup before the kill:", last_reading.pressure_some_seconds)
    # -- the steady rank near its limit got none, though it was measured all along -------------------
    assert steady_findings == []
    (calm,) = [m for m in state.rank_memory if m.job_id == steady_job]
    assert calm.limit_bytes == STEADY_LIMIT and calm.working_set_bytes is not None
    assert 0.78 <= calm.working_set_bytes / STEADY_LIMIT < 0.9
    assert calm.cgroup_growth_bytes_per_second is not None and abs(calm.cgroup_growth_bytes_per_second) < 64 << 10
    # -- evidence: the snapshot holds the rank's frame and the growing worker -----------------------
    log = events(tmp_path)
    snaps = [e for e in log if e.kind == "memory_snapshot" and e.job_id == job]
    assert 1 <= len(snaps) <= 5
    # the last one recorded before the kill: a dump still running when the kill line is read is
    # recorded after it (the log's order), and the kill cannot link to what was not there yet
    at_kill = next(i for i, e in enumerate(log) if e.key == kill.key)
    snap = [e for e in log[:at_kill] if e in snaps][-1]
    assert "rank 3 was in load_shard (data.py:" in snap.summary, snap.summary
    assert f"worker {worker} (" in snap.summary and "had grown" in snap.summary
    grown = [p for p in snap.fields["processes"] if p["pid"] == worker]
    assert grown and grown[0]["gained_bytes"] > 16 << 20 and grown[0]["worker"]
    print("SNAPSHOT:", snap.summary)
    # -- the kill links to the last snapshot ---------------------------------------------------------
    assert kill.pid == worker and kill.worker
    assert kill.fields["memory_snapshot"] == snap.key
    assert f"last memory snapshot (event {snap.key}): {snap.summary}" in kill.summary
    (killed,) = [x for x in state.findings if x.kind == "rank_oom_killed" and x.job_id == job]
    assert killed.explanation.endswith(f"Before the kill: {snap.summary}")
    assert killed.evidence["memory_snapshot"] == snap.key
    print("KILL:", killed.explanation)
    # -- `gpuwatchd ps` shows each rank's cgroup use of its limit ----------------------------------
    (line,) = [x for x in ps.splitlines() if x.startswith(steady_job)]
    assert "% of 256.0 MiB" in line, ps
    # -- `gpuwatchd events` shows both, linked -------------------------------------------------------
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "events",
            "--state-dir",
            str(tmp_path / "state"),
            "--since",
            "all",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    listed = {e["key"]: e for e in json.loads(out)}
    assert listed[snap.key]["kind"] == "memory_snapshot"
    assert listed[kill.key]["fields"]["memory_snapshot"] == snap.key
