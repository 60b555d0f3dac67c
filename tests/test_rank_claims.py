"""Rank claims on a shared node (issue 11, items 1, 3 and 11), through the real daemon, with a real
second user (useradd, setpriv) and real processes:

- no content of one rank file (huge numbers, NaN/Infinity, odd Unicode, deep nesting, duplicate
  keys, a name that is not UTF-8) affects any other file;
- a user cannot take over a rank of someone else's job, neither with a rank file naming a PID that
  does not exist nor with a process of their own that sets torchrun variables (nor does a root
  process of the job that switches to a user after it was discovered stay, or page, as a rank);
- a vanished rank_dir is reported (collector down) and recovered from.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemonutil import DaemonProc, finding_jobs, write_config
from userutil import rank_world_fixture, setpriv, user_writes, users_fixture

USER = "gwtrustrank-u"
NO_SUCH_PID = 4_100_000  # above any pid_max in use, within the schema's bound
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]


user = users_fixture(USER)


world = rank_world_fixture("gwtrustrank-")


def _doc(job: str, ranks: list[dict[str, Any]]) -> str:
    return json.dumps({"version": 1, "job_id": job, "ranks": ranks})


def _as_user_popen(
    procs: list[subprocess.Popen[Any]], argv: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[Any]:
    p = subprocess.Popen([*setpriv(USER), *argv], env={"PATH": "/usr/bin:/bin", **(env or {})})
    procs.append(p)
    return p


def _state(d: DaemonProc) -> dict[str, Any]:
    """The daemon's state file (written just after /metrics shows a cycle: wait for the first)."""
    path = Path(d.cfg["state_dir"]) / "state.json"
    d.wait_for(path.exists, what="state.json")
    return dict(json.loads(path.read_text()))


def _findings(d: DaemonProc, kind: str) -> list[dict[str, Any]]:
    return [f for f in _state(d)["findings"] if f["kind"] == kind]


def _hold(what: str, pred: Callable[[], bool], seconds: float, d: DaemonProc) -> None:
    """``pred`` stays true for ``seconds`` (checked at every scrape)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert pred(), f"{what} stopped holding; daemon log:\n{d.log()}\nmetrics:\n{d.text()}"
        time.sleep(0.2)


def test_no_content_of_one_file_affects_another(user: int, world: Path, procs: list[subprocess.Popen[Any]]) -> None:
    ranks = world / "ranks"
    root_proc = subprocess.Popen(SLEEP)
    procs.append(root_proc)
    user_proc = _as_user_popen(procs, SLEEP)
    (ranks / "zz-root.json").write_text(_doc("rootjob", [{"rank": 0, "pid": root_proc.pid}]))
    user_writes(USER, ranks / "zz-user.json", _doc("userjob", [{"rank": 0, "pid": user_proc.pid}]))
    own = {"rank": 0, "pid": user_proc.pid}
    hostile: dict[str, tuple[str | bytes, str]] = {
        "bigint.json": (_doc("a", [own])[:-3] + ', "start_ticks": ' + "9" * 5000 + "}]}", "5000 digits"),
        "nan.json": (
            '{"version": 1, "job_id": "a", "world_size": NaN, "ranks": [{"rank": 0, "pid": 1}]}',
            "NaN is not a number",
        ),
        "inf.json": (
            '{"version": 1, "job_id": "a", "ranks": [{"rank": 0, "pid": -Infinity}]}',
            "-Infinity is not a number",
        ),
        "hugefloat.json": (
            '{"version": 1, "job_id": "a", "ranks": [{"rank": 0, "pid": 1e400}]}',
            "pid must be an integer",
        ),
        "surrogate.json": ('{"version": 1, "job_id": "a\\ud800", "ranks": [{"rank": 0, "pid": 1}]}', "job_id must be"),
        "hbsurrogate.json": (_doc("a", [{**own, "heartbeat": "/tmp/\udc80"}]), "heartbeat must be"),
        "dupkeys.json": (
            '{"version": 1, "job_id": "rootjob", "job_id": "x", "ranks": [{"rank": 0, "pid": 1}]}',
            "appears twice",
        ),
        "deep.json": ("[" * 900 + "]" * 900, "nested deeper"),
        "bom.json": ("\ufeff" + _doc("a", [own]), "not valid JSON"),
        "latin1.json": (b'{"version": 1, "job_id": "\xe9", "ranks": []}', "not UTF-8"),
        "bad-\udcff-name.json": (_doc("a", [own]), "not printable"),
    }
    for name, (content, _) in hostile.items():
        user_writes(USER, ranks / name, content)

    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:

        def both_up() -> bool:
            return (
                d.value("gpuwatch_rank_up", job_id="rootjob", rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id="userjob", rank="0") == 1.0
                and d.value("gpuwatch_collector_success", collector="rankfiles") == 1.0
            )

        d.wait_for(both_up, what="both good ranks up")
        # well past the collector's max age (3 intervals + 2 s): a failing collector would have
        # dropped every rank by then
        _hold("both good ranks up", both_up, 6.0, d)
        reasons = "\n".join(f["explanation"] for f in _findings(d, "bad_rank_file"))
    finally:
        d.stop()
    for name, (_, reason) in hostile.items():
        shown = ascii(name)[1:-1] if not name.isprintable() else name
        assert any(shown in line and reason in line for line in reasons.splitlines()), (name, reason, reasons)
    assert "Traceback" not in d.log_path.read_text(errors="replace")


def test_a_missing_pid_cannot_take_over_roots_rank(user: int, world: Path, procs: list[subprocess.Popen[Any]]) -> None:
    """(a) A user's file that sorts first and names a PID that does not exist claims rank 0 of
    root's job (held by root's live process) and its free rank 1: neither is taken, nothing pages,
    both are refused as bad_rank_file."""
    ranks = world / "ranks"
    root_proc = subprocess.Popen(SLEEP)
    procs.append(root_proc)
    (ranks / "rootjob.0.json").write_text(_doc("rootjob", [{"rank": 0, "pid": root_proc.pid}]))
    user_writes(
        USER,
        ranks / "0-takeover.json",
        _doc("rootjob", [{"rank": 0, "pid": NO_SUCH_PID}, {"rank": 1, "pid": NO_SUCH_PID + 1}]),
    )
    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id="rootjob", rank="0") == 1.0, what="root's rank 0 up")
        d.wait_for(lambda: len(_findings(d, "bad_rank_file")) >= 1, what="the refusal")
        _hold(
            "root's rank 0 up, rank 1 absent, nothing paged",
            lambda: (
                d.value("gpuwatch_rank_up", job_id="rootjob", rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id="rootjob", rank="1") is None
                and d.value("gpuwatch_finding", kind="rank_down") is None
            ),
            3.0,
            d,
        )
        info = d.value("gpuwatch_rank_info", job_id="rootjob", rank="0", pid=str(root_proc.pid))
        reasons = [f["explanation"] for f in _findings(d, "bad_rank_file")]
    finally:
        d.stop()
    assert info == 1.0
    assert any("0-takeover.json" in r and "belongs to uid 0" in r and "rank 1" in r for r in reasons), reasons


def test_discovery_does_not_adopt_another_users_process_into_roots_job(
    user: int, world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """(b) Root's torchrun job runs rank 0; a user's process sets the same TORCHELASTIC_RUN_ID and
    RANK=1. It is refused (bad_rank_file naming it), and when it exits nothing pages, while a real
    discovered rank of root's that exits beside it does. The user's own discovered job is watched
    as usual. Job ids are this run's own: discovery sees the whole host, other suites' ranks too."""
    ranks = world / "ranks"
    tag = uuid.uuid4().hex[:8]
    shared, users, neighbour = f"sharedjob-{tag}", f"userjob-{tag}", f"neighbour-{tag}"
    torchrun = {"TORCHELASTIC_RUN_ID": shared, "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
    root_proc = subprocess.Popen(SLEEP, env={**torchrun, "RANK": "0", "LOCAL_RANK": "0"})
    procs.append(root_proc)
    time.sleep(0.05)  # root's process starts first: a later process cannot own the job
    intruder = _as_user_popen(procs, SLEEP, {**torchrun, "RANK": "1", "LOCAL_RANK": "1"})
    own = _as_user_popen(procs, SLEEP, {"TORCHELASTIC_RUN_ID": users, "RANK": "0"})
    other = subprocess.Popen(SLEEP, env={"TORCHELASTIC_RUN_ID": neighbour, "RANK": "0", "PATH": "/usr/bin:/bin"})
    procs.append(other)
    path, cfg = write_config(world, rank_dir=str(ranks), discovery={"enabled": True, "interval_seconds": 600})
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id=shared, rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=users, rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=neighbour, rank="0") == 1.0
            ),
            what="root's rank 0, the user's own job and the neighbour up",
        )
        assert d.value("gpuwatch_rank_up", job_id=shared, rank="1") is None
        reasons = [f["explanation"] for f in _findings(d, "bad_rank_file")]
        assert any(f"discovery (pid {intruder.pid})" in r and "belongs to uid 0" in r for r in reasons), reasons
        for p in (intruder, other):
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        d.wait_for(lambda: neighbour in finding_jobs(d, "rank_down"), what="the neighbour paged")
        _hold(
            "no rank_down of root's or the user's job",
            lambda: (
                not finding_jobs(d, "rank_down") & {shared, users}
                and d.value("gpuwatch_rank_up", job_id=shared, rank="1") is None
            ),
            3.0,
            d,
        )
        assert d.value("gpuwatch_rank_info", job_id=users, rank="0", pid=str(own.pid)) == 1.0
    finally:
        d.stop()


def test_a_discovered_process_that_drops_to_a_user_is_refused_alive_and_dead(
    user: int, world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """(c) A root process with root's job's variables (a wrapper such as setpriv or gosu before it
    switches user) is discovered as root's rank 1, then drops to the user's uid: refused from then
    on, and when it exits nothing pages. (The claim used to be judged alive by the process's uid
    and, once gone, by the uid discovery had read: refused while alive, rank_down when dead.)"""
    job = f"dropjob-{uuid.uuid4().hex[:8]}"
    torchrun = {"TORCHELASTIC_RUN_ID": job, "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
    rank0 = subprocess.Popen(SLEEP, env={**torchrun, "RANK": "0"})
    procs.append(rank0)
    time.sleep(0.05)  # root's rank 0 starts first: the job is root's
    dropper = subprocess.Popen(
        [
            "/usr/bin/python3",
            "-c",
            "import os, signal, sys, time\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
            "print('ready', flush=True)\n"
            "signal.sigwait({signal.SIGUSR1})\n"
            "os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))\n"
            "time.sleep(300)\n",
            str(user),
        ],
        env={**torchrun, "RANK": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(dropper)
    assert dropper.stdout is not None and dropper.stdout.readline() == "ready\n"
    path, cfg = write_config(world, rank_dir=str(world / "ranks"), discovery={"enabled": True, "interval_seconds": 600})
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=job, rank="1") == 1.0
            ),
            what="both root ranks up",
        )
        dropper.send_signal(signal.SIGUSR1)
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id=job, rank="1") is None
                and any(
                    f"discovery (pid {dropper.pid})" in f["explanation"]
                    and f"by uid {user} refused" in f["explanation"]
                    for f in _findings(d, "bad_rank_file")
                )
            ),
            what="rank 1 refused once it runs as the user",
        )
        dropper.kill()
        dropper.wait(10)
        _hold(
            "no rank_down, rank 1 absent, rank 0 up",
            lambda: (
                job not in finding_jobs(d, "rank_down")
                and d.value("gpuwatch_rank_up", job_id=job, rank="1") is None
                and d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0
            ),
            3.0,
            d,
        )
    finally:
        d.stop()


def test_vanished_rank_dir_is_reported_and_recovered(world: Path, procs: list[subprocess.Popen[Any]]) -> None:
    """The collector is down while rank_dir is gone (ranks discovered from /proc stay watched),
    and the rank files' ranks are back in the first cycle after it returns."""
    ranks = world / "ranks"
    rank = subprocess.Popen(SLEEP)
    procs.append(rank)
    env_job = f"gwtrustrank-env-{uuid.uuid4().hex[:8]}"  # discovery sees other suites' ranks too
    found = subprocess.Popen(SLEEP, env={"TORCHELASTIC_RUN_ID": env_job, "RANK": "0"})
    procs.append(found)
    doc = _doc("job", [{"rank": 0, "pid": rank.pid}])
    (ranks / "job.0.json").write_text(doc)
    path, cfg = write_config(world, rank_dir=str(ranks), discovery={"enabled": True, "interval_seconds": 1})
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id="job", rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=env_job, rank="0") == 1.0
            ),
            what="both ranks up",
        )
        shutil.rmtree(ranks)
        d.wait_for(
            lambda: d.value("gpuwatch_collector_success", collector="rankfiles") == 0.0,
            what="the rankfiles collector down",
        )
        status = [c for c in _state(d)["collectors"] if c["name"] == "rankfiles"]
        assert str(ranks) in status[0]["error"], status
        _hold(
            "the discovered rank watched", lambda: d.value("gpuwatch_rank_up", job_id=env_job, rank="0") == 1.0, 2.0, d
        )
        ranks.mkdir()
        os.chmod(ranks, 0o1777)
        (ranks / "job.0.json").write_text(doc)
        d.wait_for(
            lambda: (
                d.value("gpuwatch_collector_success", collector="rankfiles") == 1.0
                and d.value("gpuwatch_rank_up", job_id="job", rank="0") == 1.0
            ),
            what="recovered",
        )
    finally:
        d.stop()
