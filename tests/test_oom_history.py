"""oom_history.py and the first start: kills before the daemon first ran are history, not overruns.

Real kills first: each test OOM-kills a child in a real memory cgroup *before* the daemon starts
with an empty state_dir, so /proc/vmstat oom_kill and the kmsg ring really hold it. Other helpers'
tests may kill processes on this machine at the same time; the assertions only count what happened
before the daemon's start, or name our own PIDs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from kernel_oom_helpers import MemCgroup, go
from test_kernel_events import COMM, export_entry, write_journal

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.kernel_log import KernelLogSubsystem
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import JsonlSink, read_events
from gpuwatchd.join.oom_history import BASELINE_FILE, Baseline, load_baseline, save_baseline
from gpuwatchd.model.events import Event
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.kernel_log import read_vmstat_oom_kill
from gpuwatchd.sources.kmsg import read_boot_id

BOOT = read_boot_id(HostPaths())


class Clock:
    """The daemon's clock, real time plus a skew the test moves past the cross-check's grace."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.time() + self.skew


@pytest.fixture
def killed_before_start() -> Iterable[int]:
    """PID of a child OOM-killed in a real memory cgroup before the test's daemon exists."""
    cg = MemCgroup("hist")
    try:
        child = cg.spawn()
        go(child)
        assert child.wait(20) == -9
        assert cg.oom_kills() == 1
        yield child.pid
    finally:
        cg.remove()


def start_daemon(
    tmp_path: Path, kernel_log: str, journal: Path | None = None
) -> tuple[Daemon, KernelLogSubsystem, Clock]:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"rank_dir: {tmp_path / 'ranks'}\nstate_dir: {tmp_path / 'state'}\n"
        f"kernel_log: {kernel_log}\ngil:\n  enabled: false\n"
        "discovery:\n  enabled: false\nnvml:\n  enabled: false\n"
    )
    (tmp_path / "ranks").mkdir(exist_ok=True)
    (tmp_path / "state").mkdir(exist_ok=True)
    cfg = load_config(str(cfg_file))
    clock = Clock()
    d = Daemon(
        cfg,
        clock=clock,
        write_state=False,
        services=Services.build(cfg, clock=clock, write_state=False, bus=EventBus([JsonlSink(cfg.state_dir)])),
        parts=lambda c, s: Parts(kernel_log=KernelLogSubsystem(c, s, journal_path=str(journal) if journal else None)),
    )
    sub = d.parts.kernel_log
    assert isinstance(sub, KernelLogSubsystem)
    sub.start(d)
    assert _wait(lambda: sub.source is not None)
    assert _wait(lambda: sub.source.ready.is_set(), 20)
    return d, sub, clock


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def past_grace(d: Daemon, clock: Clock) -> None:
    """Cycles on both sides of the unexplained-kill grace period (10 s of the daemon's clock)."""
    d.cycle()
    clock.skew += 30.0
    d.cycle()
    d.cycle()


def events(tmp_path: Path) -> list[Event]:
    return list(read_events(str(tmp_path / "state" / "events.jsonl")))


def unexplained_kills(tmp_path: Path) -> int:
    return sum(e.count for e in events(tmp_path) if e.kind == "oom_kill_unexplained")


def test_first_start_kmsg_replay_is_history_not_kills(tmp_path: Path, killed_before_start: int) -> None:
    pid = killed_before_start
    before = read_vmstat_oom_kill(HostPaths())
    assert before is not None and before >= 1
    d, sub, clock = start_daemon(tmp_path, "kmsg")
    try:
        past_grace(d, clock)
        after = read_vmstat_oom_kill(HostPaths())
    finally:
        sub.stop()
    evs = events(tmp_path)
    # the kill before the start is not counted as a kill (it was counted, unattributed, before)
    assert [e for e in evs if e.kind == "oom_kill" and e.pid == pid] == []
    assert d.counters.snapshot()["oom_kills"].get(("", "", COMM, "kernel"), 0.0) <= sum(
        1 for e in evs if e.kind == "oom_kill" and e.comm == COMM
    )
    # ... nor invented as an unexplained one: only kills after the start may ever be
    assert unexplained_kills(tmp_path) <= (after or 0) - before
    (h,) = [e for e in evs if e.kind == "oom_kill_history"]
    assert f"the kernel had counted {before} OOM kill(s) since boot" in h.summary
    assert "kills before now are history, not counted" in h.summary
    assert f"pid {pid} ({COMM}) by kernel at " in h.summary
    assert "the kernel log (kmsg) still held" in h.summary
    assert h.fields["vmstat_oom_kill"] == before and h.fields["replayed_kills"] >= 1
    assert any(k["pid"] == pid for k in h.fields["kills"])
    base = json.loads((tmp_path / "state" / BASELINE_FILE).read_text())
    assert base["boot_id"] == BOOT and base["vmstat_oom_kill"] == before


def test_first_start_with_a_log_that_lost_the_kills_invents_none(tmp_path: Path, killed_before_start: int) -> None:
    """The issue's case: vmstat counts kills that the log no longer holds (a journal vacuumed or
    started later, a ring that wrapped). Old code: 'the kernel counted N OOM kill(s) that no kernel
    log line explains (log overrun or source down)' and the unattributed counter jumped by N."""
    jdir = tmp_path / "journal"
    jdir.mkdir()
    write_journal(jdir / "k.journal", export_entry("Linux version 6.18", 1, time.time() - 5))
    before = read_vmstat_oom_kill(HostPaths())
    assert before is not None and before >= 1
    d, sub, clock = start_daemon(tmp_path, "journal", jdir)
    try:
        past_grace(d, clock)
        after = read_vmstat_oom_kill(HostPaths())
    finally:
        sub.stop()
    assert unexplained_kills(tmp_path) <= (after or 0) - before
    unattributed = d.counters.snapshot()["oom_kills"].get(("", "", "", "kernel"), 0.0)
    assert unattributed <= (after or 0) - before
    (h,) = [e for e in events(tmp_path) if e.kind == "oom_kill_history"]
    assert h.summary.endswith("the kernel log (journal) held none of them")
    assert f"the kernel had counted {before} OOM kill(s) since boot" in h.summary
    # a restart in the same boot keeps the baseline and reports no history again
    d2, sub2, clock2 = start_daemon(tmp_path, "journal", jdir)
    try:
        past_grace(d2, clock2)
    finally:
        sub2.stop()
    assert len([e for e in events(tmp_path) if e.kind == "oom_kill_history"]) == 1
    assert unexplained_kills(tmp_path) <= (read_vmstat_oom_kill(HostPaths()) or 0) - before


def test_a_kill_after_the_first_start_still_counts(tmp_path: Path, killed_before_start: int) -> None:
    d, sub, clock = start_daemon(tmp_path, "kmsg")
    cg = MemCgroup("hist2")
    try:
        d.cycle()
        child = cg.spawn()
        go(child)
        assert child.wait(20) == -9
        assert _wait(lambda: any(e.kind == "oom_kill" and e.pid == child.pid for e in events(tmp_path)))
        past_grace(d, clock)
    finally:
        sub.stop()
        cg.remove()
    assert [e.pid for e in events(tmp_path) if e.kind == "oom_kill" and e.pid in (child.pid, killed_before_start)] == [
        child.pid
    ]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "[]",
        "null",
        '{"boot_id": 5}',
        '{"boot_id": "B", "vmstat_oom_kill": -1, "time": 1}',
        '{"boot_id": "B", "vmstat_oom_kill": true, "time": 1}',
        '{"boot_id": "B", "time": "x"}',
        '{"boot_id": "B", "vmstat_oom_kill": 3, "time": 1e300}',
        "x" * 10000,
        "\xff\xfe",
    ],
)
def test_damaged_baseline_is_reported_not_trusted(tmp_path: Path, text: str) -> None:
    path = tmp_path / BASELINE_FILE
    path.write_text(text, errors="surrogateescape")
    b, why = load_baseline(str(path), "B")
    assert b is None and why


def test_baseline_round_trip_and_other_boot(tmp_path: Path) -> None:
    path = str(tmp_path / BASELINE_FILE)
    save_baseline(path, Baseline("B", 79, 1_700_000_000.0))
    assert load_baseline(path, "B") == (Baseline("B", 79, 1_700_000_000.0), "")
    assert load_baseline(path, "other boot") == (None, "")
    save_baseline(path, Baseline("B", None, 1.0))  # RHEL 7: no oom_kill in /proc/vmstat
    assert load_baseline(path, "B") == (Baseline("B", None, 1.0), "")


def test_history_summary_names_each_kind_of_kill() -> None:
    from gpuwatchd.join.oom_history import History, HistoryKill

    h = History()
    h.add(HistoryKill(4242, "python3", "kernel", 100.0, 2 << 30, "/job_7"))
    h.add(HistoryKill(0, "", "systemd-oomd", 200.0, None, "/user.slice/app.scope"))
    for i in range(20):
        h.add(HistoryKill(5000 + i, "stress", "earlyoom", 300.0 + i, None, ""))
    text = h.summary(Baseline("B", 79, 1000.0), "journal", lambda t: f"T{t:.0f}")
    assert text.startswith(
        "first start of gpuwatchd in this boot (at T1000): the kernel had counted "
        "79 OOM kill(s) since boot; kills before now are history, not counted; the "
        "kernel log (journal) still held 22 kill(s) (78 older kernel kill(s) had left it)"
    )
    assert "pid 5019 (stress) by earlyoom at T319" in text and text.endswith(", and 12 more")
    assert "pid 4242" not in text  # only the newest SHOWN_KILLS are named
    h2 = History()
    h2.add(HistoryKill(0, "", "systemd-oomd", 200.0, None, "/user.slice/app.scope"))
    assert "cgroup /user.slice/app.scope by systemd-oomd at T200" in h2.summary(
        Baseline("B", None, 1.0), "journal", lambda t: f"T{t:.0f}"
    )
    assert "this kernel does not count OOM kills" in h2.summary(Baseline("B", None, 1.0), "", str)
