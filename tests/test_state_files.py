"""State files are untrusted input, and a full or read-only state_dir is exported (issue 11 items
7 and 10): real daemon, a real tmpfs filled to the last byte, a real read-only bind mount, a real
memory-cgroup OOM kill read from /dev/kmsg, the real `gpuwatchd events` command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import REPO, DaemonProc, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_oom_helpers import MemCgroup, go

from gpuwatchd.counters import CounterStore
from gpuwatchd.events.log import read_events
from gpuwatchd.join.kernel_events import KernelEventProcessor
from gpuwatchd.join.rank_trees import RankTreeRecord
from gpuwatchd.model.events import Event
from gpuwatchd.rank import api
from gpuwatchd.sources.kernel_lines import parse_message
from gpuwatchd.sources.kmsg import KmsgSource
from gpuwatchd.statefile import StateFiles


def event_line(job: str, when: float, key: str, **extra: Any) -> str:
    d = json.loads(
        Event(
            key=key,
            kind="oom_kill",
            time=when,
            severity="page",
            summary=f"rank 0 of job {job} was killed",
            job_id=job,
            rank="0",
            pid=4242,
            comm="python3",
            killer="kernel",
            boot_id="old-boot",
            counter="oom_kills",
            labels=(job, "0", "python3", "kernel"),
        ).to_json()
    )
    d.update(extra)
    return json.dumps(d)


BAD_LINES = [
    '{"key":"k-overflow","kind":"oom_kill","count":1e400,"counter":"oom_kills",'
    '"labels":["x","0","python3","kernel"]}',  # json: inf; int(inf) raised OverflowError
    '{"key":"k-nan","kind":"oom_kill","time":NaN}',
    '{"key":"k-big","kind":"oom_kill","count":' + "9" * 400 + "}",
    "[" * 20_000 + "]" * 20_000,  # RecursionError in json
    '"just a string"',
    '{"key": "torn", "kind": "oom_k',  # a crash mid-append
]


@pytest.fixture
def cgroup() -> Iterator[MemCgroup]:
    cg = MemCgroup("statefiles")
    try:
        yield cg
    finally:
        cg.remove()


def counter(d: DaemonProc, name: str, **labels: str) -> float:
    return d.value(name, **labels) or 0.0


def register(cfg: dict[str, Any], job: str, pid: int) -> None:
    api.register_rank(job, 0, pid=pid, rank_dir=cfg["rank_dir"], heartbeat=False, cuda_oom_hook=False, strict=True)


def kill_and_count(d: DaemonProc, cfg: dict[str, Any], cgroup: MemCgroup, job: str) -> None:
    victim = cgroup.spawn()
    register(cfg, job, victim.pid)
    d.wait_for(
        lambda: d.value("gpuwatch_oom_kills_total", job_id=job) == 0.0, timeout=20, what="the rank's OOM series at 0"
    )
    go(victim)
    assert victim.wait(20) == -9
    d.wait_for(
        lambda: d.value("gpuwatch_oom_kills_total", job_id=job) == 1.0, timeout=20, what="the real OOM kill counted"
    )


# --- item 7: one odd line must not disable OOM counting --------------------------------------


def test_odd_event_lines_are_skipped_and_counted_and_kills_still_counted(tmp_path: Path, cgroup: MemCgroup) -> None:
    path, cfg = write_config(tmp_path, kernel_log="kmsg")
    state = Path(cfg["state_dir"])
    state.mkdir()
    now = time.time()
    good = event_line("earlier-job", now - 30, "k-good")
    (state / "events.jsonl").write_text("\n".join([good, *BAD_LINES]) + "\n")
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(lambda: d.value("gpuwatch_collector_success", collector="kernel_log") == 1.0, what="kernel_log up")
        assert d.value("gpuwatch_oom_kills_total", job_id="earlier-job") == 1.0  # the good line
        rejected = {
            dict(k[1])["reason"]: v for k, v in d.samples().items() if k[0] == "gpuwatch_state_records_rejected_total"
        }
        assert rejected == {"malformed": 5.0, "not_an_object": 1.0}
        kill_and_count(d, cfg, cgroup, f"job-{uuid.uuid4().hex[:6]}")
    finally:
        assert d.stop() == 0
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "events", "--state-dir", str(state), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "earlier-job" in out.stdout and "Traceback" not in out.stderr


def test_a_subsystem_that_cannot_start_reads_down(tmp_path: Path) -> None:
    """events.jsonl that cannot be read (here: a directory) stops the kernel-log subsystem from
    starting: its collector must read 0, not vanish from /metrics."""
    path, cfg = write_config(tmp_path, kernel_log="kmsg")
    (Path(cfg["state_dir"]) / "events.jsonl").mkdir(parents=True)
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: d.value("gpuwatch_collector_success", collector="kernel_log") == 0.0,
            what="kernel_log exported as down",
        )
        assert d.value("gpuwatch_collector_success", collector="procfs") == 1.0
    finally:
        assert d.stop() == 0
    assert "starting subsystem kernel_log failed" in d.log_path.read_text()


def test_temporaries_of_a_killed_daemon_are_removed_at_start(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    state = Path(cfg["state_dir"])
    state.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    left = [f"state.json.tmp.{dead}", "rank_trees.json.tmp", "events.jsonl.compact", f"kmsg.json.tmp.{dead}"]
    for name in [*left, "notes.tmp", f"state.json.tmp.{os.getppid()}"]:
        (state / name).write_text("")
    d = DaemonProc(path, cfg)
    assert d.stop() == 0
    names = set(os.listdir(state))
    assert not names & set(left)
    # not ours, or written by a live process (a second daemon on the same state_dir): kept
    assert {"notes.tmp", f"state.json.tmp.{os.getppid()}"} <= names


def test_kmsg_position_file_of_any_content_is_only_a_lost_position(tmp_path: Path) -> None:
    for content in (b"[" * 100_000, b"\xff\xfe", b'{"boot_id": 1e400, "seq": 1e400}', b"x" * 10**6):
        (tmp_path / "kmsg.json").write_bytes(content)
        assert KmsgSource(str(tmp_path)).load_position() is None


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "key",
    "kind",
    "time",
    "time",
    "count",
    "counter",
    "labels",
    "fields",
    "pid",
    "job_id",
    "rank",
    "boot_id",
    "killer",
]
event_dicts = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).map(
    lambda d: {"key": "k", "kind": "counter_base", **d} if len(d) % 2 else d
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(event_dicts | st.binary(max_size=40).map(repr), max_size=12))
def test_fuzz_event_log_lines_never_break_the_start(tmp_path: Path, lines: list[Any]) -> None:
    path = tmp_path / "events.jsonl"
    text = "\n".join(json.dumps(x, allow_nan=True) if isinstance(x, dict) else x for x in lines)
    path.write_text(text + "\n")
    rejected: list[str] = []
    events = list(read_events(str(path), on_reject=rejected.append))
    assert all(math.isfinite(e.time) and e.count >= 0 for e in events)
    from gpuwatchd.cli.events import load, render, to_dict

    shown = load(str(tmp_path), 0.0)  # what `gpuwatchd events` prints, as text and as JSON
    render(shown)
    json.dumps([to_dict(e) for e in shown])
    counters = CounterStore()
    KernelEventProcessor(counters, str(tmp_path), parse=parse_message)  # rebuilds the counters from the log
    for series in counters.snapshot().values():
        assert all(math.isfinite(v) and v >= 0 for v in series.values())


members = st.dictionaries(
    st.sampled_from(
        [
            "pid",
            "start_time",
            "job_id",
            "rank",
            "rank_pid",
            "worker",
            "comm",
            "last_seen",
            "cgroup",
            "world_size",
            "other",
        ]
    ),
    json_values,
    max_size=11,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(members, max_size=6), st.booleans())
def test_fuzz_rank_tree_record_never_breaks_attribution(tmp_path: Path, ms: list[Any], valid_too: bool) -> None:
    good = {
        "pid": 77,
        "start_time": 10.0,
        "job_id": "j",
        "rank": 1,
        "rank_pid": 77,
        "worker": False,
        "comm": "python3",
        "last_seen": 1000.0,
    }
    doc = {"members": [*ms, *([good] if valid_too else [])]}
    (tmp_path / "rank_trees.json").write_text(json.dumps(doc, allow_nan=True))
    files = StateFiles(CounterStore())
    rec = RankTreeRecord(str(tmp_path / "rank_trees.json"), files=files)
    for pid in (77, 1, 0):
        rec.lookup(pid, 1000.5)  # never raises (an "x" pid or an inf start time did)
        rec.ranks_in_cgroup("/", 1000.5)
    if valid_too:
        m = rec.lookup(77, 1000.5)
        assert m is not None and m.job_id == "j"


# --- item 10: a full or read-only state_dir is exported, nothing is left behind ------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "gpuwatchd-test-full", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    src, ro = tmp_path / "rw", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_full_state_dir_is_exported_without_leftovers_and_recovers(tmp_path: Path, tiny_tmpfs: Path) -> None:
    path, cfg = write_config(tmp_path, kernel_log="kmsg", state_dir=str(tiny_tmpfs / "state"))
    filler = fill(tiny_tmpfs)  # full before the daemon writes anything: state_dir cannot be made
    os.truncate(filler, os.path.getsize(filler) - 8192)  # room for the directory, not for state
    (tiny_tmpfs / "state").mkdir()
    fill(tiny_tmpfs)
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: counter(d, "gpuwatch_state_write_errors_total", file="state.json") >= 5,
            what="failed state.json writes counted",
        )
        left = os.listdir(tiny_tmpfs / "state")
        assert "state.json" not in left
        assert [n for n in left if ".tmp" in n] == []  # no empty *.tmp.<pid> behind
        assert d.value("gpuwatch_collector_success", collector="kernel_log") == 1.0
        filler.unlink()
        d.wait_for(lambda: (tiny_tmpfs / "state" / "state.json").exists(), what="state.json again")
        json.loads((tiny_tmpfs / "state" / "state.json").read_text())
        errors = counter(d, "gpuwatch_state_write_errors_total", file="state.json")
        time.sleep(1.5)  # three more cycles
        assert counter(d, "gpuwatch_state_write_errors_total", file="state.json") == errors
    finally:
        assert d.stop() == 0
    log = d.log_path.read_text()
    assert log.count("cannot write state file") <= 4  # once per file, not once per cycle
    assert "is written again" in log
    assert not [n for n in os.listdir(tiny_tmpfs / "state") if ".tmp" in n]


def test_read_only_state_dir_is_exported_and_kills_are_still_counted(
    tmp_path: Path, read_only_dir: Path, cgroup: MemCgroup
) -> None:
    path, cfg = write_config(tmp_path, kernel_log="kmsg", state_dir=str(read_only_dir))
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: counter(d, "gpuwatch_state_write_errors_total", file="state.json") >= 3,
            what="failed state.json writes counted",
        )
        kill_and_count(d, cfg, cgroup, f"job-{uuid.uuid4().hex[:6]}")
        d.wait_for(
            lambda: counter(d, "gpuwatch_state_write_errors_total", file="events.jsonl") >= 1,
            what="the kill's failed append counted",
        )
    finally:
        assert d.stop() == 0
    assert os.listdir(read_only_dir) == []


def test_state_json_is_rewritten_when_a_reader_would_see_a_change_else_every_other_cycle(
    tmp_path: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """state.json after each cycle (Daemon.cycle, real ranks): an unchanged node is written every
    other cycle (1.5 intervals), a rank that dies is in the very next file, and a file is never
    older than load_state's three intervals."""
    from gpuwatchd.config.schema import load_config
    from gpuwatchd.daemon.core import Daemon
    from gpuwatchd.daemon.wiring import no_parts

    path, raw = write_config(tmp_path, interval_seconds=0.4)
    cfg = load_config(str(path))
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    procs.extend(ranks)
    for r, p in enumerate(ranks):
        register(raw, f"sj-{r}", p.pid)
    d = Daemon(cfg, parts=no_parts)
    state_path = Path(cfg.state_dir) / "state.json"

    def written() -> float:
        return float(json.loads(state_path.read_text())["timestamp"])

    d.cycle()  # the first write brings the state_write_errors series of the file (a counter)
    first = d.cycle()
    assert written() == first.timestamp and sum(r.alive for r in first.ranks) == 2
    second = d.cycle()  # at once: nothing a reader acts on changed
    assert written() == first.timestamp < second.timestamp
    ranks[0].kill()
    ranks[0].wait(10)
    third = d.cycle()  # a rank died: written at once
    assert written() == third.timestamp and sum(r.alive for r in third.ranks) == 1
    time.sleep(0.65)  # 1.5 intervals since the last write
    fourth = d.cycle()
    assert written() == fourth.timestamp
