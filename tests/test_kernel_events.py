"""kernel_events.py: grouping, attribution, exactly-once counting; real OOM kills in a memory
cgroup read from the real /dev/kmsg, and real journal files written by systemd-journal-remote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oom_helpers import RANK_WITH_WORKER_CODE, MemCgroup, go

from gpuwatchd.counters import CounterStore
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import JsonlSink, read_events
from gpuwatchd.join.kernel_events import KernelEventProcessor
from gpuwatchd.join.rank_trees import RankTreeRecord, TreeMember
from gpuwatchd.model import RankState
from gpuwatchd.model.kernel import KILLER_OOMD, LogRecord
from gpuwatchd.model.parts import KernelOutput, Tracked
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.journal import JournalSource
from gpuwatchd.sources.kernel_lines import parse_kmsg, parse_message
from gpuwatchd.sources.kmsg import KmsgSource, read_boot_id
from gpuwatchd.sources.procfs import ProcfsReader

FIX = Path(__file__).parent / "fixtures" / "kernel"
FORMATS = json.loads((FIX / "research_formats.json").read_text())
BOOT = read_boot_id(HostPaths())
COMM = Path(sys.executable).name[:15]  # the children's comm: the exec'd file name
JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"


def proc(tmp: Path, counters: CounterStore | None = None, **kw: Any) -> KernelEventProcessor:
    c = counters or CounterStore()
    return KernelEventProcessor(
        c, str(tmp), parse=parse_message, bus=EventBus([JsonlSink(str(tmp))]), boot_id=BOOT, **kw
    )


def rec(msg: str, t: float, ident: str = "kernel", usec: int | None = None) -> LogRecord:
    return LogRecord(msg, ident, BOOT, usec if usec is not None else int(t * 1e6) % 10**9, t, "test")


def oom_series(c: CounterStore) -> dict[tuple[str, ...], float]:
    return dict(c.snapshot()["oom_kills"])


# --- pure pipeline on the research formats ---------------------------------------------------


def test_every_research_kill_format_is_one_event(tmp_path: Path) -> None:
    p = proc(tmp_path)
    t = 1_800_000_000.0
    for g in FORMATS["kills"]:
        events = []
        for i, line in enumerate(g["lines"]):
            events += p.handle(rec(line, t + i * 0.001, g["identifier"]))
        assert len(events) == g.get("kills", 1), g["era"]
        ev, want = events[-1], g["expect"]
        assert (ev.pid, ev.comm, ev.killer) == (want["pid"], want["comm"], want["killer"]), g["era"]
        assert ev.fields["rss_bytes"] == want["rss_bytes"], g["era"]
        assert ev.fields["memcg"] == want["memcg"], g["era"]
        assert ev.job_id == "" and ev.rank == "" and not ev.alert  # nobody's rank
        t += 100
    series = oom_series(p.counters)
    assert series[("", "", "python3", "kernel")] == 4  # 9001, 9101, 9201, 9202
    assert series[("", "", "pt_main_thread", "earlyoom")] == 1  # SIGTERM + SIGKILL = one kill
    assert sum(series.values()) == 10


def test_summary_without_kill_line_is_flushed_once(tmp_path: Path) -> None:
    p = proc(tmp_path, group_timeout=2.0)
    s = FORMATS["kills"][4]["lines"][1]  # oom-kill: summary of pid 9001, kill line lost
    assert p.handle(rec(s, 1000.0)) == []
    assert p.oldest_pending_seq() is None  # no seq in this record
    assert p.tick(1001.0) == []
    (ev,) = p.tick(1002.5)
    assert ev.pid == 9001 and ev.fields["detail"] == "kill line missing"
    late = FORMATS["kills"][4]["lines"][2]
    assert p.handle(rec(late, 1003.0)) == []  # the late kill line of the same kill: not again
    assert sum(oom_series(p.counters).values()) == 1


def test_xid_events_and_counter(tmp_path: Path) -> None:
    p = proc(tmp_path)
    assert p.handle(rec(FORMATS["gpu_at"], 10.0)) == []
    (ev,) = p.handle(rec(FORMATS["xids"][0]["line"], 11.0))
    assert ev.kind == "xid" and ev.alert and ev.severity == "page"
    assert ev.fields["uuid"].startswith("GPU-8a3e5c1f")
    (ev13,) = p.handle(rec(FORMATS["xids"][1]["line"], 12.0))
    assert not ev13.alert  # app fault: counted, no page
    xids = p.counters.snapshot()["gpu_xid_errors"]
    assert xids[("", "GPU-8a3e5c1f-2b4d-4e6f-9a1b-3c5d7e9f1a2b", "79")] == 1
    assert xids[("", "GPU-8a3e5c1f-2b4d-4e6f-9a1b-3c5d7e9f1a2b", "13")] == 1
    assert p.handle(rec(FORMATS["xids"][0]["line"], 11.0)) == []  # same record again: once


def test_xid_dedup_with_nvml(tmp_path: Path) -> None:
    from gpuwatchd.join.xid_dedup import XidDeduper

    d = XidDeduper()
    d.learn_device("00000000:3B:00.0", "GPU-abc", 2)
    assert d.record("0000:3b:00", 79, 100.0, "nvml")  # the NVML watcher counted it first
    p = proc(tmp_path, xid_dedup=d)
    (ev,) = p.handle(rec(FORMATS["xids"][0]["line"], 100.5))
    assert ev.counter == "" and ev.fields["gpu"] == "2"  # stored, not counted twice
    (ev2,) = p.handle(rec(FORMATS["xids"][6]["line"].replace("ba:00", "3b:00"), 101.0))
    assert ev2.counter == "gpu_xid_errors" and ev2.labels == ("2", "GPU-abc", "119")


def member(pid: int, start: float | None, rank: int = 0, worker: bool = False, **kw: Any) -> TreeMember:
    d: dict[str, Any] = dict(
        pid=pid,
        start_time=start,
        job_id="llm-7",
        rank=rank,
        rank_pid=pid,
        worker=worker,
        comm="python3",
        last_seen=1000.0,
    )
    d.update(kw)
    return TreeMember(**d)


def test_attribution_and_pid_reuse_guard(tmp_path: Path) -> None:
    r = RankTreeRecord(str(tmp_path / "rt.json"), ttl_seconds=600)
    r.update([member(4321, 900.0, rank=3)], 1000.0)
    assert r.lookup(4321, 1001.0) is not None
    assert r.lookup(4321, 850.0) is None  # the kill happened before the process started
    r.update([member(4321, 1008.0, rank=5, last_seen=1010.0)], 1010.0)  # PID reused
    got = r.lookup(4321, 1003.0)
    assert got is not None and got.rank == 3  # kill before the new process started: the old one
    newer = r.lookup(4321, 1011.0)
    assert newer is not None and newer.rank == 5
    assert r.lookup(4321, 1605.0) is not None  # rank 5 seen at 1010, ttl 600
    assert r.lookup(4321, 1010.0 + 700) is None  # not seen for longer than ttl
    # persisted: a restarted daemon still knows
    assert RankTreeRecord(str(tmp_path / "rt.json")).lookup(4321, 1003.0) is not None
    (tmp_path / "bad.json").write_bytes(b"\x00garbage")
    assert RankTreeRecord(str(tmp_path / "bad.json")).lookup(1, 1.0) is None


def test_oomd_kill_maps_cgroup_to_ranks(tmp_path: Path) -> None:
    p = proc(tmp_path)
    p.record.update(
        [
            member(10, 1.0, rank=0, cgroup="/system.slice/train.service"),
            member(11, 1.0, rank=1, cgroup="/system.slice/train.service/sub"),
            member(12, 1.0, rank=2, cgroup="/system.slice/other.service"),
        ],
        1000.0,
    )
    evs = p.handle(rec(FORMATS["oomd"][1], 1001.0, KILLER_OOMD))
    assert sorted((e.rank, e.killer) for e in evs) == [("0", "systemd-oomd"), ("1", "systemd-oomd")]
    (other,) = p.handle(rec(FORMATS["oomd"][0], 1002.0, KILLER_OOMD))
    assert other.job_id == "" and other.labels == ("", "", "", "systemd-oomd")


def test_cross_check_turns_unexplained_kills_into_unattributed(tmp_path: Path) -> None:
    p = proc(tmp_path, unexplained_grace=10.0)
    kill = FORMATS["kills"][4]["lines"]
    for i, line in enumerate(kill):
        p.handle(rec(line, 100.0 + i * 0.001))
    assert p.cross_check(1, 100.0) == []  # explained
    assert p.cross_check(3, 101.0) == []  # 2 missing: wait, the lines may be on their way
    assert p.cross_check(3, 105.0) == []
    (ev,) = p.cross_check(3, 111.5)
    assert ev.count == 2 and ev.labels == ("", "", "", "kernel")
    assert p.cross_check(3, 200.0) == []  # accounted for
    assert oom_series(p.counters)[("", "", "", "kernel")] == 2
    # after a restart, the tally of this boot is rebuilt: still nothing new
    p2 = proc(tmp_path, unexplained_grace=0.0)
    assert p2.cross_check(3, 300.0) == []
    assert p2.cross_check(None, 300.0) == []


def test_restart_rebuilds_counters_from_the_event_log(tmp_path: Path) -> None:
    p = proc(tmp_path)
    p.record.update([member(9001, 1.0, rank=4)], 1000.0)
    for i, line in enumerate(FORMATS["kills"][4]["lines"]):
        p.handle(rec(line, 1000.5 + i * 0.001, usec=5_000_000 + i))
    assert oom_series(p.counters)[("llm-7", "4", "python3", "kernel")] == 1
    with open(tmp_path / "events.jsonl", "ab") as f:  # a torn line from a crash mid-append
        f.write(b'{"key": "torn')
    p2 = proc(tmp_path)
    assert oom_series(p2.counters)[("llm-7", "4", "python3", "kernel")] == 1
    for i, line in enumerate(FORMATS["kills"][4]["lines"]):  # re-read after a crash: same key
        p2.handle(rec(line, 1000.5 + i * 0.001, usec=5_000_000 + i))
    assert oom_series(p2.counters)[("llm-7", "4", "python3", "kernel")] == 1
    assert len(list(read_events(str(tmp_path / "events.jsonl")))) == 1


def test_event_log_compaction_keeps_counters_exact(tmp_path: Path) -> None:
    p = proc(tmp_path)
    t = 2000.0
    for i in range(60):  # 60 kills of 3 ranks' pids, 20 Xids
        p.record.update([member(100 + i % 3, 1.0, rank=i % 3, last_seen=t)], t)
        line = (
            f"Memory cgroup out of memory: Killed process {100 + i % 3} (python3) total-vm:1kB, "
            "anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0"
        )
        p.handle(rec(line, t, usec=10**8 + i))
        if i % 3 == 0:
            p.handle(rec(FORMATS["xids"][0]["line"], t, usec=10**8 + i))
        t += 60  # past the duplicate window of one PID
    before = p.counters.snapshot()
    size = (tmp_path / "events.jsonl").stat().st_size
    p2 = proc(tmp_path, max_log_bytes=size // 2, keep_events=10)  # compacts on start
    assert p2.counters.snapshot() == before
    assert (tmp_path / "events.jsonl").stat().st_size < size // 2
    stored = list(read_events(str(tmp_path / "events.jsonl")))
    assert stored[0].kind == "counter_base" and len(stored) == 11
    p3 = proc(tmp_path)  # and again after the compaction
    assert p3.counters.snapshot() == before
    assert p3.cross_check(60, t) == [] and p3.cross_check(60, t + 100) == []  # boot tally kept
    from gpuwatchd.cli.events import load

    assert all(e.kind != "counter_base" for e in load(str(tmp_path), 0.0))


def test_observe_creates_series_at_zero_and_counts_peers(tmp_path: Path) -> None:
    p = proc(tmp_path)
    info = ProcfsReader(HostPaths()).read_process(os.getpid())
    assert info is not None
    ranks = [
        RankState(
            "llm-7",
            r,
            os.getpid() if r == 0 else 999_999,
            0,
            4,
            r < 3,
            info if r < 3 else None,
            (os.getpid(),) if r == 0 else (),
        )
        for r in range(4)
    ]
    p.observe(ranks, {os.getpid(): info}, time.time())
    assert oom_series(p.counters)[("llm-7", "0", info.comm, "kernel")] == 0
    kill = (
        f"Memory cgroup out of memory: Killed process {os.getpid()} ({info.comm}) total-vm:1kB, "
        "anon-rss:1048576kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0"
    )
    (ev,) = p.handle(rec(kill, time.time()))
    assert ev.job_id == "llm-7" and ev.rank == "0" and ev.severity == "page" and ev.alert
    assert ev.fields["peers_alive"] == 2
    assert "2 peers alive: they will wait in their next collective" in ev.summary
    assert "holding 1.0 GiB RSS" in ev.summary


LINES = [line for g in FORMATS["kills"] for line in g["lines"]] + [x["line"] for x in FORMATS["xids"]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(LINES),
            st.integers(0, 80),
            st.text(max_size=30),
            st.sampled_from(["kernel", "earlyoom", "systemd-oomd"]),
        ),
        max_size=12,
    )
)
def test_fuzz_mangled_records_never_break_the_processor(tmp_path_factory: Any, cases: list[Any]) -> None:
    p = proc(tmp_path_factory.mktemp("fuzz"))
    t = 1000.0
    for line, cut, junk, ident in cases:
        mangled = line[:cut] + junk + line[cut:] if cut % 2 else line[: len(line) - cut] + junk
        t += 0.001
        for e in p.handle(rec(mangled, t, ident)):
            assert e.counter in ("oom_kills", "gpu_xid_errors", "")
    p.tick(t + 10)
    p.cross_check(10**6, t + 20)
    p.cross_check(10**6, t + 40)


# --- real OOM kills: memory cgroup + /dev/kmsg ---------------------------------------------------


class Pipeline:
    """What the daemon runs, minus the daemon: KmsgSource thread -> processor -> counters."""

    def __init__(self, state_dir: Path, source: str = "kmsg", journal: Path | None = None) -> None:
        self.counters = CounterStore()
        self.processor = KernelEventProcessor(
            self.counters, str(state_dir), parse=parse_message, bus=EventBus([JsonlSink(str(state_dir))]), boot_id=BOOT
        )
        self.source: Any
        if source == "kmsg":
            self.source = KmsgSource(str(state_dir))
        else:
            self.source = JournalSource(str(state_dir), path=str(journal))
        self.source.hold_cursor(self.processor.oldest_pending_seq)
        self.thread = threading.Thread(target=self.source.run, args=(self.processor.handle,), daemon=True)
        self.thread.start()
        assert self.source.ready.wait(15)

    def observe_pids(self, job_id: str, rank: int, rank_pid: int, tree: Iterable[int]) -> None:
        reader = ProcfsReader(HostPaths())
        procs = {pid: i for pid in tree if (i := reader.read_process(pid)) is not None}
        rs = RankState(job_id, rank, rank_pid, rank, 2, True, procs[rank_pid], tuple(procs))
        peer = RankState(
            job_id, rank + 1, os.getpid(), rank + 1, 2, True, reader.read_process(os.getpid()), (os.getpid(),)
        )
        self.processor.observe([rs, peer], procs, time.time())

    def stop(self) -> None:
        self.source.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def kills_for(c: CounterStore, job_id: str) -> dict[tuple[str, ...], float]:
    return {k: v for k, v in oom_series(c).items() if k[0] == job_id}


@pytest.fixture
def cgroup() -> Iterable[MemCgroup]:
    cg = MemCgroup("evt")
    try:
        yield cg
    finally:
        cg.remove()


def test_real_rank_oom_kill_counted_once(tmp_path: Path, cgroup: MemCgroup) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    pl = Pipeline(tmp_path)
    try:
        child = cgroup.spawn()
        pl.observe_pids(job, 3, child.pid, [child.pid])
        assert kills_for(pl.counters, job)[(job, "3", COMM, "kernel")] == 0.0
        t_kill = time.monotonic()
        go(child)
        assert child.wait(20) == -9
        assert wait_until(lambda: kills_for(pl.counters, job).get((job, "3", COMM, "kernel")) == 1)
        latency = time.monotonic() - t_kill
        assert latency < 5.0
        time.sleep(0.3)  # nothing more arrives for this kill (reaper line etc.)
        assert {k: v for k, v in kills_for(pl.counters, job).items() if v} == {(job, "3", COMM, "kernel"): 1.0}
        assert cgroup.oom_kills() == 1
        (ev,) = [e for e in pl.processor.recent() if e.job_id == job]
        assert ev.pid == child.pid and not ev.worker
        assert ev.fields["memcg"] == cgroup.kernel_path
        assert ev.fields["rss_bytes"] > 32 << 20
        assert "1 peers alive" in ev.summary
    finally:
        pl.stop()


def test_real_worker_of_a_rank_is_attributed_as_worker(tmp_path: Path, cgroup: MemCgroup) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    pl = Pipeline(tmp_path)
    try:
        rank = cgroup.spawn(RANK_WITH_WORKER_CODE)
        assert rank.stdout is not None
        worker_pid = int(rank.stdout.readline())
        pl.observe_pids(job, 0, rank.pid, [rank.pid, worker_pid])
        go(rank)
        assert int(rank.stdout.readline()) == -9  # the worker was OOM-killed, the rank lives
        assert rank.poll() is None
        assert wait_until(lambda: sum(kills_for(pl.counters, job).values()) == 1)
        (ev,) = [e for e in pl.processor.recent() if e.job_id == job]
        assert ev.pid == worker_pid and ev.worker and ev.rank == "0"
        assert ev.fields["rank_pid"] == rank.pid
        assert "worker pid" in ev.summary
    finally:
        pl.stop()


def test_real_kill_while_daemon_down_counted_once_across_restarts(tmp_path: Path, cgroup: MemCgroup) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    pl = Pipeline(tmp_path)
    child = cgroup.spawn()
    pl.observe_pids(job, 1, child.pid, [child.pid])
    pl.stop()  # daemon stopped
    go(child)
    assert child.wait(20) == -9  # killed while nobody reads the log
    pl2 = Pipeline(tmp_path)  # started: resumes after the persisted kmsg seq
    try:
        assert wait_until(lambda: kills_for(pl2.counters, job) == {(job, "1", COMM, "kernel"): 1.0})
    finally:
        pl2.stop()
    pl3 = Pipeline(tmp_path)  # second restart: rebuilt from the event log, not counted again
    try:
        time.sleep(0.3)
        assert kills_for(pl3.counters, job) == {(job, "1", COMM, "kernel"): 1.0}
    finally:
        pl3.stop()
    stored = [e for e in read_events(str(tmp_path / "events.jsonl")) if e.job_id == job]
    assert len(stored) == 1


# --- real journal files (systemd-journal-remote) -------------------------------------------------


def export_entry(message: str, mono_usec: int, realtime: float, ident: str = "kernel", prio: int = 6) -> bytes:
    f = [
        f"__REALTIME_TIMESTAMP={int(realtime * 1e6)}",
        f"__MONOTONIC_TIMESTAMP={mono_usec}",
        f"_BOOT_ID={BOOT.replace('-', '')}",
        f"PRIORITY={prio}",
        f"SYSLOG_IDENTIFIER={ident}",
    ]
    if ident == "kernel":  # what journald's kmsg reader stores (journald-kmsg.c)
        f += ["_TRANSPORT=kernel", "SYSLOG_FACILITY=0", f"_SOURCE_MONOTONIC_TIMESTAMP={mono_usec}"]
    else:
        f += ["_TRANSPORT=stdout", f"_COMM={ident}", "_UID=0"]
    data = "\n".join(f).encode() + b"\n"
    data += b"MESSAGE\n" + len(message.encode()).to_bytes(8, "little") + message.encode() + b"\n"
    return data + b"\n"


def write_journal(path: Path, entries: bytes) -> None:
    r = subprocess.run([JOURNAL_REMOTE, f"--output={path}", "-"], input=entries, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr.decode()


def research_entries(base_usec: int, t0: float) -> bytes:
    out = b""
    n = 0
    for g in FORMATS["kills"]:
        for line in g["lines"]:
            out += export_entry(line, base_usec + n, t0 + n / 1000, g["identifier"])
            n += 1
    for line in FORMATS["oomd"]:
        out += export_entry(line, base_usec + n, t0 + n / 1000, "systemd-oomd")
        n += 1
    for x in [FORMATS["gpu_at"]] + [x["line"] for x in FORMATS["xids"]]:
        out += export_entry(x, base_usec + n, t0 + n / 1000)
        n += 1
    # noise the source must pass over: other programs, a fake "kernel" line from a user service
    out += export_entry("Killed process 1 (init) total-vm:1kB, anon-rss:1kB, file-rss:1kB", base_usec + n, t0, "bash")
    return out


def test_journal_all_formats_read_once_and_while_appended(tmp_path: Path) -> None:
    jdir = tmp_path / "journal"
    jdir.mkdir()
    state = tmp_path / "state"
    t0 = time.time() - 60
    recorded = [parse_kmsg(line) for line in (FIX / "memcg_v1_kill_6.18.kmsg").read_bytes().splitlines()]
    entries = b"".join(
        export_entry(r.message, r.usec, t0 + i / 1e4, prio=r.priority & 7)
        for i, r in enumerate(recorded)
        if r is not None
    )
    write_journal(jdir / "remote.journal", entries + research_entries(10**9, t0 + 1))
    pl = Pipeline(state, source="journal", journal=jdir)
    try:
        assert wait_until(lambda: sum(oom_series(pl.counters).values()) == 11 + 2)
        series = oom_series(pl.counters)
        assert series[("", "", "python3", "kernel")] == 5  # recorded 6.18 kill + 4 research
        assert series[("", "", "", "systemd-oomd")] == 2
        assert sum(v for v in pl.counters.snapshot()["gpu_xid_errors"].values()) == 7
        # appended while the source sleeps in poll(): picked up by inotify
        kill = FORMATS["kills"][4]["lines"]
        write_journal(
            jdir / "remote.journal",
            b"".join(
                export_entry(line.replace("9001", "9999"), 2 * 10**9 + i, time.time()) for i, line in enumerate(kill)
            ),
        )
        assert wait_until(lambda: sum(oom_series(pl.counters).values()) == 14, 10)
    finally:
        pl.stop()
    # restart: the cursor resumes after the last entry; the counters come back from the log
    pl2 = Pipeline(state, source="journal", journal=jdir)
    try:
        time.sleep(0.3)
        assert sum(oom_series(pl2.counters).values()) == 14
        assert pl2.source.stats.records == 0
    finally:
        pl2.stop()


def test_journal_real_kill_while_daemon_down_counted_once(tmp_path: Path, cgroup: MemCgroup) -> None:
    """journald's kmsg reader, reproduced: the real kill's /dev/kmsg records are written into a
    journal file as _TRANSPORT=kernel entries while the daemon is down."""
    job = f"job-{uuid.uuid4().hex[:6]}"
    jdir = tmp_path / "journal"
    jdir.mkdir()
    state = tmp_path / "state"
    write_journal(jdir / "k.journal", export_entry("boot", 1, time.time()))
    pl = Pipeline(state, source="journal", journal=jdir)
    child = cgroup.spawn()
    pl.observe_pids(job, 2, child.pid, [child.pid])
    pl.stop()
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    os.lseek(fd, 0, os.SEEK_END)
    go(child)
    assert child.wait(20) == -9
    records = []
    while True:
        try:
            raw = os.read(fd, 16384)
        except BlockingIOError:
            break
        r = parse_kmsg(raw)
        if r is not None and r.facility == 0:
            records.append(r)
    os.close(fd)
    assert any(f"Killed process {child.pid} " in r.message for r in records)
    mono_now, wall_now = time.monotonic(), time.time()
    write_journal(
        jdir / "k.journal",
        b"".join(
            export_entry(r.message, r.usec, wall_now - mono_now + r.usec / 1e6, prio=r.priority & 7) for r in records
        ),
    )
    pl2 = Pipeline(state, source="journal", journal=jdir)
    try:
        assert wait_until(lambda: kills_for(pl2.counters, job) == {(job, "2", COMM, "kernel"): 1.0})
    finally:
        pl2.stop()
    pl3 = Pipeline(state, source="journal", journal=jdir)
    try:
        time.sleep(0.3)
        assert kills_for(pl3.counters, job) == {(job, "2", COMM, "kernel"): 1.0}
    finally:
        pl3.stop()


# --- through the real daemon process and a real /metrics scrape ----------------------------------


def register_rank(cfg: dict[str, Any], job: str, rank: int, pid: int) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--rank-dir",
            cfg["rank_dir"],
            "--job-id",
            job,
            "--rank",
            str(rank),
            "--pid",
            str(pid),
            "--world-size",
            "8",
        ],
        check=True,
        capture_output=True,
        cwd=Path(__file__).resolve().parent.parent,
    )


def oom_value(d: Any, job: str, rank: str) -> float | None:
    return d.value("gpuwatch_oom_kills_total", job_id=job, rank=rank)  # type: ignore[no-any-return]


def test_daemon_counts_a_real_rank_oom_kill_once_within_1s(tmp_path: Path, cgroup: MemCgroup) -> None:
    from daemonutil import DaemonProc, has_finding, write_config

    path, cfg = write_config(tmp_path, kernel_log="kmsg")
    job = f"job-{uuid.uuid4().hex[:6]}"
    d = DaemonProc(path, cfg)
    try:
        rank = cgroup.spawn()
        peer = cgroup.spawn()  # rank 1 of the same job, stays alive (never told to allocate)
        register_rank(cfg, job, 0, rank.pid)
        register_rank(cfg, job, 1, peer.pid)
        d.wait_for(lambda: oom_value(d, job, "0") == 0.0, what="the rank's series at 0")
        go(rank)
        assert rank.wait(20) == -9
        t_dead = time.monotonic()
        while oom_value(d, job, "0") != 1.0:
            assert time.monotonic() - t_dead < 5, d.text()
            time.sleep(0.01)
        assert time.monotonic() - t_dead <= 1.0  # kill -> /metrics within 1 s
        assert d.value("gpuwatch_oom_kills_total", job_id=job, rank="0", comm=COMM, killer="kernel") == 1.0
        d.wait_for(lambda: has_finding(d, "rank_oom_killed", job_id=job, rank="0"), what="finding")
        time.sleep(1.5)  # several cycles later: still exactly once
        assert oom_value(d, job, "0") == 1.0 and oom_value(d, job, "1") == 0.0
        state = json.loads((Path(cfg["state_dir"]) / "state.json").read_text())
        (f,) = [f for f in state["findings"] if f["kind"] == "rank_oom_killed" and f["job_id"] == job]
        assert f["severity"] == "page"
        assert "1 peers alive: they will wait in their next collective" in f["explanation"]
        assert f"in memory cgroup {cgroup.kernel_path}" in f["explanation"] and "RSS" in f["explanation"]
    finally:
        d.stop()


def test_daemon_attributes_a_killed_worker_to_its_rank(tmp_path: Path, cgroup: MemCgroup) -> None:
    from daemonutil import DaemonProc, write_config

    path, cfg = write_config(tmp_path, kernel_log="kmsg")
    job = f"job-{uuid.uuid4().hex[:6]}"
    d = DaemonProc(path, cfg)
    try:
        rank = cgroup.spawn(RANK_WITH_WORKER_CODE)
        assert rank.stdout is not None
        worker = int(rank.stdout.readline())
        register_rank(cfg, job, 5, rank.pid)
        # the worker must have been seen in the rank's tree by a cycle before it dies
        tree_file = Path(cfg["state_dir"]) / "rank_trees.json"
        d.wait_for(
            lambda: tree_file.exists() and f'"pid": {worker},' in tree_file.read_text(),
            what="the worker in the rank tree record",
        )
        go(rank)
        assert int(rank.stdout.readline()) == -9
        d.wait_for(lambda: (oom_value(d, job, "5") or 0) >= 1.0, what="worker kill counted", timeout=5)
        assert d.value("gpuwatch_oom_kills_total", job_id=job, rank="5", killer="kernel") == 1.0
        events = [json.loads(x) for x in (Path(cfg["state_dir"]) / "events.jsonl").read_text().splitlines()]
        (e,) = [e for e in events if e["job_id"] == job]
        assert e["worker"] and e["pid"] == worker and e["fields"]["rank_pid"] == rank.pid
    finally:
        d.stop()


def test_daemon_restart_counts_a_kill_while_down_once(tmp_path: Path, cgroup: MemCgroup) -> None:
    from daemonutil import DaemonProc, write_config

    path, cfg = write_config(tmp_path, kernel_log="kmsg")
    job = f"job-{uuid.uuid4().hex[:6]}"
    d = DaemonProc(path, cfg)
    rank = cgroup.spawn()
    register_rank(cfg, job, 7, rank.pid)
    try:
        d.wait_for(lambda: oom_value(d, job, "7") == 0.0, what="the rank's series at 0")
    finally:
        assert d.stop() == 0
    go(rank)
    assert rank.wait(20) == -9  # killed while the daemon is down
    d2 = DaemonProc(path, cfg)
    try:
        d2.wait_for(lambda: oom_value(d2, job, "7") == 1.0, what="the kill counted after restart", timeout=5)
    finally:
        d2.stop()
    d3 = DaemonProc(path, cfg)
    try:
        time.sleep(1.5)
        assert oom_value(d3, job, "7") == 1.0  # second restart: not again
    finally:
        d3.stop()


def test_daemon_ignores_a_spoofed_kill_and_reports_it(tmp_path: Path) -> None:
    from daemonutil import DaemonProc, write_config

    path, cfg = write_config(tmp_path, kernel_log="kmsg")
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: d.value("gpuwatch_collector_success", collector="kernel_log") == 1.0, what="kernel_log collector up"
        )
        before = d.value("gpuwatch_kernel_log_lines_rejected_total", reason="not_kernel") or 0.0
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:  # a userspace write claiming to be a kernel OOM kill of PID 1
            os.write(
                fd,
                b"<3>Out of memory: Killed process 1 (systemd) total-vm:1kB, anon-rss:1kB, "
                b"file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0\n",
            )
        finally:
            os.close(fd)
        d.wait_for(
            lambda: (d.value("gpuwatch_kernel_log_lines_rejected_total", reason="not_kernel") or 0.0) > before,
            what="the spoof rejected",
            timeout=5,
        )
        assert d.value("gpuwatch_oom_kills_total", comm="systemd") is None
        assert d.proc.poll() is None
    finally:
        d.stop()


# --- findings ---------------------------------------------------------------------------------------


def test_findings_rank_oom_killed_and_xid_critical(tmp_path: Path) -> None:
    from gpuwatchd.config.schema import Config
    from gpuwatchd.findings import FindingContext, rank_oom_killed, xid_critical

    p = proc(tmp_path)
    now = time.time()
    p.record.update(
        [
            member(4321, now - 100, rank=3, last_seen=now),
            member(4400, now - 50, rank=3, worker=True, rank_pid=4321, comm="pt_data_worker", last_seen=now),
        ],
        now,
    )
    kill = FORMATS["kills"][3]["lines"]  # global OOM of pid 8001 ...
    lines = [x.replace("8001", "4321").replace("pt_main_thread", "python3") for x in kill]
    for i, line in enumerate(lines):
        p.handle(rec(line, now + i * 0.001))
    p.handle(rec(FORMATS["xids"][0]["line"], now + 1))
    p.handle(rec(FORMATS["xids"][1]["line"], now + 2))  # Xid 13: no finding
    events = tuple(p.recent())
    alive = [RankState("llm-7", r, 5000 + r, r, 16, True, None, ()) for r in range(4, 19)]
    dead = RankState("llm-7", 3, 4321, 3, 16, False, None, ())
    ctx = FindingContext(
        now=now + 5, config=Config(), ranks=(dead, *alive), parts=Tracked(kernel=KernelOutput(events=events))
    )
    (f,) = list(rank_oom_killed.find(ctx))
    assert (f.kind, f.severity, f.job_id, f.rank, f.pid) == ("rank_oom_killed", "page", "llm-7", "3", "4321")
    assert "was killed by the kernel OOM killer at" in f.explanation
    assert "holding 80.3 GiB RSS" in f.explanation
    assert "in memory cgroup /user.slice/user-1000.slice/session-3.scope" in f.explanation
    assert f.explanation.endswith("15 peers alive: they will wait in their next collective")
    # 20 minutes later the rank is still registered and dead: still a finding; once it is gone, not
    later = FindingContext(
        now=now + 1200, config=Config(), ranks=(dead,), parts=Tracked(kernel=KernelOutput(events=events))
    )
    assert len(list(rank_oom_killed.find(later))) == 1
    gone = FindingContext(now=now + 1200, config=Config(), ranks=(), parts=Tracked(kernel=KernelOutput(events=events)))
    assert list(rank_oom_killed.find(gone)) == []
    (x,) = list(xid_critical.find(ctx))
    assert (x.kind, x.severity, x.evidence["xid"]) == ("xid_critical", "page", 79)
    assert "Xid 79" in x.explanation and "GPU has fallen off the bus" in x.explanation
    assert (
        list(
            xid_critical.find(
                FindingContext(now=now + 700, config=Config(), parts=Tracked(kernel=KernelOutput(events=events)))
            )
        )
        == []
    )
