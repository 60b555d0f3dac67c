"""sources/pyspy.py against the real py-spy binary, real Python processes and recorded output."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuwatchd.model.threads import Frame
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import (
    ABSENT,
    BUSY,
    FAILED,
    OUTPUT_TOO_LARGE,
    PERMISSION_DENIED,
    TARGET_GONE,
    TIMEOUT,
    PySpyError,
    classify_failure,
    parse_dump_json,
    parse_record_raw,
    parse_record_summary,
)
from gpuwatchd.sources.threads import in_nested_pid_namespace, process_state

FIX = Path(__file__).parent / "fixtures" / "pyspy"
PROGRAMS = FIX / "programs"
BINARY = pyspy.resolve_pyspy()


def start(program: str, *args: str, python: str = sys.executable, **kw: object) -> subprocess.Popen[str]:
    """Start a fixture program and wait until it printed 'ready' (its threads are running)."""
    proc = subprocess.Popen([python, str(PROGRAMS / program), *args], stdout=subprocess.PIPE, text=True, **kw)  # type: ignore[call-overload]
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    return proc  # type: ignore[no-any-return]


def stand_in(tmp_path: Path, body: str, name: str = "py-spy") -> str:
    """A script standing in for py-spy (a hanging or misbehaving binary)."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


# ----------------------------------------------------------------------------- resolution


def test_resolves_the_real_elf_binary_not_a_shim(tmp_path: Path) -> None:
    assert Path(BINARY).read_bytes()[:4] == b"\x7fELF"
    shim = stand_in(tmp_path, 'exec py-spy "$@"')
    with pytest.raises(PySpyError) as e:
        pyspy.resolve_pyspy(search=[shim])
    assert e.value.reason == ABSENT and "shim" in e.value.detail
    assert pyspy.resolve_pyspy(search=[shim, BINARY]) == os.path.realpath(BINARY)
    # a configured path wins even when it is a script (tests use stand-ins this way)
    assert pyspy.resolve_pyspy(shim) == shim


def test_absent_binary_is_a_reason_not_a_crash(tmp_path: Path, procs: list) -> None:
    spy = PySpy.from_config(str(tmp_path / "no-such-py-spy"))
    assert spy.binary is None and not spy.available
    p = start("io4.py")
    procs.append(p)
    for call in (lambda: spy.dump(p.pid), lambda: spy.record_gil(p.pid, 50, 1)):
        with pytest.raises(PySpyError) as e:
            call()
        assert e.value.reason == ABSENT and e.value.collector_down
        assert "no-such-py-spy" in str(e.value)


# ----------------------------------------------------------------------------- parsers on fixtures


def test_parse_recorded_dump_marks_one_gil_owner() -> None:
    threads = parse_dump_json((FIX / "dump_cpu4.json").read_text())
    assert sorted(t.name for t in threads) == ["MainThread", "cpu-0", "cpu-1", "cpu-2", "cpu-3"]
    assert sum(t.owns_gil for t in threads) == 1
    cpu = next(t for t in threads if t.name == "cpu-0")
    assert [f.name for f in cpu.frames[:2]] == ["burn", "work_loop"]
    assert cpu.frames[0].filename == "cpu4.py" and cpu.frames[0].line in (11, 12)
    assert cpu.tid == cpu.ns_tid and cpu.tid is not None


def test_parse_recorded_record_raw_and_summary() -> None:
    held, errors = parse_record_summary((FIX / "record_cpu4.stdout").read_bytes())
    assert (held, errors) == (90, 0)
    top, by_thread = parse_record_raw((FIX / "record_cpu4.raw").read_text())
    assert top[0][0] == "burn (cpu4.py)" and top[0][1] == 90
    assert sorted(name for _, name, _ in by_thread) == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"]
    assert sum(n for _, _, n in by_thread) == 90
    assert parse_record_summary((FIX / "record_io4.stdout").read_bytes()) == (0, 0)
    assert parse_record_raw("") == ((), ())


def test_parsers_survive_garbage() -> None:
    top, threads = parse_record_raw("no count here\n;;; x\nthread (zz): a;b 3\n 7\n")
    assert top == (("b", 3),) and threads == ()
    with pytest.raises(ValueError):
        parse_dump_json('{"not": "a list"}')
    with pytest.raises(ValueError):
        parse_record_summary(b"py-spy> Sampling process")
    assert parse_dump_json('[{"frames": [1, {"name": "f", "line": "x"}]}]')[0].frames == (Frame("f", "", None),)


def test_recorded_failures_are_classified() -> None:
    denied = (FIX / "dump_permission_denied.stderr").read_bytes()
    assert classify_failure(denied, True)[0] == PERMISSION_DENIED
    gone = (FIX / "dump_no_such_process.stderr").read_bytes()
    assert classify_failure(gone, False) == (
        TARGET_GONE,
        "Error: Failed to get process executable name. Check that the process is running.",
    )
    exited = (FIX / "record_target_exited.stdout").read_bytes()
    assert b"because process exited" in exited


def test_recorded_pid_namespace_ids_map_through_nspid() -> None:
    lines = (FIX / "dump_pidns.nspid").read_text().split("\n")
    host_by_ns = {int(ln.split()[2]): int(ln.split()[1]) for ln in lines if ln.strip()}
    threads = parse_dump_json((FIX / "dump_pidns.json").read_text(), host_by_ns)
    assert sorted(t.ns_tid for t in threads) == [1, 2, 3, 4, 5]  # type: ignore[type-var]
    assert sorted(t.tid for t in threads) == sorted(host_by_ns.values())  # type: ignore[type-var]


# ----------------------------------------------------------------------------- acceptance: ratios


def test_four_cpu_bound_threads_hold_the_gil(procs: list) -> None:
    p = start("cpu4.py")
    procs.append(p)
    s = PySpy(BINARY).record_gil(p.pid, rate_hz=50, duration_seconds=2)
    assert s.ticks == 50 * 2 - 1 - s.errors
    assert s.ratio >= 0.8, s
    assert s.top_functions[0][0].startswith("burn (cpu4.py)")
    tasks = {int(t) for t in os.listdir(f"/proc/{p.pid}/task")}
    tids = {tid for tid, _, _ in s.by_thread}
    # 3.11+ gives py-spy the native thread id; on 3.10 it cannot say which task held it (#567)
    assert tids <= tasks if sys.version_info >= (3, 11) else tids == {0}
    r = s.reading()
    assert r.pid == p.pid and r.samples == s.ticks and r.held == s.held


def test_blocked_threads_do_not_hold_the_gil(procs: list) -> None:
    p = start("io4.py")
    procs.append(p)
    s = PySpy(BINARY).record_gil(p.pid, rate_hz=50, duration_seconds=2)
    assert s.ticks >= 90 and s.ratio <= 0.1, s


def test_thread_busy_30_percent(procs: list) -> None:
    p = start("duty.py")
    procs.append(p)
    s = PySpy(BINARY).record_gil(p.pid, rate_hz=50, duration_seconds=4)
    assert 0.2 <= s.ratio <= 0.4, s
    assert s.top_functions and "duty (duty.py)" in dict(s.top_functions)


def test_dump_of_live_process_names_threads_and_maps_tids(procs: list) -> None:
    p = start("io4.py")
    procs.append(p)
    threads = PySpy(BINARY).dump(p.pid)
    by_name = {t.name: t for t in threads}
    assert set(by_name) == {"MainThread", "sleeper", "pipe", "sock", "lock"}
    assert by_name["lock"].frames[0].name in ("lock_waiter", "acquire")
    if sys.version_info >= (3, 11):
        assert {t.tid for t in threads} == {int(t) for t in os.listdir(f"/proc/{p.pid}/task")}
        assert not any(t.active for t in threads)  # from the host task states
    else:  # no native thread id before 3.11: py-spy --nonblocking reports none (py-spy #567),
        # so neither the host tid nor the host task state can be attached
        assert {t.tid for t in threads} == {None}


def test_target_in_a_pid_namespace_gets_host_thread_ids(procs: list) -> None:
    outer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(PROGRAMS / "io4.py")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert outer.stdout is not None and outer.stdout.readline().strip() == "ready"
        inner = int(Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()[0])
        assert in_nested_pid_namespace(HostPaths(), inner)
        threads = PySpy(BINARY).dump(inner)
        if sys.version_info >= (3, 11):
            assert {t.tid for t in threads} == {int(t) for t in os.listdir(f"/proc/{inner}/task")}
            assert sorted(t.ns_tid or 0 for t in threads) == [1, 2, 3, 4, 5]
        else:  # no native thread id before 3.11 (py-spy #567): nothing to map
            assert {t.tid for t in threads} == {None}
        # py-spy alone would call them all active; the host task state says they all sleep
        assert not any(t.active for t in threads)
        s = PySpy(BINARY).record_gil(inner, 50, 1)
        assert s.ratio <= 0.1
    finally:
        os.kill(inner, signal.SIGKILL)  # PID 1 of its namespace ignores SIGTERM
        outer.wait(timeout=10)


# ----------------------------------------------------------------------------- faults


def test_hanging_pyspy_is_killed_with_its_whole_group(tmp_path: Path, procs: list) -> None:
    child_pid_file = tmp_path / "child.pid"
    hang = stand_in(tmp_path, f"sleep 1000 & echo $! > {child_pid_file}\nwhile :; do sleep 1; done")
    p = start("io4.py")
    procs.append(p)
    spy = PySpy(hang, timeout_seconds=1.5, dump_timeout_seconds=1.0)
    t0 = time.monotonic()
    with pytest.raises(PySpyError) as e:
        spy.dump(p.pid)
    assert e.value.reason == TIMEOUT and e.value.collector_down
    assert time.monotonic() - t0 < 3.0
    child = int(child_pid_file.read_text())
    deadline = time.monotonic() + 2
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the stand-in's child survived the kill"
    with pytest.raises(PySpyError) as e:
        spy.record_gil(p.pid, 50, 1)  # record: hard time-out max(timeout, duration + 1)
    assert e.value.reason == TIMEOUT
    assert spy.stats.timeouts == 2
    assert process_state(HostPaths(), p.pid) == "S"  # the target was never touched


def test_target_exiting_mid_sample(procs: list) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.2)"])
    procs.append(p)
    time.sleep(0.3)
    with pytest.raises(PySpyError) as e:
        PySpy(BINARY).record_gil(p.pid, 50, 3)
    assert e.value.reason == TARGET_GONE and not e.value.collector_down
    p.wait()
    with pytest.raises(PySpyError) as e:
        PySpy(BINARY).dump(p.pid)
    assert e.value.reason == TARGET_GONE


def _user(name: str) -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


def test_target_of_another_user_is_permission_denied(procs: list) -> None:
    target_uid, target_gid = _user("gw-pyspy-target")
    sampler = _user("gw-pyspy-sampler")
    # the system python: the venv's interpreter lives under /root, which other users cannot enter
    p = start("io4.py", python="/usr/bin/python3", user=target_uid, group=target_gid, extra_groups=[])
    procs.append(p)
    spy = PySpy(BINARY, run_as=sampler)
    for call in (lambda: spy.dump(p.pid), lambda: spy.record_gil(p.pid, 50, 1)):
        with pytest.raises(PySpyError) as e:
            call()
        assert e.value.reason == PERMISSION_DENIED and e.value.collector_down
        assert "Permission Denied" in e.value.detail
    # the same user may: proves the failure above is the permission, not the setup
    own = PySpy(BINARY, run_as=(target_uid, target_gid)).dump(p.pid)
    assert {t.name for t in own} >= {"MainThread", "lock"}


def test_target_found_stopped_is_counted_and_left_as_it_is(tmp_path: Path, procs: list) -> None:
    """Someone stopped the target during a run (here a stand-in binary, as a py-spy that ignored
    --nonblocking would): counted, never continued: the daemon does not undo another's stop
    (issue 23 N8; the unit could not anyway, it has no CAP_KILL)."""
    p = start("io4.py")
    procs.append(p)
    # kill(1) returns before the target has stopped: the run ends once it has (found stopped)
    bad = stand_in(
        tmp_path, f"kill -STOP {p.pid}\nuntil grep -q '^State:.T' /proc/{p.pid}/status; do sleep 0.01; done\necho '[]'"
    )
    spy = PySpy(bad)
    assert spy.dump(p.pid) == ()
    assert spy.stats.left_stopped == 1
    time.sleep(0.1)
    assert process_state(HostPaths(), p.pid) == "T"
    os.kill(p.pid, signal.SIGCONT)
    # a target that was already stopped (by its owner) is left as it was
    os.kill(p.pid, signal.SIGSTOP)
    time.sleep(0.1)
    PySpy(BINARY).dump(p.pid)
    assert process_state(HostPaths(), p.pid) == "T"


def test_output_is_capped(tmp_path: Path, procs: list) -> None:
    p = start("io4.py")
    procs.append(p)
    big = stand_in(tmp_path, "head -c 3000000 /dev/zero")
    with pytest.raises(PySpyError) as e:
        PySpy(big, output_cap_bytes=1 << 20).dump(p.pid)
    assert e.value.reason == OUTPUT_TOO_LARGE


def test_concurrency_is_bounded(tmp_path: Path, procs: list) -> None:
    p = start("io4.py")
    procs.append(p)
    log = tmp_path / "runs.log"
    slow = stand_in(
        tmp_path, f"echo start $(date +%s.%N) >> {log}\nsleep 0.4\necho end $(date +%s.%N) >> {log}\necho '[]'"
    )
    spy = PySpy(slow, max_concurrent=1)
    threads = [threading.Thread(target=spy.dump, args=(p.pid,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = [ln.split() for ln in log.read_text().splitlines()]
    assert [e[0] for e in events] == ["start", "end"] * 3  # never two at once
    assert spy.stats.runs == 3


def test_unreadable_dump_output_is_a_failure_reason(tmp_path: Path, procs: list) -> None:
    p = start("io4.py")
    procs.append(p)
    with pytest.raises(PySpyError) as e:
        PySpy(stand_in(tmp_path, "echo '{not json'")).dump(p.pid)
    assert e.value.reason == FAILED
    # and a clean JSON list that is not py-spy's shape is still handled
    assert PySpy(stand_in(tmp_path, "echo '[]'", "ok")).dump(p.pid) == ()
    assert json.loads("[]") == []


def test_dump_never_waits_for_a_busy_slot_when_asked_not_to(tmp_path: Path, procs: list) -> None:
    p = start("io4.py")
    procs.append(p)
    slow = stand_in(tmp_path, "sleep 1.5\necho '[]'")
    spy = PySpy(slow, max_concurrent=1)
    holder = threading.Thread(target=spy.dump, args=(p.pid,))
    holder.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(PySpyError) as e:
        spy.dump(p.pid, slot_wait=0.0)
    assert e.value.reason == BUSY and time.monotonic() - t0 < 0.2
    holder.join()
    assert spy.dump(p.pid, slot_wait=0.0) == ()  # free again
