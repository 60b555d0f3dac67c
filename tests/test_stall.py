"""stall.py on real rank processes (registered through gpuwatchd.register_rank / heartbeat), real
py-spy dumps and the real /proc; the odd-one-out logic also on plain verdicts."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatchd.join.stall import StallTracker
from gpuwatchd.join.stall_verdicts import name_suspects
from gpuwatchd.model.stall import RankProbe, StallVerdict
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.stall_looks import StallLooks
from gpuwatchd.sources.threads import process_state

PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
AFTER = 1.0
CYCLE = 0.25


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[str], RankProbe]]]:
    started: list[subprocess.Popen[str]] = []

    def launch(mode: str, rank: int = 0, job: str = "stall-test") -> tuple[subprocess.Popen[str], RankProbe]:
        p = subprocess.Popen(
            [sys.executable, str(PROGRAMS / "rank.py"), mode, str(tmp_path), job, str(rank)],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        (doc_path,) = glob.glob(str(tmp_path / f"{job}*{rank}*.json")) or glob.glob(str(tmp_path / "*.json"))
        entry = next(e for e in json.loads(Path(doc_path).read_text())["ranks"] if e["rank"] == rank)
        assert entry["pid"] == p.pid
        return p, RankProbe(job, rank, p.pid, True, "S", entry.get("heartbeat"))

    yield launch
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def probe(p: RankProbe) -> RankProbe:
    """Refresh alive/state from /proc, as the daemon's procfs source does every cycle."""
    state = process_state(pyspy.HostPaths(), p.pid)
    return RankProbe(p.job_id, p.rank, p.pid, state not in (None, "Z"), state or "", p.heartbeat)


def run_until(
    tracker: StallTracker,
    probes: list[RankProbe],
    seconds: float,
    stop: Callable[[dict[tuple[str, int], StallVerdict]], bool] | None = None,
) -> tuple[float, dict[tuple[str, int], StallVerdict]]:
    """Observe once per CYCLE until ``stop`` says so or ``seconds`` pass; (time, verdicts)."""
    t0 = time.time()
    while True:
        now = time.time()
        verdicts = tracker.observe(now, [probe(p) for p in probes])
        if (stop and stop(verdicts)) or now - t0 >= seconds:
            return now, verdicts
        time.sleep(CYCLE)


def spy() -> PySpy:
    return PySpy(pyspy.resolve_pyspy())


def test_heartbeat_stops_while_blocked_on_a_lock(ranks: Callable) -> None:
    _p, rp = ranks("beat_then_lock")
    assert rp.heartbeat and rp.heartbeat.endswith("stall-test.0.hb")
    tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
    now, v = run_until(tracker, [rp], 6.0, lambda v: v[rp.key].stalled)
    verdict = v[rp.key]
    assert verdict.stalled and verdict.method == "heartbeat"
    last_beat = os.stat(rp.heartbeat).st_mtime
    assert verdict.progress_timestamp == last_beat
    # stalled within after_seconds plus one cycle of the last heartbeat (plus scheduling slack)
    assert now - last_beat <= AFTER + CYCLE + 0.3, now - last_beat
    assert Path(rp.heartbeat).read_text() != "0"  # heartbeat(step) wrote the step
    assert any(f.startswith("wait_for_peer (rank.py:") for f in verdict.stuck_frames)


def test_healthy_beating_rank_is_never_stalled(ranks: Callable) -> None:
    _p, rp = ranks("beat")
    tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
    t0 = time.time()
    seen = []
    while time.time() - t0 < 3 * AFTER:
        v = tracker.observe(time.time(), [probe(rp)])[rp.key]
        seen.append(v.stalled)
        assert v.progress_timestamp is not None and time.time() - v.progress_timestamp < AFTER
        time.sleep(CYCLE)
    assert len(seen) >= 8 and not any(seen)


@pytest.mark.parametrize("mode", ["beat", "stuck"])
def test_sigstopped_rank_is_stalled(ranks: Callable, mode: str) -> None:
    p, rp = ranks(mode)
    tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
    run_until(tracker, [rp], 0.6)
    os.kill(p.pid, signal.SIGSTOP)
    stopped_at = time.time()
    now, v = run_until(tracker, [rp], 6.0, lambda v: v[rp.key].stalled)
    assert v[rp.key].stalled, v[rp.key]
    assert now - stopped_at <= AFTER + 2 * CYCLE + 0.5
    assert v[rp.key].method in ("heartbeat", "stopped", "stack")
    os.kill(p.pid, signal.SIGCONT)


def test_rank_without_heartbeat_stuck_in_the_same_frames(ranks: Callable) -> None:
    _p, rp = ranks("stuck")
    assert rp.heartbeat is None
    tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
    t0 = time.time()
    now, v = run_until(tracker, [rp], 6.0, lambda v: v[rp.key].stalled)
    verdict = v[rp.key]
    assert verdict.stalled and verdict.method == "stack"
    assert now - t0 <= AFTER + 3 * CYCLE + 0.5
    assert verdict.stuck_frames[-1].startswith("<module> (rank.py:")
    assert any(f.startswith("wait_for_peer") for f in verdict.stuck_frames)
    assert "threads" in verdict.threads_summary


def test_without_pyspy_the_proc_view_still_sees_the_stuck_rank(ranks: Callable) -> None:
    _p, rp = ranks("stuck")
    tracker = StallTracker(AFTER, StallLooks(PySpy(None)), dump_interval_seconds=CYCLE)
    _, v = run_until(tracker, [rp], 6.0, lambda v: v[rp.key].stalled)
    assert v[rp.key].stalled and v[rp.key].method == "proc" and v[rp.key].stuck_frames == ()


def test_busy_rank_without_heartbeat_is_not_stalled(tmp_path: Path) -> None:
    prog = tmp_path / "busy.py"
    prog.write_text(
        # works ~2/3 of the time, in varying frames that a dump may or may not catch
        "import time\nprint('ready', flush=True)\nwhile True:\n"
        "    x = sum(j * j for j in range(20000))\n    time.sleep(0.005)\n"
    )
    p = subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        rp = RankProbe("busy", 0, p.pid, True, "S", None)
        tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
        _, v = run_until(tracker, [rp], 3 * AFTER, lambda v: v[rp.key].stalled)
        assert not v[rp.key].stalled
    finally:
        p.kill()
        p.wait()


def test_busy_rank_whose_dumps_never_change_is_not_stalled(tmp_path: Path) -> None:
    """Its one Python thread works about half of the time in C (``sum``), so every dump shows the
    same frame: only its CPU says it progresses. On Python 3.10 py-spy gives that thread no tid
    (py-spy #567): the tracker then takes the CPU of the process's tasks."""
    prog = tmp_path / "same.py"
    prog.write_text(
        "import time\nprint('ready', flush=True)\nwhile True: x = sum(range(1_000_000)); time.sleep(0.02)\n"
    )
    p = subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        rp = RankProbe("same", 0, p.pid, True, "S", None)
        tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
        _, v = run_until(tracker, [rp], 4 * AFTER, lambda v: v[rp.key].stalled)
        assert not v[rp.key].stalled, v[rp.key]
    finally:
        p.kill()
        p.wait()


def test_odd_one_out_among_real_ranks(ranks: Callable) -> None:
    probes = [ranks("barrier", r, "llm-7")[1] for r in range(3)]
    probes.append(ranks("elsewhere", 3, "llm-7")[1])
    tracker = StallTracker(AFTER, StallLooks(spy()), dump_interval_seconds=CYCLE)
    _, v = run_until(tracker, probes, 8.0, lambda v: all(x.stalled for x in v.values()))
    assert all(x.stalled for x in v.values())
    assert [k[1] for k, x in sorted(v.items()) if x.suspect] == [3]
    reason = v[("llm-7", 3)].suspect_reason
    assert "load_batch (rank.py)" in reason and "3 peer(s)" in reason and "all_reduce" in reason


def _v(rank: int, *, alive: bool = True, stalled: bool = False, where: tuple[str, ...] = ()) -> StallVerdict:
    return StallVerdict("j", rank, 100 + rank, alive, 0.0, stalled, "stack" if alive else "dead", 0.0, location=where)


def test_name_suspects_rules() -> None:
    coll = ("all_reduce (distributed_c10d.py)",)
    # a dead rank among live ranks is the suspect, whatever the others do
    out = name_suspects({(v.job_id, v.rank): v for v in [_v(0, stalled=True, where=coll), _v(1, alive=False)]})
    assert [r for (_, r), v in out.items() if v.suspect] == [1]
    # one rank still progressing while its peers wait in the collective never issued it
    out = name_suspects(
        {(v.job_id, v.rank): v for v in [_v(0, stalled=True, where=coll), _v(1, stalled=True, where=coll), _v(2)]}
    )
    assert [r for (_, r), v in out.items() if v.suspect] == [2]
    assert "still progressing" in out[("j", 2)].suspect_reason
    # one stalled rank among progressing peers
    out = name_suspects({(v.job_id, v.rank): v for v in [_v(0), _v(1), _v(2, stalled=True, where=coll)]})
    assert [r for (_, r), v in out.items() if v.suspect] == [2]
    # nothing stalled: no suspects; two ranks split evenly: no majority, no suspect
    assert not any(v.suspect for v in name_suspects({("j", 0): _v(0), ("j", 1): _v(1)}).values())
    out = name_suspects({("j", 0): _v(0), ("j", 1): _v(1, stalled=True, where=coll)})
    assert not any(v.suspect for v in out.values())


def test_heartbeat_file_missing_counts_from_first_sight(tmp_path: Path) -> None:
    tracker = StallTracker(AFTER, StallLooks(None))
    p = RankProbe("j", 0, os.getpid(), True, "R", str(tmp_path / "never-written.hb"))
    v0 = tracker.observe(1000.0, [p])[p.key]
    assert v0.progress_timestamp == 1000.0 and not v0.stalled
    v1 = tracker.observe(1000.0 + AFTER + 0.1, [p])[p.key]
    assert v1.stalled and v1.method == "heartbeat"
    # a dead rank is never "stalled" (rank_down says it), and a new pid resets the memory
    dead = RankProbe("j", 0, os.getpid(), False)
    assert not tracker.observe(1010.0, [dead])[p.key].stalled


def test_daemon_names_the_odd_rank_of_a_hung_job(tmp_path: Path) -> None:
    """Four ranks without heartbeats through the real daemon: three wait in all_reduce, one is
    stuck in load_batch; every rank is stalled and the findings name rank 3 as the suspect."""
    from daemonutil import DaemonProc, write_config

    cfg_path, cfg = write_config(tmp_path, stall={"after_seconds": 1.5})
    rank_dir = cfg["rank_dir"]
    started = []
    try:
        for r, mode in enumerate(["barrier", "barrier", "barrier", "elsewhere"]):
            p = subprocess.Popen(
                [sys.executable, str(PROGRAMS / "rank.py"), mode, rank_dir, "llm-7", str(r)],
                stdout=subprocess.PIPE,
                text=True,
            )
            started.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        d = DaemonProc(cfg_path, cfg)
        try:
            d.wait_for(
                lambda: all(d.value("gpuwatch_rank_stalled", job_id="llm-7", rank=str(r)) == 1.0 for r in range(4)),
                timeout=30,
                what="all four ranks stalled",
            )
            assert d.value("gpuwatch_collector_success", collector="pyspy") == 1.0

            def findings() -> dict[str, str]:
                state = json.loads((Path(cfg["state_dir"]) / "state.json").read_text())
                return {f["rank"]: f["explanation"] for f in state["findings"] if f["kind"] == "rank_stalled"}

            d.wait_for(lambda: len(findings()) == 4, what="four rank_stalled findings")
            f = findings()
            assert "odd one out" in f["3"] and "load_batch (rank.py" in f["3"]
            assert "suspect: rank 3" in f["0"] and "all_reduce (rank.py:" in f["0"]
        finally:
            assert d.stop() == 0
    finally:
        for p in started:
            p.kill()
            p.wait()


def test_heartbeat_owned_by_another_user_is_ignored(tmp_path: Path) -> None:
    """A rank file of uid U naming a heartbeat owned by someone else: its mtime is never used
    (it would leak through gpuwatch_rank_progress_timestamp_seconds), even if it is fresh."""
    import pwd

    try:
        other = pwd.getpwnam("gw-pyspy-target").pw_uid
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "gw-pyspy-target"], check=True
        )
        other = pwd.getpwnam("gw-pyspy-target").pw_uid
    hb = tmp_path / "someone-elses.hb"
    hb.write_text("1")
    os.utime(hb, (5010.0, 5010.0))  # "fresh": later than every observation below
    tracker = StallTracker(AFTER, StallLooks(None))
    p = RankProbe("j", 0, os.getpid(), True, "R", str(hb), owner_uid=other)
    v = tracker.observe(5000.0, [p])[p.key]
    assert v.progress_timestamp == 5000.0  # first sight, not the file
    v = tracker.observe(5000.0 + AFTER + 1, [p])[p.key]
    assert v.stalled and v.progress_timestamp == 5000.0
    os.chown(hb, other, -1)
    v = tracker.observe(5000.0 + AFTER + 2, [p])[p.key]
    assert v.progress_timestamp == 5010.0 and not v.stalled  # now the owner's own file
