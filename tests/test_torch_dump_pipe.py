"""PyTorch's flight-recorder dump through its pipe, for ranks that set the variables in their
environment: the real daemon writes one byte to the rank's FIFO when the job stalls and reads the
pickled dump where the rank writes it; the rank keeps running. A FIFO that is not the rank's
(another user's at the rank's pipe name) is never written, and a dump that is not a plain pickle
(a global, a memo bomb) is refused for that rank, nothing else.

The rank is tests/fixtures/torch_pipe/dump_pipe_rank.py, which does what torch's ``DumpPipe``
does; its dump is the pickle of a real flight-recorder trace (tests/fixtures/hang/fr_gloo_rank0.json).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, write_config
from userutil import rank_world_fixture, setpriv, users_fixture

from gpuwatchd.sources.torch_dump_pipe import plain, settings

FIXTURES = Path(__file__).parent / "fixtures"
RANK = FIXTURES / "torch_pipe" / "dump_pipe_rank.py"
USER = "gw-fifo-other"


user = users_fixture(USER)


world = rank_world_fixture("gw-fifo-")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/gw-fifo-pwned",))


def _bomb() -> bytes:
    node: Any = {"collective_seq_id": 1, "pg_id": "0"}
    for _ in range(4):  # 1000**4 values if walked whole; 8 KB as a pickle (the memo shares them)
        node = {"collective_seq_id": 2, "pg_id": "0", "frames": [node] * 1000}
    return pickle.dumps({"entries": [node] * 1000})


def _rank(world: Path, job: str, payload: bytes, procs: list[Any], fifo: bool = True) -> subprocess.Popen[Any]:
    (world / f"{job}.payload").write_bytes(payload)
    stem, prefix = f"{world}/pipes/{job}_", f"{world}/dumps/{job}_"
    env = {
        "PATH": "/usr/bin:/bin",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    p = subprocess.Popen(
        [
            "/usr/bin/python3",
            str(RANK),
            stem,
            prefix,
            "0",
            str(world / f"{job}.payload"),
            *([] if fifo else ["--no-fifo"]),
        ],
        env=env,
        stdout=subprocess.PIPE,
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    hb = world / "ranks" / f"{job}.0.hb"
    hb.write_text("")
    old = time.time() - 600
    os.utime(hb, (old, old))
    (world / "ranks" / f"{job}.json").write_text(
        json.dumps({"version": 1, "job_id": job, "ranks": [{"rank": 0, "pid": p.pid, "heartbeat": str(hb)}]})
    )
    return p


def _stall_text(world: Path, job: str) -> str:
    try:
        state = json.loads((world / "state" / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return ""
    return next((f["explanation"] for f in state["findings"] if f["kind"] == "rank_stalled" and f["job_id"] == job), "")


def test_the_pipe_dumps_and_a_fifo_not_the_ranks_is_never_written(
        user: int, world: Path, procs: list[subprocess.Popen[Any]]) -> None:  # fmt: skip
    for d in ("pipes", "dumps"):
        (world / d).mkdir()
        (world / d).chmod(0o1777)
    trace = json.loads((FIXTURES / "hang" / "fr_gloo_rank0.json").read_text())["trace"]
    good = _rank(world, "pipegood", pickle.dumps(trace), procs)
    evil = _rank(world, "pipeevil", pickle.dumps({"entries": [_Evil()]}), procs)
    bomb = _rank(world, "pipebomb", _bomb(), procs)
    # another user's FIFO at the name root's rank would use; that rank makes none
    _rank(world, "pipetheirs", pickle.dumps(trace), procs, fifo=False)
    theirs = world / "pipes" / "pipetheirs_0.pipe"
    got = world / "theirs.got"
    reader = subprocess.Popen(
        [
            *setpriv(USER),
            "/usr/bin/python3",
            "-c",
            "import os, sys, time\n"
            f"os.mkfifo({str(theirs)!r}, 0o666)\n"
            f"fd = os.open({str(theirs)!r}, os.O_RDONLY | os.O_NONBLOCK)\n"
            "print('ready', flush=True)\n"
            "while True:\n"
            "    time.sleep(0.1)\n"
            "    try:\n"
            "        b = os.read(fd, 128)\n"
            "    except BlockingIOError:\n"
            "        continue\n"
            f"    if b: open({str(got)!r}, 'ab').write(b)\n",
        ],
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
    )
    procs.append(reader)
    assert reader.stdout is not None and reader.stdout.readline().strip() == b"ready"
    got.touch()
    got.chmod(0o666)

    path, cfg = write_config(
        world,
        rank_dir=str(world / "ranks"),
        stall={"after_seconds": 1.5, "flight_recorder_interval_seconds": 2, "nccl_ras": False},
    )
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: d.value("gpuwatch_rank_collective_last_started_seq", job_id="pipegood", rank="0", pg="0") == 5.0,
            timeout=30,
            what="the dump read through the pipe",
        )
        d.wait_for(
            lambda: (
                "not a plain pickle: refused a global" in _stall_text(world, "pipeevil")
                and d.value("gpuwatch_rank_collective_last_started_seq", job_id="pipebomb", rank="0", pg="0") == 2.0
                and "pipe refused: owned by uid" in _stall_text(world, "pipetheirs")
            ),
            timeout=30,
            what="each bad pipe refused for its rank",
        )
        time.sleep(3)  # a few more requests at the interval
        assert got.read_bytes() == b""  # their FIFO was never written
        assert not Path("/tmp/gw-fifo-pwned").exists()
        assert all(p.poll() is None for p in (good, evil, bomb, reader))  # training goes on
        assert int((world / "dumps" / "pipegood_0.count").read_text()) >= 1
        assert (d.value("gpuwatch_cycle_duration_seconds") or 0) < 1.0  # the bomb was never walked
        assert "Traceback" not in d.log()
    finally:
        d.stop()


def test_settings_follow_torchs_variables() -> None:
    env = {"TORCH_FR_DEBUG_INFO_PIPE_FILE": "/tmp/p_", "TORCH_FR_BUFFER_SIZE": "2000"}
    s = settings(env, 3)
    assert s is not None and (s.pipe, s.dump) == ("/tmp/p_3.pipe", "/tmp/nccl_trace_rank_3")
    assert settings({**env, "TORCH_FR_BUFFER_SIZE": "0"}, 3) is None  # no trace buffer: no pipe
    assert settings({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "rel_", "TORCH_NCCL_TRACE_BUFFER_SIZE": "5"}, 0) is None
    s = settings({**env, "TORCH_FR_DUMP_TEMP_FILE": "/d/x_"}, 0)
    assert s is not None and s.dump == "/d/x_0"


def test_plain_takes_only_what_the_parser_reads() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    doc = {
        "entries": [{"collective_seq_id": 3, "pg_id": 0, "frames": deep, "state": b"raw"}, deep],
        "pg_status": {"0": {"last_started_collective": 3, "x": deep}},
        "other": deep,
    }
    assert plain(doc) == {
        "entries": [{"collective_seq_id": 3, "pg_id": 0, "state": None}],
        "pg_status": {"0": {"last_started_collective": 3}},
    }
    with pytest.raises(ValueError, match="out of range"):
        plain({"entries": [{"collective_seq_id": 10**40}]})
    with pytest.raises(ValueError, match="not a dict"):
        plain([1])
