"""The flight-recorder dump: rank side (gpuwatchd/rank/flight_recorder.py, real threads and files),
the daemon side's file rules (gpuwatchd/join/flight_recorder.py), and the whole path through the real
daemon with two real rank processes that answer with the dumps recorded on the H200."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatchd.rank import flight_recorder as fr
from gpuwatchd.sources.flight_recorder_files import read_response, write_request

PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
FIX = Path(__file__).parent / "fixtures" / "hang"


def test_responder_answers_each_new_nonce_once(tmp_path: Path) -> None:
    calls = []

    def dump() -> dict:
        calls.append(1)
        return json.loads((FIX / "fr_gloo_rank0.json").read_text())["trace"]

    r = fr.Responder(str(tmp_path), "j", 0, dump=dump)
    assert not r.poll_once()  # no request yet
    write_request(fr.request_path(str(tmp_path), "j", 0), "n1")
    assert r.poll_once() and not r.poll_once()
    doc = read_response(fr.response_path(str(tmp_path), "j", 0), {os.getuid()})
    assert doc["nonce"] == "n1" and doc["pid"] == os.getpid()
    assert max(e["collective_seq_id"] for e in doc["trace"]["entries"]) == 5
    write_request(fr.request_path(str(tmp_path), "j", 0), "n2")
    assert r.poll_once() and len(calls) == 2


def test_responder_without_torch_answers_with_the_reason(tmp_path: Path) -> None:
    r = fr.Responder(str(tmp_path), "j", 1)  # the real torch_dump; torch is not imported here
    assert "torch" not in sys.modules
    write_request(fr.request_path(str(tmp_path), "j", 1), "n")
    assert r.poll_once()
    doc = json.loads(Path(fr.response_path(str(tmp_path), "j", 1)).read_text())
    assert doc["error"] == "RuntimeError: torch is not imported in this process"


def test_responder_keeps_answers_under_the_size_cap(tmp_path: Path) -> None:
    big = {
        "entries": [
            {"collective_seq_id": i, "pg_id": i % 3, "profiling_name": "x" * 2000, "state": "completed"}
            for i in range(5000)
        ]
    }
    r = fr.Responder(str(tmp_path), "j", 0, dump=lambda: big)
    write_request(fr.request_path(str(tmp_path), "j", 0), "n")
    assert r.poll_once()
    assert os.stat(fr.response_path(str(tmp_path), "j", 0)).st_size <= fr.MAX_BYTES


def test_response_file_rules(tmp_path: Path) -> None:
    good = tmp_path / "good.fr"
    good.write_text(json.dumps({"version": 1}))
    assert read_response(str(good), {os.getuid()}) == {"version": 1}
    link = tmp_path / "link.fr"
    link.symlink_to(good)
    with pytest.raises(OSError):  # ELOOP: never followed
        read_response(str(link), {os.getuid()})
    with pytest.raises(ValueError, match="owned by uid"):
        read_response(str(good), {12345})
    hard = tmp_path / "hard.fr"
    os.link(good, hard)
    with pytest.raises(ValueError, match="one link"):
        read_response(str(hard), {os.getuid()})
    os.unlink(hard)
    big = tmp_path / "big.fr"
    big.write_text(" " * (fr.MAX_BYTES + 1))
    with pytest.raises(ValueError, match="larger"):
        read_response(str(big), {os.getuid()})
    not_json = tmp_path / "pickle.fr"
    not_json.write_bytes(b"\x80\x04\x95")  # a pickle is never unpickled: it is not JSON
    with pytest.raises(ValueError):
        read_response(str(not_json), {os.getuid()})


def test_request_replaces_a_planted_symlink_never_follows_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    req = tmp_path / "j.0.frreq"
    req.symlink_to(victim)
    write_request(str(req), "nonce")
    assert victim.read_text() == "keep"
    assert not req.is_symlink() and req.read_text() == "nonce\n"


def test_daemon_names_the_rank_that_never_entered_the_collective(tmp_path: Path) -> None:
    """Two real ranks (heartbeat, then blocked) answering with the dumps recorded on the H200;
    the real daemon asks once both are stalled, exports the sequence numbers, and rank 0's
    explanation says rank 1 never entered collective #5 within one cycle of the answers."""
    from daemonutil import DaemonProc, write_config

    interval = 0.5
    cfg_path, cfg = write_config(tmp_path, interval_seconds=interval, stall={"after_seconds": 1.0})
    ranks = []
    try:
        for r in (0, 1):
            p = subprocess.Popen(
                [sys.executable, str(PROGRAMS / "hang_rank.py"), "fr", cfg["rank_dir"], "fr-job", str(r)],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "GW_FR_RECORDING": str(FIX / f"fr_gloo_rank{r}.json")},
            )
            ranks.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        d = DaemonProc(cfg_path, cfg)
        try:
            state = Path(cfg["state_dir"]) / "state.json"

            def explanation() -> str:
                try:
                    doc = json.loads(state.read_text())
                except (OSError, ValueError):  # not written yet
                    return ""
                return next(
                    (
                        f["explanation"]
                        for f in doc["findings"]
                        if f["rank"] == "0" and "never entered" in f["explanation"]
                    ),
                    "",
                )

            d.wait_for(lambda: bool(explanation()), timeout=30, what="flight recorder named")
            seen = time.time()
            answers = [Path(cfg["rank_dir"]) / f"fr-job.{r}.fr" for r in (0, 1)]
            answered = max(a.stat().st_mtime for a in answers)
            text = explanation()
            print(text, f"\n{seen - answered:.2f} s after the answers")
            assert (
                "rank 1 never entered collective #5 (gloo:all_reduce) of process group 0 "
                "that rank 0 entered (last entered: rank 1 #4)" in text
            )
            assert seen - answered <= interval + 1.0  # one cycle (plus a loaded machine)
            for r, seq in ((0, 5.0), (1, 4.0)):
                assert d.value("gpuwatch_rank_collective_last_started_seq", job_id="fr-job", rank=str(r), pg="0") == seq
                assert (
                    d.value("gpuwatch_rank_collective_last_completed_seq", job_id="fr-job", rank=str(r), pg="0") == 4.0
                )
            # answered requests are removed by the daemon
            assert not list(Path(cfg["rank_dir"]).glob("*.frreq"))
        finally:
            assert d.stop() == 0
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_trace_buffer_size_under_its_old_name_is_a_renamed_variable(procs: list) -> None:
    """A real process started with TORCH_NCCL_TRACE_BUFFER_SIZE: /proc/PID/environ -> the
    nccl_legacy_env finding tells to use TORCH_FR_BUFFER_SIZE."""
    from gpuwatchd.config.schema import Config
    from gpuwatchd.findings import FindingContext, nccl_env
    from gpuwatchd.model import RankState
    from gpuwatchd.sources.procfs import ProcfsReader

    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"},
    )
    procs.append(p)
    reader = ProcfsReader()
    deadline = time.monotonic() + 10
    while (env := reader.environ_values(p.pid, nccl_env.WATCHED_VARS)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env is not None
    flags = nccl_env.env_flags(env)
    assert flags is not None and "TORCH_NCCL_TRACE_BUFFER_SIZE" in flags
    r = RankState("j", 0, p.pid, 0, 1, True, None)
    (f,) = nccl_env.find(FindingContext(now=0.0, config=Config(), ranks=(r,), env_flags={p.pid: flags}))
    assert f.kind == "nccl_legacy_env"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE (use TORCH_FR_BUFFER_SIZE)" in f.explanation


def _ranks(now: float, entries: tuple, pid: int):  # type: ignore[no-untyped-def]
    from gpuwatchd.daemon.subsystem import Ranks
    from gpuwatchd.model import ProcessInfo

    proc = ProcessInfo(pid, 1, "python3", "S", os.getuid(), "u", 1, 0.0, 0.0, 0, 1, None, None, None)
    return Ranks(now, entries, {pid: proc}, {}, {})


def test_unanswered_ranks_are_asked_less_often_and_discovered_ones_never(tmp_path: Path) -> None:
    """A request nobody answers (no ``register_rank()``: no responder thread) is sent again after
    2, 4, then 8 x the interval, not every interval; an answer brings the rank back to the
    interval. A discovered rank (no rank file) has no responder and gets no request file (issue 22:
    64 stalled ranks without a responder were each written a request every minute)."""
    from types import SimpleNamespace

    from gpuwatchd.daemon.flight_recorder import FlightRecorderSubsystem
    from gpuwatchd.model import RankEntry
    from gpuwatchd.model.stall import StallVerdict

    pid = os.getpid()
    mute = RankEntry("j", 0, pid)
    answering = RankEntry("j", 1, pid)
    found = RankEntry("j", 2, pid, source="environ")
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.procfs import ProcfsReader

    daemon = SimpleNamespace(
        config=SimpleNamespace(rank_dir=str(tmp_path)), paths=HostPaths(), procfs=ProcfsReader(HostPaths())
    )  # its environment sets no dump pipe
    verdicts = {
        e.rank_id: StallVerdict("j", e.rank, pid, True, 0.0, True, "stack", 600.0) for e in (mute, answering, found)
    }
    responder = fr.Responder(str(tmp_path), "j", 1, dump=lambda: {"entries": []})
    sub = FlightRecorderSubsystem(interval_seconds=60.0)
    asked: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for cycle in range(12 * 17):  # 17 minutes at a 5 s cycle
        now = 1000.0 + 5 * cycle
        for e in (mute, answering, found):
            req = Path(fr.request_path(str(tmp_path), "j", e.rank))
            if req.exists():
                nonce = req.read_text()
                if nonce != getattr(sub, f"_seen{e.rank}", None):
                    setattr(sub, f"_seen{e.rank}", nonce)
                    asked[e.rank].append(now - 1000.0)
        sub.track(daemon, _ranks(now, (mute, answering, found), pid), verdicts)  # type: ignore[arg-type]
        responder.poll_once()
    assert asked[2] == [], asked
    assert len(asked[1]) >= 16, asked[1]  # answered: every minute
    # unanswered: asked, then 2, 4 and 8 minutes later (8 x the interval at most)
    gaps = [b - a for a, b in itertools.pairwise(asked[0])]
    assert gaps == [120.0, 240.0, 480.0], asked[0]


def test_a_rank_directory_that_refuses_requests_is_said_once_per_streak(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that cannot be written (a read-only rank directory: here a path under a file) is
    logged once, however many cycles fail; once requests are written again that is said once; the
    rank is asked each cycle meanwhile (no request went, so none is waiting for an answer)."""
    from types import SimpleNamespace

    from gpuwatchd.daemon.flight_recorder import FlightRecorderSubsystem
    from gpuwatchd.model import RankEntry
    from gpuwatchd.model.stall import StallVerdict
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.procfs import ProcfsReader

    pid = os.getpid()
    rank = RankEntry("j", 0, pid)
    blocked = tmp_path / "ranks"
    blocked.write_text("")  # a file: no request can be made under it
    daemon = SimpleNamespace(
        config=SimpleNamespace(rank_dir=str(blocked)), paths=HostPaths(), procfs=ProcfsReader(HostPaths())
    )
    verdicts = {rank.rank_id: StallVerdict("j", 0, pid, True, 0.0, True, "stack", 600.0)}
    sub = FlightRecorderSubsystem(interval_seconds=60.0)
    caplog.set_level("WARNING", logger="gpuwatchd.daemon.flight_recorder")
    for cycle in range(4):
        sub.track(daemon, _ranks(1000.0 + 5 * cycle, (rank,), pid), verdicts)  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cannot be written" in said[0], said
    blocked.unlink()
    blocked.mkdir()
    for cycle in range(4, 8):
        sub.track(daemon, _ranks(1000.0 + 5 * cycle, (rank,), pid), verdicts)  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "written into" in said[1] and "again" in said[1], said
    assert Path(fr.request_path(str(blocked), "j", 0)).exists()  # asked at once, then waits
