"""What the cycle reads of a torch-shaped rank, on real processes (issue 14: daemon CPU).

A rank here is a real Python process with threads that fork real children; the only fake is the
NVIDIA device nodes (regular files in a temporary devfs, opened with the driver's flags, as in
tests/test_fork.py). The assertions are about *what is read* (counted by the readers), never time.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.daemon.fork_evidence import fork_evidence
from gpuwatchd.model import RankEntry
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.devfds import EvidenceReader
from gpuwatchd.sources.procfs import ProcfsReader

# Commands on stdin, one per line; each answers one line on stdout.
RANK = textwrap.dedent(
    """
    import os, sys, threading, time
    dev = sys.argv[1]
    me = os.getpid()
    def child():
        while os.getppid() == me:
            time.sleep(0.1)
        os._exit(0)
    def fork():
        pid = os.fork()
        if pid == 0:
            child()
        return pid
    jobs, answers = [], []
    def forker():  # a long-lived thread that forks now and then (a pool's feeder)
        while True:
            job = jobs_ready.wait() and jobs.pop()
            jobs_ready.clear()
            answers.append(fork())
            done.set()
    jobs_ready, done = threading.Event(), threading.Event()
    threading.Thread(target=forker, daemon=True).start()
    idle = threading.Event()
    for _ in range(30):  # a torch rank has dozens of threads that never fork
        threading.Thread(target=idle.wait, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "thread-fork":
            done.clear(); jobs.append(1); jobs_ready.set(); done.wait()
            print(answers.pop(), flush=True)
        elif cmd == "fork":
            print(fork(), flush=True)
        elif cmd == "cuda":  # what a CUDA context keeps open (O_RDWR|O_CLOEXEC)
            fds = [os.open(os.path.join(dev, n), os.O_RDWR | os.O_CLOEXEC)
                   for n in ("nvidiactl", "nvidia-uvm", "nvidia0")]
            print(fds[0], flush=True)
        elif cmd == "open":
            print(os.open("/dev/null", os.O_RDONLY), flush=True)
    """
)


class Rank:
    def __init__(self, tmp_path: Path, procs: list[subprocess.Popen[Any]]) -> None:
        self.dev = tmp_path / "dev"
        self.dev.mkdir(exist_ok=True)
        for name in ("nvidiactl", "nvidia-uvm", "nvidia0"):
            (self.dev / name).write_bytes(b"")
        self.p = subprocess.Popen(
            [sys.executable, "-c", RANK, str(self.dev)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(self.p)
        assert self.ask(None) == "ready"
        self.pid = self.p.pid

    def ask(self, cmd: str | None) -> str:
        assert self.p.stdin is not None and self.p.stdout is not None
        if cmd is not None:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        return self.p.stdout.readline().strip()


@pytest.fixture
def rank(tmp_path: Path, procs: list[subprocess.Popen[Any]]) -> Rank:
    return Rank(tmp_path, procs)


def test_a_forking_threads_next_child_is_seen_without_rescanning_every_thread(rank: Rank) -> None:
    procfs = ProcfsReader()
    first = int(rank.ask("thread-fork"))  # listed only in the forking thread's children file
    assert first in procfs.children(rank.pid)  # the first look scans every thread
    assert procfs.thread_scans == 1
    main_child = int(rank.ask("fork"))
    second = int(rank.ask("thread-fork"))
    kids = procfs.children(rank.pid)
    # seen at once (before, the thread's file was read again only after THREAD_CHILDREN_TTL)
    assert {first, second, main_child} <= set(kids) and len(kids) == len(set(kids))
    assert procfs.thread_scans == 1  # ...without reading the other 30-odd threads' files again
    assert set(procfs.descendants(rank.pid)) >= {first, second, main_child}


def test_fork_evidence_is_rescanned_only_when_the_fds_change(rank: Rank) -> None:
    paths = HostPaths(devfs=str(rank.dev))
    clock = [0.0]
    reader = EvidenceReader(paths, ttl=30.0, clock=lambda: clock[0])
    rank.ask("cuda")
    child = int(rank.ask("fork"))
    ev = reader.read(child)
    assert ev is not None and ev.holds_cuda_device and reader.scans == 1
    assert reader.read(child) is ev and reader.scans == 1  # nothing changed: no readlink of any fd
    fd = int(rank.ask("open"))
    parent = reader.read(rank.pid)
    assert parent is not None and reader.scans == 2
    assert reader.read(rank.pid) is parent and reader.scans == 2
    rank.ask("cuda")  # the number of fds changed: a new device shows at once
    again = reader.read(rank.pid)
    assert again is not None and reader.scans == 3 and len(again.nvidia_fds) == 6 and fd > 0
    clock[0] = 31.0  # fds closed and others opened (same number) are caught within the TTL
    assert reader.read(rank.pid) is not again and reader.scans == 4
    reader.forget([])
    assert reader.read(child) is not None and reader.scans == 5


def test_a_steady_processs_fds_are_not_read_again_within_the_evidence_ttl(rank: Rank) -> None:
    """At the shipped TTL a process whose identity and fd count did not change is not scanned
    again after 30 s (a rank's DataLoader workers hold hundreds of fds each: every sixth cycle
    read them all); a change of its fd count is scanned the same cycle, and the TTL still
    catches a same-count swap."""
    from gpuwatchd.sources.devfds import EVIDENCE_TTL

    paths = HostPaths(devfs=str(rank.dev))
    clock = [0.0]
    reader = EvidenceReader(paths, clock=lambda: clock[0])
    rank.ask("cuda")
    child = int(rank.ask("fork"))
    first = reader.read(child)
    assert first is not None and first.holds_cuda_device and reader.scans == 1
    for t in (31.0, 61.0, 121.0, EVIDENCE_TTL - 1.0):  # one read every 5 s cycle up to the TTL
        clock[0] = t
        assert reader.read(child) is first
    assert reader.scans == 1
    parent = reader.read(rank.pid)
    assert parent is not None and reader.scans == 2
    rank.ask("open")  # one fd more: scanned at once, the TTL not waited for
    assert reader.read(rank.pid) is not parent and reader.scans == 3
    clock[0] = EVIDENCE_TTL + 1.0
    again = reader.read(child)
    assert again is not first and again == first and reader.scans == 4


def test_children_of_a_process_without_a_cuda_device_are_not_scanned(rank: Rank) -> None:
    """fork_after_cuda needs a parent that holds a CUDA device: the fds of the children of one
    that holds none are never read (a rank's DataLoader workers hold hundreds)."""
    paths = HostPaths(devfs=str(rank.dev))
    procfs = ProcfsReader(paths)
    kids = [int(rank.ask("fork")), int(rank.ask("thread-fork"))]
    entry = RankEntry(job_id="j", rank=0, pid=rank.pid)
    processes = procfs.read_many([rank.pid, *kids])
    desc = {rank.pid: tuple(procfs.descendants(rank.pid))}
    assert set(kids) <= set(desc[rank.pid])
    reader = EvidenceReader(paths)
    ev = fork_evidence(reader, [entry], processes, desc, {rank.pid})
    assert set(ev) == {rank.pid} and reader.scans == 1  # the rank (NVML lists it) only
    rank.ask("cuda")
    cuda_kid = int(rank.ask("fork"))
    processes = procfs.read_many([rank.pid, *kids, cuda_kid])
    desc = {rank.pid: tuple(procfs.descendants(rank.pid))}
    ev = fork_evidence(reader, [entry], processes, desc, {rank.pid})
    assert set(ev) == {rank.pid, *kids, cuda_kid}  # now its children are looked at
    assert ev[cuda_kid].holds_cuda_device and not ev[kids[0]].holds_cuda_device
    # NVML gave no reading: every process of the tree, as before
    everything = fork_evidence(EvidenceReader(paths), [entry], processes, desc, None)
    assert set(everything) == set(ev)
    assert os.getpid() not in everything


def test_state_json_text_is_the_slow_encoding_byte_for_byte(tmp_path: Path) -> None:
    """state.json is written every cycle: the C-encoder path must write exactly what the walk in
    Python did, for the golden pipeline's state (ranks, GPU processes, orphans, findings,
    counters, read-only mappings)."""
    import json
    import types

    from test_golden_exposition import NVML, PROC, T0

    from gpuwatchd.config.schema import Config, NvmlConfig, OrphansConfig
    from gpuwatchd.daemon.core import Daemon
    from gpuwatchd.daemon.nvml import NvmlSubsystem
    from gpuwatchd.daemon.state_json import state_json_text, state_to_json
    from gpuwatchd.daemon.wiring import Parts
    from gpuwatchd.model import Finding
    from gpuwatchd.rank.rankfile import write_rank_file

    write_rank_file(
        str(tmp_path / "ranks"),
        {
            "version": 1,
            "job_id": "golden",
            "world_size": 1,
            "ranks": [{"rank": 0, "local_rank": 0, "pid": 447, "gpus": ["0"], "start_ticks": 571200}],
        },
        "golden.json",
    )
    cfg = Config(
        rank_dir=str(tmp_path / "ranks"),
        state_dir=str(tmp_path / "state"),
        procfs=str(PROC),
        nvml=NvmlConfig(fixture=str(NVML)),
        orphans=OrphansConfig(grace_seconds=30.0),
    )
    now = [T0]
    daemon = Daemon(
        cfg,
        paths=HostPaths(procfs=str(PROC), sysfs=str(tmp_path / "sys"), devfs=str(tmp_path / "dev")),
        clock=lambda: now[0],
        write_state=False,
        parts=lambda c, s: Parts(nvml=NvmlSubsystem(c, s, watch_xid=False, watch_udev=False)),
    )
    for sub in daemon.subsystems:
        sub.start(daemon)
    try:
        for t in (T0, T0 + 5.0, T0 + 40.0):
            now[0] = t
            state = daemon.cycle()
    finally:
        for sub in daemon.subsystems:
            sub.stop()
    assert state.ranks and state.gpu_processes and state.orphans and state.findings
    odd = Finding(
        kind="x",
        severity="warning",
        explanation="e",
        evidence={
            "ints": {3: 1},
            "proxy": types.MappingProxyType({"a": (1, 2)}),
            "set": frozenset({"s"}),
            "float": float("nan"),
        },
    )
    for s in (state, dataclasses.replace(state, findings=(*state.findings, odd))):
        slow = json.dumps(state_to_json(s), separators=(",", ":"), default=str)
        assert state_json_text(s) == slow
    tuple_key = dataclasses.replace(state, findings=(dataclasses.replace(odd, evidence={(1, 2): 3}),))
    assert state_json_text(tuple_key) == json.dumps(
        state_to_json(tuple_key), separators=(",", ":"), default=str
    )  # the slow path


def test_a_heartbeat_found_in_the_ranks_root_is_walked_once_a_cycle(tmp_path: Path, rank: Rank) -> None:
    from gpuwatchd.sources.heartbeats import HeartbeatRoots, heartbeat_mtime
    from gpuwatchd.sources.rankfiles import guard_entries

    hb = tmp_path / "r0.hb"
    hb.write_text("")
    clock = [0.0]
    roots = HeartbeatRoots(ttl=30.0, clock=lambda: clock[0])
    found = RankEntry(job_id="j", rank=0, pid=rank.pid, heartbeat=str(hb))
    later = RankEntry(job_id="j", rank=1, pid=rank.pid, heartbeat=str(tmp_path / "r1.hb"))
    other = RankEntry(
        job_id="j", rank=2, pid=rank.pid, heartbeat=str(hb), owner_uid=os.getuid() + 4242
    )  # not the file's owner: refused every cycle
    for cycle in range(3):
        got, _ = guard_entries([found, later, other], roots=roots)
        assert got[0].heartbeat_root == f"/proc/{rank.pid}/root"
        assert heartbeat_mtime(got[0]) == hb.stat().st_mtime  # still read (and checked) each cycle
        assert got[1].heartbeat_root == f"/proc/{rank.pid}/root" and heartbeat_mtime(got[1]) is None
        assert got[2].heartbeat is None
        assert roots.walks == 1 + 2 * (cycle + 1)  # found: once; the other two: every cycle
    (tmp_path / "r1.hb").write_text("")  # written now: found, then remembered too
    guard_entries([found, later], roots=roots)
    got, _ = guard_entries([found, later], roots=roots)
    assert roots.walks == 8 and heartbeat_mtime(got[1]) is not None
    clock[0] = 31.0  # looked for again after the TTL
    guard_entries([found], roots=roots)
    assert roots.walks == 9
    guard_entries([found, later], roots=roots)  # `later` was forgotten when a cycle did not ask
    assert roots.walks == 10


def test_environ_of_selected_names_reads_what_the_full_parse_reads(procs: list[subprocess.Popen[Any]]) -> None:
    """Discovery reads a few names of every process's environ each pass: found by search, not by
    splitting the whole block; the same values as the full parse, look-alikes not matched."""
    env = {
        "RANK": "3",
        "XRANK": "9",
        "OTHER": "RANK=7",
        "LOCAL_RANK": "",
        "WORLD_SIZE": "8",
        "UTF": "é\udcff",
        "PATH": os.environ.get("PATH", ""),
    }
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={k: v.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for k, v in env.items()},
    )
    procs.append(p)
    procfs = ProcfsReader()
    deadline = time.monotonic() + 30  # right after fork, before exec, environ reads empty
    while "PATH" not in (full := procfs.environ(p.pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "UTF", "SLURM_PROCID", "ANK", "")
    got = procfs.environ(p.pid, names)
    assert got == {k: full[k] for k in names if k in full}
    assert got["RANK"] == "3" and got["LOCAL_RANK"] == "" and "SLURM_PROCID" not in got
    assert procfs.environ(p.pid + 10**7, names) == {}  # gone


def test_stat_in_root_with_links_on_the_way(tmp_path: Path) -> None:
    """The heartbeat walk opens each directory on the way with one call now; links in the middle
    (relative, absolute, climbing) still resolve inside the root, and errors stay the same."""
    import errno

    from gpuwatchd.sources.pidns import stat_in_root

    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("x")
    (tmp_path / "a" / "b").mkdir(parents=True)  # what an escape would find: the daemon's tree
    (tmp_path / "a" / "b" / "f").write_text("outside")
    (root / "rel").symlink_to("a")
    (root / "abs").symlink_to("/a")  # absolute: starts again at the root
    (root / "a" / "up").symlink_to("../../../../a")  # climbs: stops at the root
    (root / "loop").symlink_to("loop")
    want = (root / "a" / "b" / "f").stat()
    for path in ("a/b/f", "rel/b/f", "/abs/b/f", "a/up/b/f", "a/b/../b/f", "../../a/b/f", "./a//b/f"):
        st = stat_in_root(str(root), path)
        assert (st.st_ino, st.st_dev) == (want.st_ino, want.st_dev), path
    assert stat_in_root(str(root), "rel/b").st_ino == (root / "a" / "b").stat().st_ino
    for path, code in (
        ("a/b/f/x", errno.ENOTDIR),
        ("nope/f", errno.ENOENT),
        ("loop/f", errno.ELOOP),
        ("a/nope", errno.ENOENT),
    ):
        with pytest.raises(OSError) as e:
            stat_in_root(str(root), path)
        assert e.value.errno == code, path


def test_the_kept_heartbeat_directory_is_reached_inside_the_root(tmp_path: Path) -> None:
    """open_parent_in_root (the directory HeartbeatRoots keeps, and reads steps through) walks as
    stat_in_root does: links on the way stay inside the root, a last name that is a link is not
    followed (the caller reads it without following), and hostile paths get a clear error."""
    import errno

    from gpuwatchd.sources.heartbeat_step import read_step
    from gpuwatchd.sources.pidns import open_parent_in_root

    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "hb").write_text("7")
    (tmp_path / "a" / "b").mkdir(parents=True)  # what an escape would find: the daemon's tree
    (tmp_path / "a" / "b" / "hb").write_text("666")
    (root / "abs").symlink_to("/a")
    (root / "a" / "up").symlink_to("../../../../a")
    (root / "a" / "b" / "leak").symlink_to(str(tmp_path / "a" / "b" / "hb"))
    (root / "loop").symlink_to("loop")
    fds = len(os.listdir("/proc/self/fd"))
    for path in ("a/b/hb", "/abs/b/hb", "a/up/b/hb", "../../a/b/hb"):
        fd, name = open_parent_in_root(str(root), path)
        try:
            assert name == "hb" and read_step(name, None, dir_fd=fd) == 7, path
        finally:
            os.close(fd)
    fd, name = open_parent_in_root(str(root), "a/b/leak")
    try:
        assert read_step(name, None, dir_fd=fd) is None  # a link as the last name: not followed
    finally:
        os.close(fd)
    for path, code in (("a/b/hb/x", errno.ENOTDIR), ("nope/hb", errno.ENOENT), ("loop/hb", errno.ELOOP)):
        with pytest.raises(OSError) as e:
            open_parent_in_root(str(root), path)
        assert e.value.errno == code, path
    for path in ("a/b/..", "", "/"):
        with pytest.raises(ValueError):
            open_parent_in_root(str(root), path)
    assert len(os.listdir("/proc/self/fd")) == fds  # nothing left open by the walks or refusals


def test_a_cycle_reads_each_ranks_stat_once(tmp_path: Path, rank: Rank, procs: list[subprocess.Popen[Any]]) -> None:
    """The rank files' PID-namespace check asks for the start time, /proc asks for the whole stat
    line: one read of /proc/PID/stat per process per cycle serves both (and none is kept after)."""
    import json

    from daemonutil import write_config

    from gpuwatchd.config.schema import load_config
    from gpuwatchd.daemon.core import Daemon
    from gpuwatchd.daemon.wiring import no_parts

    others = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    procs.extend(others)
    path, _ = write_config(tmp_path, interval_seconds=1.0)
    pids = [rank.pid] + [p.pid for p in others]
    (tmp_path / "ranks" / "j.json").write_text(
        json.dumps({"version": 1, "job_id": "j", "ranks": [{"rank": i, "pid": p} for i, p in enumerate(pids)]})
    )
    d = Daemon(load_config(str(path)), parts=no_parts, write_state=False)
    try:
        d.cycle()
        for _ in range(3):
            before = d.procfs.stat_reads
            state = d.cycle()
            assert sum(r.alive for r in state.ranks) == len(pids)
            assert d.procfs.stat_reads - before == len(pids)  # was 2 per rank
        d.procfs.read_stat(rank.pid)
        d.procfs.read_stat(rank.pid)  # outside a cycle: read each time
        assert d.procfs.stat_reads - before == len(pids) + 2
    finally:
        d.shutdown()


def test_collectors_reuse_one_worker_thread_and_end_it_when_idle() -> None:
    """Each collector run used to start a thread (three a cycle); one worker now serves every run,
    a hung call still blocks only its own collector, and an idle worker ends."""
    import threading

    from gpuwatchd.isolation import Collector

    served: list[int] = []
    release = threading.Event()

    def read() -> int:
        served.append(threading.get_ident())
        if len(served) == 4:
            release.wait(30)  # a hung source
        return len(served)

    col = Collector("probe", read, timeout=0.5, max_age=60.0, idle_seconds=0.2)
    assert [col.run() for _ in range(3)] == [1, 2, 3]
    assert len(set(served)) == 1  # one thread served all three
    assert col.run() == 3 and "timed out" in col.status.error  # the last good reading, marked down
    assert col.run() == 3 and len(served) == 4  # no second call while the first hangs
    release.set()
    deadline = time.monotonic() + 10
    while col.run() != 5:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert col.status.success and len(set(served)) == 1
    worker = next(t for t in threading.enumerate() if t.name == "collector-probe")
    worker.join(10)  # idle for 2 time-outs: ended
    assert not worker.is_alive()
    assert col.run() == 6 and col.status.success  # a new worker for the next run
    col.close()


def test_a_heartbeat_in_the_ranks_root_is_read_with_one_fstatat_a_cycle(tmp_path: Path, rank: Rank) -> None:
    """Reading a heartbeat in the rank's root used to open every directory on its path each
    cycle; the directory is now kept (O_PATH) and the file read with one fstatat, the owner rule
    checked each time, and the fd closed when the rank is no longer asked about."""
    from gpuwatchd.sources.heartbeats import HeartbeatRoots, heartbeat_mtime
    from gpuwatchd.sources.rankfiles import guard_entries

    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    hb = deep / "r0.hb"
    hb.write_text("")
    roots = HeartbeatRoots(ttl=30.0)
    mine = RankEntry(job_id="j", rank=0, pid=rank.pid, heartbeat=str(hb))
    theirs = RankEntry(job_id="j", rank=1, pid=rank.pid, heartbeat=str(hb), owner_uid=os.getuid() + 4242)
    fds = len(os.listdir("/proc/self/fd"))
    for cycle in range(3):
        os.utime(hb, (1000.0 + cycle, 1000.0 + cycle))
        got, _ = guard_entries([mine, theirs], roots=roots)
        assert roots.mtime(got[0]) == heartbeat_mtime(got[0]) == 1000.0 + cycle
        assert roots.mtime(got[1]) is None  # refused by the owner rule
        roots.end_reads()
    assert roots.dir_walks == 1  # one walk, then fstatat
    assert len(os.listdir("/proc/self/fd")) == fds + 1  # one directory kept
    again, _ = guard_entries([mine], roots=roots)
    assert again[0] is got[0]  # the same rank file: last cycle's guarded entry, not a copy
    hb.unlink()
    assert roots.mtime(again[0]) is None  # gone: the fd is dropped, the path walked next time
    hb.write_text("")
    os.utime(hb, (2000.0, 2000.0))
    assert roots.mtime(again[0]) == 2000.0 and roots.dir_walks == 2
    roots.end_reads()
    roots.end_reads()  # a cycle that asked for no heartbeat: the directory is closed
    assert len(os.listdir("/proc/self/fd")) == fds


def test_fork_evidence_rereads_exe_and_cmdline_only_after_an_exec(procs: list[subprocess.Popen[Any]]) -> None:
    """Each cycle used to read every evidence process's stat, exe link and cmdline to tell a new
    process image from the old; the image's addresses in /proc/PID/stat tell it now, and exe and
    cmdline are read again only after an exec."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; print('ready', flush=True); "
            "sys.stdin.readline(); os.execv('/bin/sleep', ['sleep', '600'])",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    reader = EvidenceReader(HostPaths(), ttl=3600.0)
    deadline = time.monotonic() + 10
    first = reader.read(p.pid)
    assert first is not None and "python" in first.exe
    for _ in range(5):
        assert reader.read(p.pid) is first
    assert reader.identity_reads == 1 and reader.scans == 1  # was 6 identity reads
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    while os.readlink(f"/proc/{p.pid}/exe") != "/usr/bin/sleep":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = reader.read(p.pid)
    assert after is not None and after.exe == "/usr/bin/sleep" and reader.identity_reads == 2
