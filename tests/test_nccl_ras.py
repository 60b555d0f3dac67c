"""NCCL RAS as evidence, end to end: real rank processes play NCCL's RAS thread on a loopback
port (tests/fixtures/nccl_ras/ras_server.py, answering NCCL's JSON from the fixtures there), the
real daemon asks them when the job looks stalled, checks that the port is the job's, and turns
the answer into findings, metrics and ``state.json`` (what ``gpuwatchd ps --json`` prints).

Each job has its own port through ``NCCL_RAS_ADDR`` in its ranks' environment (the daemon reads
it from /proc/PID/environ), so tests never collide with each other or with a real NCCL job.
Hostile listeners change nothing: another user's listener on the job's port (a forged answer
naming the job's PIDs), and the job's own slow, huge and malformed answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, free_port, write_config
from userutil import rank_world_fixture, users_fixture

from gpuwatchd.join.nccl_ras import RasTracker, confirm_by_ras, parse_status
from gpuwatchd.model.nccl_ras import RasJob, RasRank
from gpuwatchd.model.stall import HangAnalysis, Pattern, StallVerdict
from gpuwatchd.sources.nccl_ras import decode_status, ras_address

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_ras"
SERVER = FIXTURES / "ras_server.py"
USER = "gw-ras-squat"
LOCAL_HOST = "10.1.0.4"  # the fixtures' node; the test's ranks are on 127.0.0.1
REMOTE = "10.1.0.5"


user = users_fixture(USER)


world = rank_world_fixture("gw-ras-")


def _answer(fixture: str, pids: list[int], ops: bool = False) -> str:
    text = (FIXTURES / fixture).read_text().replace(f'"{LOCAL_HOST}"', '"127.0.0.1"')
    for fake, real in zip(("4101", "4102"), pids, strict=False):
        text = text.replace(f'"pid": {fake},', f'"pid": {real},')
    if ops:
        text = text.replace('"AllReduce": 10234', '"AllReduce": {ops}')
    return text


class Job:
    """Two local ranks of one job, each a RAS server on the job's port (SO_REUSEPORT, as NCCL)."""

    def __init__(
        self,
        world: Path,
        name: str,
        fixture: str | None,
        procs: list[Any],
        mode: str = "normal",
        ops: bool = False,
        beat_age: float | None = 600.0,
    ) -> None:
        self.name, self.port = name, free_port()
        self.answer = world / f"{name}.json"
        self.answer.write_text("{}")
        self.answer.chmod(0o644)
        env = {"PATH": "/usr/bin:/bin", "NCCL_RAS_ADDR": f"127.0.0.1:{self.port}"}
        if fixture is None:  # a rank with no RAS thread: something else may hold its port
            cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
            self.procs = [subprocess.Popen(cmd, env=env) for _ in range(2)]
        else:
            cmd = [sys.executable, str(SERVER), str(self.port), str(self.answer), mode, str(world)]
            self.procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE) for _ in range(2)]
            for p in self.procs:
                assert p.stdout is not None and p.stdout.readline().strip() == b"listening"
            self.answer.write_text(_answer(fixture, self.pids, ops))
        procs.extend(self.procs)
        ranks = world / "ranks"
        old = time.time() - (beat_age or 0.0)  # its last heartbeat
        entries = []
        for rank, p in enumerate(self.procs):
            if beat_age is None:  # no heartbeat: its stacks say whether it moves
                entries.append({"rank": rank, "pid": p.pid})
                continue
            hb = ranks / f"{name}.{rank}.hb"
            hb.write_text("")
            os.utime(hb, (old, old))
            entries.append({"rank": rank, "pid": p.pid, "heartbeat": str(hb)})
        (ranks / f"{name}.json").write_text(
            json.dumps({"version": 1, "job_id": name, "world_size": 4, "ranks": entries})
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _state(world: Path) -> dict[str, Any]:
    path = world / "state" / "state.json"
    try:
        return dict(json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _findings(world: Path, kind: str) -> dict[str, str]:
    return {f["job_id"]: f["explanation"] for f in _state(world).get("findings", []) if f["kind"] == kind}


def _ops(world: Path, job: str) -> dict[int, int]:
    return {r["rank"]: r["ops"] for r in _state(world).get("nccl_ras", []) if r["job_id"] == job}


def test_ras_names_the_culprit_and_hostile_ports_change_nothing(
        user: int, world: Path, procs: list[subprocess.Popen[Any]]) -> None:  # fmt: skip
    dead = Job(world, "rasdead", "dead_rank_2.28.9.json", procs)  # as NCCL 2.28.9 prints it
    unresponsive = Job(world, "rasunr", "unresponsive_rank.json", procs)
    lagging = Job(world, "raslag", "lagging.json", procs)
    failed = Job(world, "rasasync", "async_error.json", procs)
    moving = Job(world, "rasmove", "healthy.json", procs, ops=True)
    text = Job(world, "rastext", "dead_rank_2.27.7.txt", procs, mode="text")  # NCCL 2.24-2.27
    squat = Job(world, "rassquat", None, procs)
    hostile = {
        mode: Job(world, f"ras{mode}", "dead_rank.json", procs, mode=mode)
        for mode in ("slow", "huge", "garbage", "silent")
    }
    # another user's listener on the squatted job's port, answering a perfect forgery of it
    forged = world / "forged.json"
    forged.write_text(_answer("dead_rank.json", squat.pids))
    forged.chmod(0o644)
    stranger = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={USER}",
            f"--regid={USER}",
            "--clear-groups",
            "/usr/bin/python3",
            str(SERVER),
            str(squat.port),
            str(forged),
        ],
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
    )
    procs.append(stranger)
    assert stranger.stdout is not None and stranger.stdout.readline().strip() == b"listening"

    path, cfg = write_config(
        world,
        rank_dir=str(world / "ranks"),
        stall={
            "after_seconds": 1.5,
            "flight_recorder": False,
            "nccl_ras_interval_seconds": 1,
            "nccl_ras_timeout_seconds": 1.0,
        },
    )
    d = DaemonProc(path, cfg)
    try:

        def named() -> bool:
            found = _findings(world, "nccl_rank_missing")
            return all(j.name in found for j in (dead, unresponsive, lagging, failed, text))

        d.wait_for(named, timeout=60, what="a nccl_rank_missing finding for each RAS state")
        found = _findings(world, "nccl_rank_missing")
        p = dead.pids
        assert (f"rank 3 on {REMOTE} (pid 4104) is dead per NCCL RAS; the 3 others wait in AllReduce #10234") in found[
            dead.name
        ]
        assert (
            f"rank 2 on {REMOTE} (pid 4103) is unresponsive per NCCL RAS; the 3 others wait in AllReduce #10234"
        ) in found[unresponsive.name]
        assert f"rank 2 on {REMOTE} (pid 4103) is behind (10238 collectives issued) per NCCL RAS" in found[lagging.name]
        assert (
            f"rank 3 on {REMOTE} (pid 4104) has an asynchronous NCCL error: remote process error" in found[failed.name]
        )
        assert f"rank 3 on {REMOTE} (pid 4104) is dead per NCCL RAS" in found[text.name]
        # every node's stall finding carries the culprit
        stalled = _findings(world, "rank_stalled")
        assert "is dead per NCCL RAS" in stalled[dead.name]
        assert d.value("gpuwatch_nccl_ras_missing_ranks", job_id=dead.name, reason="dead") == 1.0
        assert d.value("gpuwatch_nccl_ras_missing_ranks", job_id=unresponsive.name, reason="unresponsive") == 1.0
        assert d.value("gpuwatch_nccl_ras_async_error_ranks", job_id=failed.name) == 1.0
        # joined by (host, PID): the local ranks' counts, under gpuwatchd's rank numbers
        assert _ops(world, dead.name) == {0: 10239, 1: 10239}
        assert {r["pid"] for r in _state(world)["nccl_ras"] if r["job_id"] == dead.name} == set(p)

        # counts that move: the rank is at work, not stalled, and ps --json shows them move
        d.wait_for(
            lambda: (
                moving.name not in _findings(world, "rank_stalled")
                and len(_ops(world, moving.name)) == 2
                and d.value("gpuwatch_rank_stalled", job_id=moving.name, rank="0") == 0.0
            ),
            timeout=20,
            what="not stalled (finding and gauge) while its RAS counts move",
        )
        first = _ops(world, moving.name)[0]
        d.wait_for(
            lambda: _ops(world, moving.name).get(0, 0) > first, timeout=10, what="op counts that move in state.json"
        )
        assert moving.name not in _findings(world, "nccl_rank_missing")
        assert d.value("gpuwatch_rank_stalled", job_id=dead.name, rank="0") == 1.0

        # hostile: nothing of theirs reaches a finding, and the daemon keeps its cycle
        end = time.monotonic() + 5
        while time.monotonic() < end:
            found = _findings(world, "nccl_rank_missing")
            assert squat.name not in found
            assert not any(f"ras{m}" in found for m in hostile)
            stalled = _findings(world, "rank_stalled")
            assert "NCCL RAS" not in stalled.get(squat.name, "")
            assert d.value("gpuwatch_collector_success", collector="nccl_ras") != 0.0
            # slow and silent listeners cost the cycle one time-out (1 s) for all of them
            assert (d.value("gpuwatch_cycle_duration_seconds") or 0) < 2.5
            time.sleep(0.5)
        assert squat.name in _findings(world, "rank_stalled")  # the stall itself still pages
        assert all(f"ras{m}" in _findings(world, "rank_stalled") for m in hostile)
        assert not any(
            r["job_id"] in (squat.name, *(f"ras{m}" for m in hostile)) for r in _state(world).get("nccl_ras", [])
        )
        log = d.log()
        assert "Traceback" not in log
        assert stranger.poll() is None
    finally:
        d.stop()


def test_a_rank_that_stopped_beating_and_trains_is_asked(
        world: Path, procs: list[subprocess.Popen[Any]]) -> None:  # fmt: skip
    """The device run's shape: the job beats, then stops calling heartbeat() and trains on (its
    main thread works half of the time): not stalled to the stall part, and its RAS port is asked
    all the same once its heartbeat is late, so its counts are in ps --json. Before, only a
    stalled or suspect rank's job was asked: this one never was."""
    working = Job(world, "raswork", "healthy.json", procs, mode="work", ops=True, beat_age=0.0)
    path, cfg = write_config(
        world,
        rank_dir=str(world / "ranks"),
        stall={
            "after_seconds": 8.0,
            "flight_recorder": False,
            "nccl_ras_interval_seconds": 1,
            "nccl_ras_timeout_seconds": 1.0,
        },
    )
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: len(_ops(world, working.name)) == 2,
            timeout=20,
            what="RAS counts of the job that works without a heartbeat",
        )
        first = _ops(world, working.name)[0]
        d.wait_for(lambda: _ops(world, working.name).get(0, 0) > first, timeout=10, what="its counts moving")
        assert d.value("gpuwatch_rank_stalled", job_id=working.name, rank="0") == 0.0
        assert "NCCL RAS of job raswork (rank 0 heartbeat late (" in d.log(), d.log()
        assert "(rank 0 stalled)" not in d.log(), d.log()
    finally:
        assert d.stop() == 0, d.log()


C10D = """
import threading
_never = threading.Lock()
_never.acquire()


def all_reduce():
    _never.acquire()  # a peer that never arrives: blocked at 0 % CPU
"""


def test_a_hang_that_ras_confirms_is_paged_at_the_conclusive_bound(
        world: Path, procs: list[subprocess.Popen[Any]]) -> None:  # fmt: skip
    """after_seconds 300, conclusive_seconds 3: two ranks here wait in all_reduce with no
    heartbeat (both in the collective: alone, that is not conclusive, the peer they wait for may be
    elsewhere). With RAS naming rank 3 dead and no count moving, they are paged at the conclusive
    bound ("ras_missing"); the same ranks with RAS counts that stop but nobody missing (a peer
    elsewhere busy outside collectives) are not paged."""
    (world / "distributed_c10d.py").write_text(C10D)
    dead = Job(world, "rasconcl", "dead_rank.json", procs, mode="collective", beat_age=None)
    quiet = Job(world, "rasquiet", "healthy.json", procs, mode="collective", beat_age=None)
    path, cfg = write_config(
        world,
        rank_dir=str(world / "ranks"),
        stall={
            "after_seconds": 300.0,
            "conclusive_seconds": 3.0,
            "flight_recorder": False,
            "nccl_ras_interval_seconds": 1,
            "nccl_ras_timeout_seconds": 1.0,
        },
    )
    d = DaemonProc(path, cfg)
    t0 = time.monotonic()
    try:
        d.wait_for(
            lambda: dead.name in _findings(world, "rank_stalled"), timeout=60, what="the RAS-confirmed hang paged"
        )
        print(f"paged {time.monotonic() - t0:.1f} s after the daemon's start (bound 3 s)")
        text = _findings(world, "rank_stalled")[dead.name]
        assert "conclusive: it waits in a collective, still for" in text, text
        assert "NCCL RAS agrees" in text and "rank 3 on 10.1.0.5 (pid 4104) is dead per NCCL RAS" in text, text
        assert d.value("gpuwatch_rank_stalled", job_id=dead.name, rank="0") == 1.0
        end = time.monotonic() + 8  # the other job, RAS present and silent, over 2.5 x the bound
        while time.monotonic() < end:
            assert quiet.name not in _findings(world, "rank_stalled")
            assert d.value("gpuwatch_rank_stalled", job_id=quiet.name, rank="0") != 1.0
            time.sleep(0.5)
        assert (_state(world).get("nccl_ras") or []) and quiet.name in {
            r["job_id"] for r in _state(world)["nccl_ras"]
        }  # asked all along
    finally:
        assert d.stop() == 0, d.log()


GONE = (RasRank(3, REMOTE, 4104, missing="dead"),)


@pytest.mark.parametrize(
    ("change", "paged"),
    [
        ({}, True),
        ({"progressing": True}, False),  # counts move: the job works
        ({"progressing": None}, False),  # the first answer, or text (no counts)
        ({"stopped_seconds": 39.0}, False),
        ({"missing_seconds": 39.0}, False),  # missing only lately (a leg that timed out once)
        ({"missing": ()}, False),  # counts stopped, everyone present: a peer busy elsewhere
        ({"size": 1}, False),  # NCCL counts nothing of a one-rank communicator
        ({"error": "timed out"}, False),
        ({"still": 39.0}, False),
        ({"kinds": ("lock_wait",)}, False),  # not in a collective
        ({"waits_for": "rank 1 waits in barrier for rank 0, which works"}, False),
    ],
)
def test_ras_confirms_a_hang_only_with_the_local_view(change: dict[str, Any], paged: bool) -> None:
    job = {k: v for k, v in change.items() if k not in ("still", "kinds", "waits_for")}
    ras = RasJob(
        **{
            "job_id": "j",
            "asked_at": 100.0,
            "size": 4,
            "missing": GONE,
            "progressing": False,
            "stopped_seconds": 41.0,
            "missing_seconds": 40.0,
            **job,
        }
    )  # type: ignore[arg-type]
    analysis = HangAnalysis((), (), tuple(Pattern(k, "") for k in change.get("kinds", ("collective",))))
    v = StallVerdict(
        "j",
        0,
        4101,
        True,
        50.0,
        False,
        "stack",
        50.0,
        analysis=analysis,
        still_seconds=change.get("still", 45.0),
        waits_for=change.get("waits_for", ""),
    )
    out = confirm_by_ras({v.key: v, **{}}, {"j": ras}, 40.0)
    assert (v.key in out) is paged
    if paged:
        assert out[v.key].stalled and out[v.key].conclusive == "ras_missing"
    assert not confirm_by_ras({v.key: v}, {}, 40.0)  # no answer, no change


def test_a_missing_rank_as_nccl_2_28_prints_it_is_read() -> None:
    # 2.28.7-2.28.9 leave out the comma after a missing rank's nvml_dev: not JSON as printed
    raw = (FIXTURES / "dead_rank_2.28.9.json").read_bytes()
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    answer = parse_status(decode_status(raw))
    assert [(r.rank, r.host, r.pid, r.missing) for r in answer.missing] == [(3, REMOTE, 4104, "dead")]
    later = parse_status(decode_status((FIXTURES / "dead_rank.json").read_bytes()))
    assert (later.size, later.ranks, later.missing) == (answer.size, answer.ranks, answer.missing)
    with pytest.raises(ValueError):  # the comma is put back there only
        decode_status(raw.replace(b'"considered_dead": true', b'"considered_dead": true 1'))


def test_a_one_rank_communicator_counts_nothing() -> None:
    # NCCL copies a one-rank collective locally (ncclLaunchOneRank), with no kernel plan to count
    # it: a world-size-1 job's counts stay 0 while it trains, and that says nothing either way
    doc = json.loads((FIXTURES / "healthy.json").read_text())
    world = doc["communicators"][0]
    world.update(size=1, ranks_count=1, ranks=world["ranks"][:1])
    world["ranks"][0]["collective_counts"] = dict.fromkeys(world["ranks"][0]["collective_counts"], 0)
    doc["communicators"] = [world]
    tracker = RasTracker()
    local = {4101: (0, 111)}
    tracker.observe("j", 100.0, parse_status(doc), local, frozenset({LOCAL_HOST}))
    later = tracker.observe("j", 160.0, parse_status(doc), local, frozenset({LOCAL_HOST}))
    assert later.progressing is None and later.stopped_seconds == 0.0 and not later.statement
    assert [(s.rank, s.ops, s.counted) for s in later.local] == [(0, 0, False)]


def test_nccl_ras_addr_as_nccl_reads_it() -> None:
    # NCCL takes host:port with a name (getaddrinfo) or an address, [v6]:port; the port is what
    # finds the listeners, so a name the daemon never resolves still asks the job's port
    assert ras_address(None) == ("127.0.0.1", 28028)
    assert ras_address("localhost:29000") == ("127.0.0.1", 29000)
    assert ras_address("[::1]:29001") == ("::1", 29001)
    assert ras_address("node-5.cluster:29002") == ("node-5.cluster", 29002)
    for bad in ("28028", "host:", "host:0", "host:70000", "host:2x"):
        with pytest.raises(ValueError):
            ras_address(bad)


@pytest.mark.parametrize(
    ("fixture", "missing", "failed"),
    [
        ("healthy_2.27.7.txt", [], []),
        ("dead_rank_2.27.7.txt", [(3, REMOTE, 4104, "dead")], []),
        ("async_error_2.26.6.txt", [], [(3, REMOTE, 4104, 6)]),
        # 2.24-2.25 name the missing rank by number only, and the process that did not answer
        ("unresponsive_rank_2.24.3.txt", [(-1, REMOTE, 4103, "unresponsive"), (2, "", -1, "unresponsive")], []),
    ],
)
def test_text_answers_of_nccl_2_24_to_2_27(fixture: str, missing: list[tuple[Any, ...]],
                                           failed: list[tuple[Any, ...]]) -> None:  # fmt: skip
    answer = parse_status((FIXTURES / fixture).read_text())
    assert answer.text and answer.size == 4 and answer.nccl_version == fixture[-10:-4]
    assert [(r.rank, r.host, r.pid, r.missing) for r in answer.missing] == missing
    assert [(r.rank, r.host, r.pid, r.async_error) for r in answer.ranks] == failed
    job = RasTracker().observe("j", 100.0, answer, {4101: (0, 111)}, frozenset({LOCAL_HOST}))
    assert not job.error and job.progressing is None and not job.local and not job.behind
    if missing:
        assert job.statement.startswith(
            (
                "rank 3 on 10.1.0.5 (pid 4104) is dead per NCCL RAS",
                "process 4103 on 10.1.0.5 is unresponsive; rank 2 is unresponsive per NCCL RAS",
            )
        ), job.statement
    elif failed:
        assert job.statement == "rank 3 on 10.1.0.5 (pid 4104) has an asynchronous NCCL error: remote process error", (
            job.statement
        )
    else:
        assert job.statement == ""


def test_the_parser_refuses_other_shapes() -> None:
    for doc in (
        "",
        "Job summary\n",
        {},
        {"communicators": {}},
        {"communicators": [{"size": 1, "ranks": [{"rank": "x"}]}]},
        {"communicators": [{"size": 1, "ranks": [{"rank": 0, "host": "\x1b[2J", "pid": 1, "collective_counts": {}}]}]},
    ):
        with pytest.raises(ValueError):
            parse_status(doc)


def test_a_lagging_rank_is_named_only_once_counts_stop() -> None:
    doc = json.loads((FIXTURES / "lagging.json").read_text())
    tracker = RasTracker()
    local = {4101: (0, 111), 4102: (1, 112)}
    here = frozenset({LOCAL_HOST})
    first = tracker.observe("j", 100.0, parse_status(doc), local, here)
    assert first.progressing is None and not first.behind and not first.statement
    second = tracker.observe("j", 110.0, parse_status(doc), local, here)
    assert second.progressing is False and [r.rank for r in second.behind] == [2]
    assert second.stopped_seconds == 10.0
    assert second.local[0].moved_at == 100.0 and second.local[0].ops == 10239
    gone = parse_status(json.loads((FIXTURES / "dead_rank.json").read_text()))
    assert tracker.observe("j", 120.0, gone, local, here).missing_seconds == 0.0
    assert tracker.observe("j", 135.0, gone, local, here).missing_seconds == 15.0  # the streak
    assert tracker.observe("j", 140.0, parse_status(doc), local, here).missing_seconds == 0.0
    assert tracker.observe("j", 150.0, gone, local, here).missing_seconds == 0.0  # a new one
    other = tracker.observe("k", 100.0, parse_status(doc), {9999: (0, 9999)}, here)
    assert other.error == "the answer names none of the job's ranks here" and not other.local


def test_the_listeners_on_a_port_by_sock_diag_as_in_proc_net_tcp() -> None:
    """The port's listeners come from sock_diag where the rank shares the daemon's network
    namespace (5.5 ms a query through /proc/PID/net/tcp and tcp6 on the 2-core VM, 0.16 ms so):
    the same sockets /proc shows (IPv4, IPv6, a port shared with SO_REUSEPORT), none on a free
    port, and no /proc/PID/net read at all (before, a rank's listeners came from there only)."""
    import socket

    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.nccl_ras import diag_listeners, listeners, owned_listener

    socks = []
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            s = socket.socket(family)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, socks[0].getsockname()[1] if len(socks) > 1 else 0))
            s.listen()
        port = socks[0].getsockname()[1]
        by_diag = diag_listeners(port)
        assert by_diag is not None and len(by_diag) == 3
        assert sorted(by_diag, key=lambda li: li.inode) == sorted(
            listeners("/proc/self/net", port), key=lambda li: li.inode
        )
        assert {li.address for li in by_diag} == {"127.0.0.1", "::1"}
        assert diag_listeners(free_port()) == []
        paths = HostPaths()

        def proc(pid: object, *parts: str) -> str:  # /proc, with every net/ read made to fail
            return paths.proc(pid, *parts) if parts[:1] != ("net",) else "/nonexistent/net"

        assert owned_listener(proc, [os.getpid()], port) == ("127.0.0.1", os.getpid())
    finally:
        for s in socks:
            s.close()
