"""The parts of exit recording, each on real inputs: the kernel's fault lines recorded on this
machine, wait statuses of real processes, the watcher against a launcher that reaps at once and
against another user's process, and the paging rules on joined exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import job_crashed, rank_down
from gpuwatchd.findings.context import FindingContext
from gpuwatchd.join.exits import classify, describe_status, order
from gpuwatchd.join.kernel_faults import KernelFault, KernelFaults
from gpuwatchd.model import RankState
from gpuwatchd.model.events import Event
from gpuwatchd.model.exits import CRASHED, KILLED, NODE, STOPPED, RankExit
from gpuwatchd.model.parts import ExitOutput, Tracked
from gpuwatchd.sources.kernel_lines import parse_kmsg, parse_message

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests/fixtures/kernel/faults_6.18.kmsg"
sys.path.insert(0, str(REPO / "bench"))


def test_fault_lines_recorded_here_are_parsed() -> None:
    recs = [parse_kmsg(line.encode()) for line in FIXTURE.read_text().splitlines()]
    parsed = [parse_message(r.message) for r in recs if r is not None]
    assert [(p.kind, p.comm) for p in parsed if p] == [("fault", "python3")] * 5
    got = [(p.pid, p.fields["what"], p.fields["where"]) for p in parsed if p]
    assert got == [
        (22925, "segfault at 1", "libc.so.6"),
        (22927, "general protection fault", "libc.so.6"),
        (22929, "trap invalid opcode", "dev/zero"),
        (22930, "trap int3", "dev/zero"),
        (22954, "trap divide error", "dev/zero"),
    ]
    # the same words from userspace (facility 1) are no kernel line: the kmsg source drops them
    assert parse_message("python3[1]: segfault at 1 ip 0 sp 0 error 4", "earlyoom") is None


def _status(code: str) -> int:
    p = subprocess.Popen([sys.executable, "-c", code])
    _, status = os.waitpid(p.pid, 0)
    p.returncode = 0
    return status


@pytest.mark.parametrize(
    ("code", "cause", "how"),
    [
        ("raise SystemExit(0)", "exit_0", "exited with code 0"),
        ("raise RuntimeError('bug')", "exit_nonzero", "exited with code 1"),
        ("import ctypes; ctypes.string_at(1)", "SIGSEGV", "was killed by SIGSEGV"),
        ("import os; os.abort()", "SIGABRT", "was killed by SIGABRT"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGBUS)", "SIGBUS", "was killed by SIGBUS"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL", "was killed by SIGKILL"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGRTMIN + 2)", "signal_other", "was killed by signal 36"),
    ],
)
def test_wait_statuses_of_real_processes_are_named(code: str, cause: str, how: str) -> None:
    got_cause, got_how = describe_status(_status(code))
    assert got_cause == cause and got_how.startswith(how), got_how
    # the core-dump bit of a wait status (WCOREDUMP: 0x80 beside the signal)
    assert describe_status(signal.SIGSEGV | 0x80) == ("SIGSEGV", "was killed by SIGSEGV (core dumped)")
    assert describe_status(None, "reaped before read") == ("unknown", "ended (cause unknown: reaped before read)")


def _exit(rank: int, t: float, status: int | None, seq: int, job: str = "j", **kw: object) -> RankExit:
    return RankExit(
        job_id=job, rank=rank, pid=100 + rank, comm="python", time=t, status=status, seq=seq, start_ticks=rank, **kw
    )  # type: ignore[arg-type]


def test_the_kernel_names_the_cause_and_order_names_the_first() -> None:
    faults = KernelFaults()
    faults.record(KernelFault(101, "python", 999.9, "segfault at 1 ip 00007f error 4 in libc.so.6"))
    oom = Event(
        key="k",
        kind="oom_kill",
        time=1000.2,
        severity="page",
        summary="",
        pid=102,
        killer="kernel",
        fields={"rss_bytes": 2 << 30},
    )
    segv = classify(_exit(1, 1000.0, signal.SIGSEGV, 2), faults, [oom])
    assert segv.verdict == CRASHED and segv.kernel == "kernel: segfault at 1 ip 00007f error 4 in libc.so.6"
    killed = classify(_exit(2, 1000.0, signal.SIGKILL, 3), faults, [oom])
    assert (killed.cause, killed.verdict) == ("oom_kill", NODE) and "2.0 GiB" in killed.kernel
    assert classify(_exit(3, 1000, signal.SIGKILL, 4), faults, []).verdict == KILLED
    # the rank ended (exit 1) of its DataLoader worker's OOM kill: the node's doing, said so
    worker = Event(
        key="w",
        kind="oom_kill",
        time=999.0,
        severity="page",
        summary="",
        pid=555,
        comm="pt_data_worker",
        killer="kernel",
        worker=True,
        fields={"rank_pid": 103},
    )
    died = classify(_exit(3, 1000.0, 1 << 8, 4), faults, [worker])
    assert (died.cause, died.verdict, died.oom_event) == ("exit_nonzero", NODE, "w")
    assert died.kernel == "its worker pid 555 (pt_data_worker) was killed by the kernel OOM killer before it"
    assert classify(_exit(3, 1000, signal.SIGTERM, 4), faults, []).verdict == STOPPED
    assert classify(_exit(3, 1000, None, 4), faults, []).verdict == CRASHED  # discovered: unread
    assert classify(_exit(3, 1000, None, 4, registered=True), faults, []).verdict == KILLED
    # an Xid naming the PID (NVRM: Xid (PCI:...): 79, pid=103, ...): a critical one is the node's
    # doing; an application fault (13) is said, and the death stays the code's
    xid79 = Event(key="x", kind="xid", time=995.0, severity="page", summary="", pid=103, fields={"xid": 79, "gpu": "0"})
    xid13 = Event(key="y", kind="xid", time=995.0, severity="info", summary="", pid=103, fields={"xid": 13, "gpu": "0"})
    lost = classify(_exit(3, 1000.0, signal.SIGABRT, 4), faults, [xid79])
    assert (lost.verdict, lost.kernel) == (NODE, "Xid 79 on GPU 0")
    app = classify(_exit(3, 1000.0, signal.SIGABRT, 4), faults, [xid13])
    assert (app.verdict, app.kernel) == (CRASHED, "Xid 13 on GPU 0")
    # one wake read both (same time): the kernel's readiness order (seq) says which came first
    term = classify(_exit(0, 1000.0, signal.SIGTERM, 1 + 5), faults, [])
    ordered = {x.rank: x for x in order([term, segv])}
    assert ordered[1].first and not ordered[0].first and ordered[0].first_rank == 1
    # exit 0 is never a first failure; a failure long after the teardown window starts anew
    late = classify(_exit(4, 1100.0, 1 << 8, 9), faults, [])
    ok = classify(_exit(5, 999.0, 0, 1), faults, [])
    ordered = {x.rank: x for x in order([ok, segv, late])}
    assert ordered[5].first_pid is None and ordered[1].first and ordered[4].first


def _ctx(now: float, exits: tuple[RankExit, ...], alive: tuple[int, ...] = ()) -> FindingContext:
    ranks = tuple(
        RankState(job_id="j", rank=r, pid=100 + r, local_rank=r, world_size=4, alive=True, process=None) for r in alive
    )
    return FindingContext(now=now, config=Config(), ranks=ranks, parts=Tracked(exits=ExitOutput(recent=exits)))


def test_paging_by_cause_and_consequence() -> None:
    segv = order(
        [
            classify(_exit(1, 1000.0, signal.SIGSEGV, 1), None, []),
            classify(_exit(0, 1000.1, signal.SIGTERM, 2), None, []),
        ]
    )

    def kinds(ctx: FindingContext) -> set[tuple[str, str, str]]:
        return {(f.kind, f.severity, f.rank) for f in [*rank_down.find(ctx), *job_crashed.find(ctx)]}

    # torn down: one warning for the job, naming rank 1 and the teardown after it
    ctx = _ctx(1001.0, tuple(segv))
    assert kinds(ctx) == {("job_crashed", "warning", "1")}
    (f,) = job_crashed.find(ctx)
    assert "rank 1 (pid 101, python) failed first, was killed by SIGSEGV" in f.explanation
    assert "the launcher then ended rank 0 (SIGTERM, 0.100 s after)" in f.explanation
    # a peer alive: nothing within the launcher's grace, then a page naming the cause
    alone = tuple(x for x in segv if x.rank == 1)
    assert kinds(_ctx(1005.0, alone, alive=(0,))) == set()
    assert kinds(_ctx(1011.0, alone, alive=(0,))) == {("rank_down", "page", "1")}
    (down,) = rank_down.find(_ctx(1011.0, alone, alive=(0,)))
    assert "was killed by SIGSEGV" in down.explanation and "1 peer(s) on this node still alive" in down.explanation
    # the node's doing pages even when the job was torn down; a stop and exit 0 say nothing
    bus = order([classify(_exit(1, 1000.0, signal.SIGBUS, 1), None, [])])
    assert kinds(_ctx(1001.0, tuple(bus))) == {("rank_down", "page", "1")}
    stop = order(
        [
            classify(_exit(1, 1000.0, signal.SIGTERM, 1), None, []),
            classify(_exit(0, 1000.0, signal.SIGTERM, 2), None, []),
        ]
    )
    assert kinds(_ctx(1020.0, tuple(stop))) == set()
    done = order([classify(_exit(r, 1000.0, 0, r), None, []) for r in (0, 1)])
    assert kinds(_ctx(1020.0, tuple(done))) == set()
    # bounded: 10 minutes after, a crashed job's finding is gone
    assert kinds(_ctx(1000.0 + 601, tuple(segv))) == set()


def test_a_crash_the_launcher_restarted_is_not_paged_as_waiting_peers() -> None:
    """torchrun --max-restarts: rank 1 crashes, the launcher ends rank 0 and starts both again
    within seconds, under the same job id. The new ranks are alive 10 s after the crash but wait
    for nobody: one job_crashed warning, no rank_down page. A peer that was running at the
    death and is still alive 10 s on waits for it: paged, as before."""
    from gpuwatchd.model import ProcessInfo

    def rank(r: int, pid: int, started: float) -> RankState:
        proc = ProcessInfo(pid, 1, "python", "S", 0, "root", 1, started, 0.0, 0, 1, None, None, None)
        return RankState(job_id="j", rank=r, pid=pid, local_rank=r, world_size=2, alive=True, process=proc)

    crash = order(
        [
            classify(_exit(1, 1000.0, signal.SIGSEGV, 1), None, []),
            classify(_exit(0, 1000.1, signal.SIGTERM, 2), None, []),
        ]
    )
    restarted = (rank(0, 200, 1003.0), rank(1, 201, 1003.0))
    ctx = FindingContext(
        now=1015.0, config=Config(), ranks=restarted, parts=Tracked(exits=ExitOutput(recent=tuple(crash)))
    )
    assert {(f.kind, f.severity) for f in [*rank_down.find(ctx), *job_crashed.find(ctx)]} == {
        ("job_crashed", "warning")
    }
    (crashed,) = job_crashed.find(ctx)
    assert "the launcher restarted the job (2 new rank(s) on this node)" in crashed.explanation
    alone = tuple(x for x in crash if x.rank == 1)
    waiting = FindingContext(
        now=1015.0, config=Config(), ranks=(rank(0, 100, 900.0),), parts=Tracked(exits=ExitOutput(recent=alone))
    )
    (f,) = rank_down.find(waiting)
    assert f.severity == "page" and "1 peer(s) on this node still alive" in f.explanation


def test_a_peer_started_within_the_second_before_a_death_is_a_peer() -> None:
    """A rank faults 0.3 s after its peer started (a segfault at import): /proc's start time,
    on the whole-second btime, cannot tell that peer from a restart, so it read the death as the
    job's own crash (job_crashed, a warning) while the peer waited (tests/test_exits.py failed 1
    full run in 3). The exit part's boot clock tells it to the tick: the waiting peer is paged;
    a rank started after the death is still the launcher's restart."""
    from gpuwatchd.model import ProcessInfo

    def rank(r: int, pid: int, ticks: int, started: float) -> RankState:
        proc = ProcessInfo(pid, 1, "python", "S", 0, "root", ticks, started, 0.0, 0, 1, None, None, None)
        return RankState(job_id="j", rank=r, pid=pid, local_rank=r, world_size=2, alive=True, process=proc)

    alone = tuple(order([classify(_exit(1, 1000.0, signal.SIGSEGV, 1), None, [])]))
    peer = rank(0, 100, 99970, 999.7)  # 0.3 s before the death (boot 0, 100 ticks a second)

    def kinds(ranks: tuple[RankState, ...], exits: ExitOutput) -> set[tuple[str, str]]:
        ctx = FindingContext(now=1011.0, config=Config(), ranks=ranks, parts=Tracked(exits=exits))
        return {(f.kind, f.severity) for f in [*rank_down.find(ctx), *job_crashed.find(ctx)]}

    clock = ExitOutput(recent=alone, started=lambda ticks: ticks / 100)  # boot 0, 100 ticks a second
    assert kinds((peer,), clock) == {("rank_down", "page")}
    restart = rank(0, 200, 100300, 1003.0)  # started 3 s after the death
    assert kinds((restart,), clock) == {("job_crashed", "warning")}
    # the exit part off: only btime's start, a peer must have started a second before
    assert kinds((peer,), ExitOutput(recent=alone)) == {("job_crashed", "warning")}


def test_a_rank_seen_gone_before_its_exit_is_joined_waits_for_it() -> None:
    """/proc shows the rank dead a cycle before the exit watcher's record arrives: no "gone, no
    exit read" page within the grace (the H100: the catalog's TERM fault, a stop the launcher
    tore down, paged rank_down 3 s after the death); with its exit, the stop says nothing; with
    no exit read past the grace, it pages as before."""
    dead = RankState(job_id="j", rank=1, pid=101, local_rank=1, world_size=2, alive=False, process=None, died_at=1000.0)
    early = FindingContext(now=1001.0, config=Config(), ranks=(dead,), parts=Tracked(exits=ExitOutput(recent=())))
    assert list(rank_down.find(early)) == []
    stop = order([classify(_exit(1, 1000.0, signal.SIGTERM, 1), None, [])])
    joined = FindingContext(
        now=1003.0, config=Config(), ranks=(dead,), parts=Tracked(exits=ExitOutput(recent=tuple(stop)))
    )
    assert list(rank_down.find(joined)) == []
    late = FindingContext(now=1006.0, config=Config(), ranks=(dead,), parts=Tracked(exits=ExitOutput(recent=())))
    (f,) = rank_down.find(late)
    assert f.severity == "page" and "no exit read" in f.explanation


def test_the_watcher_reads_every_exit_against_a_launcher_that_reaps_at_once() -> None:
    """bench/exit_race.py: a launcher blocked in waitpid reaps each child the moment it ends."""
    import exit_race

    got = exit_race.race(30)
    print(got)
    assert got["wrong"] == 0
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if release >= (6, 15):  # PIDFD_INFO_EXIT answers for what the zombie read lost
        assert got["unknown"] == 0 and got["stat"] + got["pidfd"] == 30


ZOMBIE_LEADER = textwrap.dedent("""
    import ctypes, os, platform, sys, threading, time
    def later():
        sys.stdin.readline()
        os._exit(3)
    threading.Thread(target=later).start()
    print("ready", flush=True)
    # the main thread alone ends: a zombie leader while the other thread runs on
    ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
""")


def test_a_rank_seen_dead_keeps_its_watch_until_its_exit_is_read() -> None:
    """A dying process's main thread is a zombie (state Z, what the cycle's /proc reading shows)
    while its other threads still exit (a CUDA rank's driver teardown), and its pidfd polls
    readable only once they are gone. The cycle, seeing the rank dead, no longer asks to watch
    it: the watch stays until the exit is read (closed then, the exit was lost: two of eight
    torchrun ranks on the H100 had no rank_exit event). A live process that is no longer a rank
    loses its watch at once."""
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.exits import ExitWatcher, Watch

    def start_ticks(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])

    dying = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_LEADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE, text=True
    )
    w = ExitWatcher(HostPaths(), 4)
    w.start()
    try:
        assert dying.stdout is not None and dying.stdout.readline().strip() == "ready"
        keys = {
            (p.pid, start_ticks(p.pid)): Watch(p.pid, start_ticks(p.pid), os.getuid(), "rank") for p in (dying, other)
        }
        w.sync(set(keys), keys)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{dying.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert w.drain() == []  # a zombie leader: not exited yet
        w.sync(set(), {})  # the cycle: one rank dead (Z), the other no longer a rank
        assert w.keys() == {(dying.pid, start_ticks(dying.pid))}
        assert dying.stdin is not None and other.stdin is not None
        dying.stdin.write("end\n")
        dying.stdin.flush()
        got: list = []
        while not got and time.monotonic() < deadline:
            got = w.drain()
            time.sleep(0.02)
        assert [(x.pid, x.status) for x in got] == [(dying.pid, 3 << 8)], got
        assert w.keys() == frozenset()
        other.stdin.write("end\n")
        other.stdin.flush()
    finally:
        w.stop()
        for p in (dying, other):
            p.kill()
            p.wait(10)


WATCH_AS_NOBODY = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.exits import ExitWatcher, Watch
    pid, start = int(sys.argv[2]), int(sys.argv[3])
    w = ExitWatcher(HostPaths(), 4)
    w.start()
    w.sync({(pid, start)}, {(pid, start): Watch(pid, start, 0, "victim")})
    print("watching", flush=True)
    got = []
    deadline = time.monotonic() + 15
    while not got and time.monotonic() < deadline:
        got = w.drain()
        time.sleep(0.05)
    x = got[0]
    print(json.dumps({"privileged": w.privileged, "status": x.status, "unknown": x.unknown,
                      "read_by": x.read_by}), flush=True)
""")


@pytest.mark.parametrize("reap_after", [0.0, 4.0])
def test_another_users_exit_is_read_or_said_unknown_never_exit_0(reap_after: float) -> None:
    """As user nobody (no capability), watching root's process: the kernel shows field 52 as 0,
    so the zombie is not read; once its parent reaps it the pidfd gives the status (Linux >=
    6.15), and a parent that does not reap within 2 s leaves "not readable", never exit 0."""
    victim = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(7)"], stdin=subprocess.PIPE, text=True
    )
    start = Path(f"/proc/{victim.pid}/stat").read_text().rpartition(")")[2].split()[19]
    watcher = subprocess.Popen(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            WATCH_AS_NOBODY,
            str(REPO),
            str(victim.pid),
            start,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watcher.stdout is not None and watcher.stdout.readline().strip() == "watching"
    assert victim.stdin is not None
    victim.stdin.write("end\n")
    victim.stdin.flush()
    time.sleep(reap_after)
    assert victim.wait(10) == 7
    got = json.loads(watcher.stdout.readline())
    watcher.wait(10)
    assert got["privileged"] is False and got["status"] != 0
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if reap_after == 0.0 and release >= (6, 15):
        assert (got["status"], got["read_by"]) == (7 << 8, "pidfd")
    else:
        assert got["status"] is None and "not readable" in got["unknown"], got
