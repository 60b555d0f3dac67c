"""Issue 37: CUDA-OOM event files against other users, a read-only rank directory and odd numbers.
Real users (useradd, setpriv) write the event files, real processes are the ranks, the daemon's
cycle runs in-process (NVML replayed from the H200 recording, as tests/test_cuda_oom_rule.py).

On a7db82e:
- R8: any user's event counted for any job: U1's file named root's job and PID (a false
  ``cuda_oom`` warning), and forged job ids each became a ``cuda_oom_errors`` series;
- R9/R10: a file the daemon could not remove (another user's in the sticky directory under the
  unit's user; the DaemonSet's read-only mount) was counted again at every listing;
- R11: one file with ``"rank": 1e400`` raised OverflowError out of the listing: no CUDA OOM of
  anyone was counted while it was there.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from userutil import rank_world_fixture, user_writes, users_fixture

from gpuwatchd.config.schema import parse_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.flight_recorder import FlightRecorderSubsystem
from gpuwatchd.daemon.nvml import NvmlSubsystem
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.model import RankEntry
from gpuwatchd.rank.cuda_oom import PREFIX, SUFFIX
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.nvml_fixture import fixture_source

U1, U2 = "gw-oom-u1", "gw-oom-u2"
FIX = Path(__file__).parent / "fixtures" / "nvml"
UUID = "GPU-d6a79800-1da5-699b-0f9c-f55eb218f8b2"
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]


users = users_fixture(U1, U2)


world = rank_world_fixture("gw-oom-")


@pytest.fixture
def ranks(users: tuple[int, int], world: Path) -> Iterator[dict[str, int]]:
    """root's rank 0 of job ``rootjob`` (a root-owned rank file) and U2's rank 0 of ``u2job``
    (U2's own file naming U2's own process)."""
    procs = [
        subprocess.Popen(SLEEP),
        subprocess.Popen(
            ["setpriv", f"--reuid={U2}", f"--regid={U2}", "--clear-groups", *SLEEP], env={"PATH": "/usr/bin:/bin"}
        ),
    ]
    root_pid, u2_pid = (p.pid for p in procs)
    rank_dir = world / "ranks"
    write_rank_file(
        str(rank_dir), {"version": 1, "job_id": "rootjob", "ranks": [{"rank": 0, "pid": root_pid}]}, "rootjob.json"
    )
    user_writes(
        U2,
        rank_dir / "u2job.json",
        json.dumps({"version": 1, "job_id": "u2job", "ranks": [{"rank": 0, "pid": u2_pid}]}),
    )
    try:
        yield {"root": root_pid, "u2": u2_pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _event(job: str, rank: Any, pid: int, ts: float = 1.9e9) -> str:
    return json.dumps(
        {
            "version": 1,
            "kind": "cuda_oom",
            "job_id": job,
            "rank": rank,
            "pid": pid,
            "timestamp": ts,
            "device_uuid": UUID,
            "requested_bytes": 1 << 30,
            "co_tenants": None,
        }
    )


def _write_event(user: str, rank_dir: Path, job: str, rank: Any, pid: int, n: int = 0) -> None:
    user_writes(user, rank_dir / f"{PREFIX}{job}-{n}-{pid}-{time.time_ns()}{SUFFIX}", _event(job, rank, pid))


def _daemon(world: Path, ranks: dict[str, int], rank_dir: Path) -> tuple[Daemon, NvmlSubsystem]:
    cfg = parse_config(
        {
            "rank_dir": str(rank_dir),
            "state_dir": str(world / "state"),
            "gil": {"enabled": False},
            "discovery": {"enabled": False},
        }
    )
    d = Daemon(
        cfg,
        parts=lambda c, s: Parts(
            nvml=NvmlSubsystem(
                c,
                s,
                source=fixture_source(str(FIX / "h200_orphan_dataloader.json"), {447: ranks["root"], 449: ranks["u2"]}),
                watch_xid=False,
                watch_udev=False,
            )
        ),
    )
    sub = d.parts.nvml
    assert isinstance(sub, NvmlSubsystem)
    sub.start(d)
    return d, sub


def _cuda_oom_series(d: Daemon) -> dict[tuple[str, ...], float]:
    return dict(d.counters.snapshot().get("cuda_oom_errors", {}))


def test_r8_an_event_counts_only_for_a_rank_of_its_files_owner(
    users: tuple[int, int], world: Path, ranks: dict[str, int]
) -> None:
    rank_dir = world / "ranks"
    d, sub = _daemon(world, ranks, rank_dir)
    try:
        d.cycle()
        _write_event(U1, rank_dir, "rootjob", 0, ranks["root"])  # U1 blames root's rank
        for i in range(40):  # and forges job ids, one series each on a7db82e
            _write_event(U1, rank_dir, f"forged-{i}", i, 4000 + i, i)
        _write_event(U2, rank_dir, "u2job", 0, ranks["u2"])  # U2's own rank's real OOM
        states = [d.cycle() for _ in range(4)]  # U1's 41 files: 16 per listing
        assert _cuda_oom_series(d) == {("u2job", "0", "0"): 1}
        findings = [(f.job_id, f.rank) for f in states[-1].findings if f.kind == "cuda_oom"]
        assert findings == [("u2job", "0")]
    finally:
        sub.stop()


def test_r11_an_odd_number_refuses_its_file_alone(users: tuple[int, int], world: Path, ranks: dict[str, int]) -> None:
    rank_dir = world / "ranks"
    d, sub = _daemon(world, ranks, rank_dir)
    try:
        d.cycle()  # the GPUs known: an event's GPU is named from the last state
        user_writes(
            U1, rank_dir / f"{PREFIX}x-0-1-1{SUFFIX}", _event("u2job", 0, 1).replace('"rank": 0', '"rank": 1e400')
        )
        user_writes(
            U1, rank_dir / f"{PREFIX}x-0-1-2{SUFFIX}", _event("u2job", 0, 1).replace('"rank": 0', '"rank": true')
        )
        user_writes(U1, rank_dir / f"{PREFIX}x-0-1-3{SUFFIX}", _event("u2job", 0, 1).replace('"pid": 1', '"pid": 1.5'))
        _write_event(U2, rank_dir, "u2job", 0, ranks["u2"])
        d.cycle()
        assert _cuda_oom_series(d) == {("u2job", "0", "0"): 1}
    finally:
        sub.stop()


@pytest.fixture
def read_only_view(world: Path) -> Iterator[Path]:
    """The rank directory as the DaemonSet mounts it (readOnly: true): a read-only bind mount.
    The daemon can remove nothing there, as under the unit's user it cannot remove a user's file
    from the root-owned sticky directory."""
    view = world / "ro"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(world / "ranks"), str(view)], check=True, timeout=30)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True, timeout=30)
    try:
        yield view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False, timeout=30)


def test_r9_r10_an_event_the_daemon_cannot_remove_counts_once_across_cycles_and_restarts(
    users: tuple[int, int], world: Path, ranks: dict[str, int], read_only_view: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rank_dir = world / "ranks"
    caplog.set_level(logging.INFO)
    d, sub = _daemon(world, ranks, read_only_view)
    try:
        d.cycle()
        _write_event(U2, rank_dir, "u2job", 0, ranks["u2"])
        for i in range(6):
            d.cycle()
            user_writes(U2, rank_dir / f"junk-{i}.txt", "x")  # the directory changes each time
        assert _cuda_oom_series(d) == {("u2job", "0", "0"): 1}
    finally:
        sub.stop()
    assert sum("cannot remove CUDA OOM event files" in r.message for r in caplog.records) == 1
    d2, sub2 = _daemon(world, ranks, read_only_view)  # a restart: the same state_dir
    try:
        for _ in range(3):
            d2.cycle()
        assert _cuda_oom_series(d2) == {}, "counted again after the restart"
        _write_event(U2, rank_dir, "u2job", 0, ranks["u2"], 1)  # a new one still counts
        d2.cycle()
        assert _cuda_oom_series(d2) == {("u2job", "0", "0"): 1}
    finally:
        sub2.stop()


def test_r10_flight_recorder_requests_into_a_read_only_rank_dir_are_a_warning_once(
    world: Path, read_only_view: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fr = FlightRecorderSubsystem(60.0)
    e = RankEntry(job_id="j", rank=0, pid=1, source="rankfile")
    caplog.set_level(logging.DEBUG)
    for i in range(3):
        fr._ask(str(read_only_view), e, float(i))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Read-only file system" in warnings[0].getMessage()
    assert str(read_only_view) in warnings[0].getMessage()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
