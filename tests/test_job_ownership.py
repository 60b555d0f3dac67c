"""Ownership first, then caps (issue 37 R2, R3): real users (useradd, setpriv), real processes, the
real daemon and the real ``gpuwatchd check`` (NVML replayed from the H200 recording with its one
holder mapped onto a real process, as in test_rankfile_crowding.py).

- R2: the 256-ranks-per-job cap ran before the claims: U1's file naming its own ``sleep`` as ranks
  0-255 of root's job ``bigjob`` (root: ranks 1000-1007) took the job's 256 places; root's file
  was the one refused, U1 owned the job, and ending U1's process paged 256 rank_down for root's
  job. The same took U2's discovered job.
- R3: a job belonged to its earliest-started claimant, decided again by ``check`` and after a
  restart: an older process of U1 claiming U2's job made ``check --kill`` SIGTERM U2's live rank,
  and took the job in a restarted daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, finding_jobs, write_config
from test_rankfile_crowding import _alive, _check, fixture  # noqa: F401 - fixture is a fixture
from userutil import rank_world_fixture, setpriv, user_writes, users_fixture

from gpuwatchd.cli import check

U1, U2 = "gw-crowd-u1", "gw-crowd-u2"  # test_rankfile_crowding.py's users
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]


users = users_fixture(U1, U2)


world = rank_world_fixture("gw-own-")


def _as(
    user: str | None,
    procs: list[subprocess.Popen[Any]],
    env: dict[str, str] | None = None,
) -> subprocess.Popen[Any]:
    pre = [] if user is None else setpriv(user)
    p = subprocess.Popen([*pre, *SLEEP], env={"PATH": "/usr/bin:/bin", **(env or {})})
    procs.append(p)
    return p


def _doc(job: str, pid: int, ranks: range | list[int]) -> str:
    return json.dumps({"version": 1, "job_id": job, "ranks": [{"rank": r, "pid": pid} for r in ranks]})


def _hold(d: DaemonProc, what: str, pred: Any, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert pred(), f"{what} stopped holding; daemon log:\n{d.log()}\nmetrics:\n{d.text()}"
        time.sleep(0.2)


def _bad_files(world: Path) -> list[str]:
    state = json.loads((world / "state" / "state.json").read_text())
    return [f["explanation"] for f in state["findings"] if f["kind"] == "bad_rank_file"]


def test_r2_another_users_256_claims_take_no_place_of_roots_job(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    job = f"bigjob{os.getpid()}"
    root_rank = _as(None, procs)
    u1_proc = _as(U1, procs)
    (ranks / "root.json").write_text(_doc(job, root_rank.pid, range(1000, 1008)))
    user_writes(U1, ranks / "u1.json", _doc(job, u1_proc.pid, range(256)))
    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:

        def roots_ranks_only() -> bool:
            return (
                all(d.value("gpuwatch_rank_up", job_id=job, rank=str(r)) == 1.0 for r in range(1000, 1008))
                and d.value("gpuwatch_rank_up", job_id=job, rank="0") is None
            )

        d.wait_for(roots_ranks_only, what="root's 8 ranks up, none of U1's claims")
        bad = "\n".join(_bad_files(world))
        assert "u1.json" in bad and "rank_conflict" in bad and "root.json" not in bad, bad
        u1_proc.kill()
        u1_proc.wait()
        _hold(
            d,
            "no rank_down for root's job",
            lambda: job not in finding_jobs(d, "rank_down") and roots_ranks_only(),
            3.0,
        )
    finally:
        d.stop()


def test_r2_another_users_256_claims_take_no_place_of_a_discovered_job(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    job = f"u2disc{os.getpid()}"
    _as(U2, procs, {"TORCHELASTIC_RUN_ID": job, "RANK": "0", "WORLD_SIZE": "1"})
    u1_proc = _as(U1, procs)
    path, cfg = write_config(world, rank_dir=str(ranks), discovery={"enabled": True, "interval_seconds": 1})
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0, what="U2's discovered rank up")
        user_writes(U1, ranks / "u1.json", _doc(job, u1_proc.pid, range(256)))
        time.sleep(1.5)  # a few cycles and a discovery pass with U1's file
        _hold(
            d,
            "U2's rank kept, none of U1's claims",
            lambda: (
                d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=job, rank="1") is None
            ),
            3.0,
        )
        assert any("u1.json" in b and "rank_conflict" in b for b in _bad_files(world))
    finally:
        d.stop()


def test_r3_check_kill_spares_a_rank_whose_job_an_older_process_claims(
    users: tuple[int, int],
    world: Path,
    fixture: Path,  # noqa: F811
    procs: list[subprocess.Popen[Any]],
) -> None:
    ranks = world / "ranks"
    job = f"u2job{os.getpid()}"
    older = _as(U1, procs)  # started first: the earliest claimant of U2's job
    time.sleep(0.05)
    u2_rank = _as(U2, procs)
    user_writes(U2, ranks / "u2.json", _doc(job, u2_rank.pid, [0]))
    assert _check(world, fixture, u2_rank.pid)[0] == check.EXIT_CLEAN
    user_writes(U1, ranks / "u1.json", _doc(job, older.pid, [1]))
    rc, text = _check(world, fixture, u2_rank.pid, kill=True, grace=1, verify_seconds=1)
    time.sleep(0.2)
    assert _alive(u2_rank), text
    assert (rc, text.split(":")[0]) == (check.EXIT_CLEAN, "clean"), text


def test_r3_a_restart_keeps_the_jobs_owner(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    job = f"u2job{os.getpid()}"
    older = _as(U1, procs)
    time.sleep(0.05)
    u2_rank = _as(U2, procs)
    user_writes(U2, ranks / "u2.json", _doc(job, u2_rank.pid, [0]))
    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0, what="U2's rank up")
        user_writes(U1, ranks / "u1.json", _doc(job, older.pid, [1]))
        time.sleep(1.5)
        assert d.value("gpuwatch_rank_up", job_id=job, rank="1") is None
    finally:
        d.stop()
    d = DaemonProc(path, cfg)  # the same state_dir
    try:
        time.sleep(1.5)
        _hold(
            d,
            "U2's rank kept after the restart, U1's claim refused",
            lambda: (
                d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=job, rank="1") is None
            ),
            2.0,
        )
    finally:
        d.stop()
    owners = json.loads((world / "state" / "job_owners.json").read_text())["owners"]
    assert owners[job] == users[1], owners


def test_r3_a_slurm_job_belongs_to_its_cgroups_user_whoever_claimed_its_id_first(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """U1 claims a predictable Slurm job id before the job starts; U2's rank of that job runs in
    slurmstepd's cgroup ``/slurm/uid_U2/job_N`` (made here as root, as slurmstepd does, in the
    v1 memory hierarchy): the job is U2's, U1's claim is refused."""
    ranks = world / "ranks"
    job = str(900_000 + os.getpid() % 100_000)
    cg = Path("/sys/fs/cgroup/memory/slurm") / f"uid_{users[1]}" / f"job_{job}"
    made = [p for p in (cg.parent.parent, cg.parent, cg) if not p.exists()]  # removed afterwards
    cg.mkdir(parents=True)
    try:
        squatter = _as(U1, procs)
        user_writes(U1, ranks / "u1.json", _doc(job, squatter.pid, [1]))
        path, cfg = write_config(world, rank_dir=str(ranks))
        d = DaemonProc(path, cfg)
        try:
            d.wait_for(
                lambda: d.value("gpuwatch_rank_up", job_id=job, rank="1") == 1.0,
                what="U1's claim of the job id up (the job had no other claimant)",
            )
            u2_rank = _as(U2, procs)
            (cg / "cgroup.procs").write_text(str(u2_rank.pid))
            user_writes(U2, ranks / "u2.json", _doc(job, u2_rank.pid, [0]))
            d.wait_for(
                lambda: (
                    d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0
                    and d.value("gpuwatch_rank_up", job_id=job, rank="1") is None
                ),
                what="the Slurm job's rank up, the squatter's refused",
            )
            assert any("u1.json" in b and "rank_conflict" in b for b in _bad_files(world))
        finally:
            d.stop()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for level in reversed(made):
            with contextlib.suppress(OSError):
                level.rmdir()


@pytest.mark.parametrize(
    ("content", "owners", "reason"),
    [
        ('{"version": 1, "owners": {"a": 1000, "b": 0}}', {"a": 1000, "b": 0}, None),
        ('{"version": 1, "owners": {"a": 1e400, "b\\n": 5, "c": -1, "d": true, "e": 7}}', {"e": 7}, "invalid"),
        ('{"version": 1, "owners": {"a": ' + "9" * 5000 + "}}", {}, "unreadable"),
        ("[" * 100_000 + "]" * 100_000, {}, "unreadable"),
        ('{"owners": {' + ", ".join(f'"j{i}": 1' for i in range(5000)) + "}}", None, "invalid"),
        (b'{"owners": {"\xff": 1}}', {}, "unreadable"),
    ],
)
def test_a_job_owners_file_is_untrusted_input(
    tmp_path: Path, content: str | bytes, owners: dict[str, int] | None, reason: str | None
) -> None:
    """What the daemon reads back from state_dir (a crash, a disk error, a hand edit) is bounded
    and validated: a bad member is skipped, a bad file ignored, each counted."""
    from gpuwatchd.counters import CounterStore
    from gpuwatchd.rank.rankfile import MAX_RANKS_PER_NODE
    from gpuwatchd.sources.job_owners import FILE, JobOwnerFile
    from gpuwatchd.statefile import StateFiles

    path = tmp_path / FILE
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    counters = CounterStore()
    got = JobOwnerFile(str(tmp_path), StateFiles(counters)).load()
    if owners is None:  # more jobs than a node can watch: the first MAX_RANKS_PER_NODE are kept
        assert len(got) == MAX_RANKS_PER_NODE
    else:
        assert got == owners
    rejected = counters.get("state_records_rejected", (FILE, reason)) if reason else 0
    assert (rejected > 0) == (reason is not None)
