"""Issue 37 (rank side): what one user can do to another user's rank through the shared rank
directory (mode 1777, like the shipped /run/gpuwatch/ranks), with real users (useradd, setpriv)
and real rank processes running ``gpuwatchd.register_rank()`` / ``heartbeat()`` as U2, read back
with the daemon's own readers (sources/rankfiles.py, sources/heartbeat_step.py,
sources/flight_recorder_files.py).

On a7db82e:
- R4: U1's ``JOB.0.hb.tmp`` (a file, a directory or a FIFO) made U2's heartbeats fail silently
  (the FIFO: the rank hung in open()); the heartbeat was never named in the rank file;
- R13: in a rank directory U1 owns, U1's symlink at ``JOB.0.hb.tmp`` made U2's heartbeat truncate
  a file of U2's, and U1's FIFO there hung U2's training in ``heartbeat()``;
- R14: U1's ``JOB.0.json``, made first, made U2's ``register_rank()`` fail (EPERM): no rank;
- R15: U1 filling the rank directory's file system made every heartbeat write fail (ENOSPC);
- R21: U1's FIFO at ``JOB.0.frreq`` blocked U2's flight-recorder thread in open() for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from userutil import as_user, rank_world_fixture, setpriv, users_fixture

from gpuwatchd.rank.flight_recorder import request_path, response_path
from gpuwatchd.sources.flight_recorder_files import read_response, write_request
from gpuwatchd.sources.heartbeat_step import read_step
from gpuwatchd.sources.rankfiles import RankFileReader

U1, U2 = "gw-rs-u1", "gw-rs-u2"
REPO = Path(__file__).resolve().parent.parent
# U2's training: registers, then beats every 0.1 s for argv[2] steps, then idles (still alive)
RANK = """
import sys, time
import gpuwatchd
path = gpuwatchd.register_rank(job_id=sys.argv[1], rank=0, cuda_oom_hook=False,
                               flight_recorder=sys.argv[3] == "fr")
print("registered", path, flush=True)
for step in range(1, int(sys.argv[2]) + 1):
    gpuwatchd.heartbeat(step)
    time.sleep(0.1)
print("trained", flush=True)
time.sleep(120)
"""


users = users_fixture(U1, U2)


world = rank_world_fixture("gw-rs-")


@pytest.fixture
def ranks_started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _job() -> str:
    return f"rs-{uuid.uuid4().hex[:8]}"


def _start_rank(
    procs: list[subprocess.Popen[str]], rank_dir: Path, job: str, steps: int, fr: bool = False
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [*setpriv(U2), "/usr/bin/python3", "-c", RANK, job, str(steps), "fr" if fr else "-"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "GPUWATCH_RANK_DIR": str(rank_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(p)
    return p


def _heartbeat(rank_dir: Path, job: str, pid: int) -> tuple[int | None, float] | None:
    """(step, mtime) of the heartbeat the daemon reads for U2's rank 0 of ``job``, or None."""
    entries, _ = RankFileReader(str(rank_dir)).scan()
    for e in entries:
        if (e.job_id, e.rank, e.pid) == (job, 0, pid) and e.heartbeat:
            with contextlib.suppress(OSError):
                return read_step(e.heartbeat, e.owner_uid), os.stat(e.heartbeat).st_mtime
    return None


def _wait_for_step(
    rank_dir: Path, job: str, p: subprocess.Popen[str], step: int, timeout: float = 15.0
) -> tuple[int | None, float]:
    end = time.monotonic() + timeout
    got = None
    while time.monotonic() < end:
        got = _heartbeat(rank_dir, job, p.pid)
        if got is not None and (got[0] or 0) >= step:
            return got
        assert p.poll() is None, p.communicate()
        time.sleep(0.1)
    p.kill()
    out, err = p.communicate()
    raise AssertionError(f"step {step} never read (last {got}); rank out {out!r} err {err!r}")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", ["file", "directory", "fifo"])
def test_r4_another_users_tmp_name_does_not_stop_the_heartbeat(
    users: tuple[int, int], world: Path, ranks_started: list[subprocess.Popen[str]], kind: str, when: str
) -> None:
    """U1 plants the old temp name (and, before U2 registers, the heartbeat's own name) before
    U2's rank registers, or after its heartbeat is named in its rank file and beating (the
    issue's case: the next beats failed and the rank paged ``rank_stalled``)."""
    ranks, job = world / "ranks", _job()
    plant = {"file": ["/usr/bin/touch"], "directory": ["/usr/bin/mkdir"], "fifo": ["/usr/bin/mkfifo"]}[kind]
    names = [f"{job}.0.hb.tmp", f"{job}.0.hb"] if when == "before" else [f"{job}.0.hb.tmp"]
    if when == "before":
        for name in names:
            assert as_user(U1, *plant, str(ranks / name)).returncode == 0
    p = _start_rank(ranks_started, ranks, job, 80)
    step, _ = _wait_for_step(ranks, job, p, 3)
    if when == "after":
        for name in names:
            assert as_user(U1, *plant, str(ranks / name)).returncode == 0
    _, mtime = _wait_for_step(ranks, job, p, (step or 0) + 15)
    assert time.time() - mtime < 5


def test_r13_a_rank_dir_of_another_user_is_refused_not_followed(
    users: tuple[int, int], world: Path, ranks_started: list[subprocess.Popen[str]]
) -> None:
    u1, u2 = users
    theirs = world / "u1-ranks"
    theirs.mkdir()
    os.chown(theirs, u1, u1)
    theirs.chmod(0o777)  # U1's, open to all (as a shared scratch directory might be)
    precious = world / "u2-notes.txt"
    precious.write_text("U2's work\n")
    os.chown(precious, u2, u2)
    job = _job()
    assert as_user(U1, "/usr/bin/ln", "-s", str(precious), str(theirs / f"{job}.0.hb.tmp")).returncode == 0
    job2 = _job()
    assert as_user(U1, "/usr/bin/mkfifo", str(theirs / f"{job2}.0.hb.tmp")).returncode == 0
    for j in (job, job2):
        p = _start_rank(ranks_started, theirs, j, 10)
        line = ""
        end = time.monotonic() + 15
        while "trained" not in line and time.monotonic() < end:
            line = p.stdout.readline() if p.stdout else ""  # type: ignore[union-attr]
        assert precious.read_text() == "U2's work\n", "U1's link made U2's rank truncate U2's file"
        assert "trained" in line, "the training hung in heartbeat()"
        p.kill()
        _, err = p.communicate()
        assert f"is owned by uid {u1}" in err, err
    assert sorted(n.name for n in theirs.iterdir()) == sorted([f"{job}.0.hb.tmp", f"{job2}.0.hb.tmp"])


def test_r14_names_taken_first_by_another_user_do_not_stop_registration(
    users: tuple[int, int], world: Path, ranks_started: list[subprocess.Popen[str]]
) -> None:
    _u1, u2 = users
    ranks, job = world / "ranks", _job()
    squat = json.dumps({"version": 1, "job_id": job, "ranks": [{"rank": 0, "pid": 1}]})
    out = as_user(
        U1,
        "/usr/bin/python3",
        "-c",
        "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
        str(ranks / f"{job}.0.json"),
        squat,
    )
    assert out.returncode == 0, out.stderr
    assert as_user(U1, "/usr/bin/mkfifo", str(ranks / f"{job}.0.hb")).returncode == 0
    p = _start_rank(ranks_started, ranks, job, 60)
    _wait_for_step(ranks, job, p, 5)
    entries, _ = RankFileReader(str(ranks)).scan()
    (mine,) = [e for e in entries if e.job_id == job and e.pid == p.pid]
    assert mine.owner_uid == u2 and mine.path != str(ranks / f"{job}.0.json")
    assert Path(mine.path).name.startswith(f"{job}.0.") and Path(mine.heartbeat or "").name != f"{job}.0.hb"


# U1 fills the file system and keeps it full: 64 KiB writes, then 4 KiB ones, until ENOSPC; then
# takes every page that comes free (or that another CPU's share of the counter still had)
FILL = """
import errno, sys, time
f = open(sys.argv[1] + "/fill", "wb", buffering=0)
for size in (65536, 4096, 4096):
    try:
        while True:
            f.write(bytes(size))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
print("full", flush=True)
while True:
    try:
        f.write(bytes(4096))
    except OSError:
        time.sleep(0.005)
"""


@pytest.fixture
def small_fs(world: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, mode 1777, as the rank directory: /run's role, made small enough to fill."""
    d = world / "tiny"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "gw-rs-tiny", str(d)], check=True, timeout=30)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False, timeout=30)


def test_r15_filling_the_rank_dirs_file_system_does_not_stop_heartbeats(
    users: tuple[int, int], small_fs: Path, ranks_started: list[subprocess.Popen[str]]
) -> None:
    job = _job()
    p = _start_rank(ranks_started, small_fs, job, 200)
    _wait_for_step(small_fs, job, p, 3)
    fill = subprocess.Popen(
        ["setpriv", f"--reuid={U1}", f"--regid={U1}", "--clear-groups", "/usr/bin/python3", "-c", FILL, str(small_fs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ranks_started.append(fill)
    assert fill.stdout is not None and fill.stdout.readline() == "full\n"
    probe = as_user(
        U1,
        "/usr/bin/python3",
        "-c",
        "import os, sys; os.write(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT), b'x' * 4096)",
        str(small_fs / "probe"),
    )
    assert "No space left" in probe.stderr, probe  # full, and kept full
    step, _ = _heartbeat(small_fs, job, p.pid) or (None, 0.0)
    _later, mtime = _wait_for_step(small_fs, job, p, (step or 0) + 10)
    assert time.time() - mtime < 5


def test_r21_a_fifo_at_the_request_name_does_not_block_the_flight_recorder(
    users: tuple[int, int], world: Path, ranks_started: list[subprocess.Popen[str]]
) -> None:
    _u1, u2 = users
    ranks, job = world / "ranks", _job()
    req = Path(request_path(str(ranks), job, 0))
    assert as_user(U1, "/usr/bin/mkfifo", "-m", "0666", str(req)).returncode == 0
    p = _start_rank(ranks_started, ranks, job, 30, fr=True)
    _wait_for_step(ranks, job, p, 3)
    time.sleep(1.5)  # three polls of the rank's thread with the FIFO there
    req.unlink()  # root (the daemon's role here) clears it, and asks
    write_request(str(req), "n-r21")
    resp = response_path(str(ranks), job, 0)
    doc: Any = None
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError):
            doc = read_response(resp, {0, u2})
            if doc.get("nonce") == "n-r21":
                break
        time.sleep(0.1)
    assert doc is not None and doc.get("nonce") == "n-r21", "the responder never answered"
    assert doc["pid"] == p.pid


def test_r4_r15_the_daemon_does_not_page_a_rank_another_user_blinds(
    users: tuple[int, int], small_fs: Path, ranks_started: list[subprocess.Popen[str]]
) -> None:
    """The issue's pages, through the real daemon (stall after 3 s): U2's rank beats; U1 makes
    ``JOB.0.hb.tmp`` a directory and fills the rank directory's file system. On a7db82e
    ``rank_stalled`` was paged 3.7 s later (R4) and 3.9 s later (R15); now the step keeps rising."""
    from daemonutil import DaemonProc, has_finding, write_config

    home = small_fs.parent / "d"
    home.mkdir()
    cfg_path, cfg = write_config(home, rank_dir=str(small_fs), stall={"after_seconds": 3})
    d = DaemonProc(cfg_path, cfg)
    job = _job()
    try:
        _start_rank(ranks_started, small_fs, job, 400)
        d.wait_for(
            lambda: (d.value("gpuwatch_rank_step", job_id=job, rank="0") or 0) >= 3,
            timeout=30,
            what="step 3 on /metrics",
        )
        assert as_user(U1, "/usr/bin/mkdir", str(small_fs / f"{job}.0.hb.tmp")).returncode == 0
        fill = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={U1}",
                f"--regid={U1}",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                FILL,
                str(small_fs),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        ranks_started.append(fill)
        assert fill.stdout is not None and fill.stdout.readline() == "full\n"
        before = d.value("gpuwatch_rank_step", job_id=job, rank="0") or 0
        end = time.monotonic() + 10
        while time.monotonic() < end:
            assert not has_finding(d, "rank_stalled", job_id=job, rank="0"), d.log()
            time.sleep(0.5)
        assert (d.value("gpuwatch_rank_step", job_id=job, rank="0") or 0) >= before + 20
    finally:
        assert d.stop() == 0
