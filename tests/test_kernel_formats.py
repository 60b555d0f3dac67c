"""Kernel and killer log formats from public reports (tests/fixtures/kernel/README.md names each
source), each through both paths the daemon reads: /dev/kmsg records (parse_kmsg -> processor) and a
real journal file written by systemd-journal-remote (JournalSource -> processor)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernel_events import Pipeline, export_entry, wait_until, write_journal

from gpuwatchd.config.schema import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import JsonlSink
from gpuwatchd.findings import FindingContext, xid_critical
from gpuwatchd.join.kernel_events import KernelEventProcessor
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import KILLER_EARLYOOM, KILLER_KERNEL, LogRecord
from gpuwatchd.model.parts import KernelOutput, Tracked
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import kernel_formats
from gpuwatchd.sources.kernel_lines import MAX_MESSAGE, KmsgRecord, parse_kmsg, parse_message
from gpuwatchd.sources.kmsg import read_boot_id

FIX = Path(__file__).parent / "fixtures" / "kernel"
BOOT = read_boot_id(HostPaths())
MEMCG = (
    "/kubepods/pod95387fa4-da9c-11e7-9d36-5254b24cbf5e/6895a3e13439535852d3184ac2aadd26d7363cc035f171545ec7d4ce74073b0b"
)

# fixture -> the kills it holds: (pid, comm, RSS kB, scope as printed, words of the summary)
KILLS: dict[str, list[tuple[int, str, int, str, str]]] = {
    "el7_kill_uid_3.10.kmsg": [
        (42453, "memcg_test_1", 96 + 164, "Memory cgroup out of memory", "(its memory cgroup's limit was reached)"),
        (42474, "memcg_test_1", 96, "Memory cgroup out of memory", "(its memory cgroup's limit was reached)"),
        (18177, "palo_be", 45563572, "Memory cgroup out of memory", "holding 43.5 GiB RSS"),
    ],
    "el6_kill_uid_2.6.32.kmsg": [(11726, "mysqld", 2539268 + 768, "", "holding 2.4 GiB RSS")],
    "pre419_scope_line_3.10.kmsg": [
        (
            28438,
            "java",
            466160 + 13684,
            "Memory cgroup out of memory",
            f"in memory cgroup {MEMCG} (the cgroup's memory limit was reached)",
        ),
        (27541, "bash", 8098448 + 3264, "Out of memory", "(the node ran out of memory)"),
    ],
}


def kmsg_records(name: str) -> list[KmsgRecord]:
    out = []
    for line in (FIX / name).read_bytes().splitlines():
        if line.startswith(b"#") or not line.strip():
            continue
        r = parse_kmsg(line)
        assert r is not None and r.facility == 0, line
        out.append(r)
    return out


def processor(tmp: Path) -> KernelEventProcessor:
    return KernelEventProcessor(
        CounterStore(), str(tmp), parse=parse_message, bus=EventBus([JsonlSink(str(tmp))]), boot_id=BOOT
    )


def through_kmsg(tmp: Path, name: str, t0: float) -> tuple[list[Event], KernelEventProcessor]:
    p = processor(tmp)
    events: list[Event] = []
    for r in kmsg_records(name):
        events += p.handle(LogRecord(r.message, KILLER_KERNEL, BOOT, r.usec, t0 + r.usec / 1e6, "kmsg", seq=r.seq))
    events += p.tick(t0 + 10**5)
    return events, p


def through_journal(tmp: Path, entries: bytes, want: int) -> tuple[list[Event], Pipeline]:
    jdir = tmp / "journal"
    jdir.mkdir()
    write_journal(jdir / "remote.journal", entries)
    pl = Pipeline(tmp / "state", source="journal", journal=jdir)
    try:
        assert wait_until(lambda: len(pl.processor.recent()) >= want), pl.processor.recent()
        time.sleep(0.2)  # nothing more arrives
    finally:
        pl.stop()
    return pl.processor.recent(), pl


def kmsg_as_journal(name: str, t0: float) -> bytes:
    # journald's kmsg reader unescapes the record (\x0a -> newline) before storing MESSAGE
    return b"".join(
        export_entry(r.message.replace("\\x0a", "\n"), r.usec, t0 + r.usec / 1e6, prio=r.priority & 7)
        for r in kmsg_records(name)
    )


def check_kills(events: list[Event], want: list[tuple[int, str, int, str, str]]) -> None:
    kills = [e for e in events if e.kind == "oom_kill"]
    assert [(e.pid, e.comm) for e in kills] == [(w[0], w[1]) for w in want]
    for e, (_pid, _comm, rss_kb, scope, words) in zip(kills, want, strict=True):
        assert e.killer == "kernel" and e.counter == "oom_kills"
        assert e.fields["rss_bytes"] == rss_kb * 1024
        assert e.fields["scope"] == scope
        assert words in e.summary, e.summary


@pytest.mark.parametrize("name", sorted(KILLS))
def test_kill_formats_through_kmsg(tmp_path: Path, name: str) -> None:
    events, p = through_kmsg(tmp_path, name, 1_800_000_000.0)
    check_kills(events, KILLS[name])
    assert sum(p.counters.snapshot()["oom_kills"].values()) == len(KILLS[name])


@pytest.mark.parametrize("name", sorted(KILLS))
def test_kill_formats_through_the_journal(tmp_path: Path, name: str) -> None:
    events, pl = through_journal(tmp_path, kmsg_as_journal(name, time.time() - 600), len(KILLS[name]))
    check_kills(events, KILLS[name])
    assert sum(pl.counters.snapshot()["oom_kills"].values()) == len(KILLS[name])


EARLYOOM = [(12006, "python3", 2891), (27541, "bash", 7609), (5874, "bash", 3160)]


def earlyoom_lines() -> list[str]:
    return [x for x in (FIX / "earlyoom_pre_1.6.log").read_text().splitlines() if not x.startswith("#")]


def test_earlyoom_before_1_6_parses() -> None:
    parsed = [p for x in earlyoom_lines() if (p := parse_message(x, KILLER_EARLYOOM))]
    assert [(p.pid, p.comm, int(p.fields["rss_kb"]) // 1024) for p in parsed] == [*EARLYOOM, (5874, "bash", 3172)]
    assert {p.fields["signal"] for p in parsed} == {"SIGTERM"}
    # the same words from the kernel transport are not earlyoom's
    assert all(parse_message(x) is None for x in earlyoom_lines())


def test_earlyoom_before_1_6_through_the_journal(tmp_path: Path) -> None:
    """earlyoom logs to stderr, never to /dev/kmsg: the journal (_COMM=earlyoom) is its one path."""
    t0 = time.time() - 600
    entries = b"".join(export_entry(x, 10**9 + i, t0 + i, "earlyoom") for i, x in enumerate(earlyoom_lines()))
    events, pl = through_journal(tmp_path, entries, len(EARLYOOM))
    kills = [e for e in events if e.kind == "oom_kill"]
    assert [(e.pid, e.comm, e.fields["rss_bytes"] >> 20) for e in kills] == EARLYOOM
    assert all(e.killer == "earlyoom" for e in kills)  # the repeated SIGTERM of 5874: one kill
    series = pl.counters.snapshot()["oom_kills"]
    assert series[("", "", "bash", "earlyoom")] == 2 and series[("", "", "python3", "earlyoom")] == 1


def check_bus_lost(events: list[Event], counters: CounterStore) -> None:
    lost = [e for e in events if e.kind == "xid"]
    assert [(e.fields["pci"], e.fields["xid"], bool(e.counter)) for e in lost] == [
        ("0000:b3:00", 79, True),  # one record, embedded newlines
        ("0000:b4:00", 79, True),  # split records: the GPU named on the record before
        ("0000:3b:00", 79, True),  # the numbered Xid 79 line
        ("0000:3b:00", 79, False),  # ... and the driver's no-Xid line of the same loss: not again
    ]
    first = lost[0]
    assert first.fields["detail"] == "fallen off the bus, no Xid number"
    assert first.fields["pci_id"] == "10de:26b5"
    assert "fell off the bus" in first.summary and "counted as Xid 79" in first.summary
    assert "installed in this system has NVRM: fallen off the bus" in first.summary
    assert sum(counters.snapshot()["gpu_xid_errors"].values()) == 3
    ctx = FindingContext(now=first.time + 1, config=Config(), parts=Tracked(kernel=KernelOutput(events=tuple(events))))
    findings = list(xid_critical.find(ctx))
    assert {f.evidence["pci"] for f in findings} == {"0000:b3:00", "0000:b4:00", "0000:3b:00"}
    assert all(f.kind == "xid_critical" and f.severity == "page" for f in findings)


def test_gpu_fallen_off_the_bus_without_xid_through_kmsg(tmp_path: Path) -> None:
    events, p = through_kmsg(tmp_path, "nvrm_bus_lost_570.kmsg", time.time() - 3000)
    check_bus_lost(events, p.counters)


def test_gpu_fallen_off_the_bus_without_xid_through_the_journal(tmp_path: Path) -> None:
    events, pl = through_journal(tmp_path, kmsg_as_journal("nvrm_bus_lost_570.kmsg", time.time() - 3000), 4)
    check_bus_lost(events, pl.counters)


@pytest.mark.parametrize(
    "msg",
    [
        "NVRM: fallen off the bus and is not responding to commands.",  # no GPU named before it
        "NVRM: The NVIDIA GPU 0000:zz:00.0 fallen off the bus",
        "NVRM: GPU at PCI:0000:3b:00: GPU-" + "0" * 36,
        "NVRM: " + "fallen off the bus " * 500,
    ],
)
def test_bus_lost_odd_records(msg: str) -> None:
    got: Any = kernel_formats.parse_bus_lost(msg[:MAX_MESSAGE])
    assert got is None or got[1] == ""


def test_bus_lost_dedup_rules() -> None:
    from gpuwatchd.join.bus_lost import MAX_GPUS, BusLostDedup

    d = BusLostDedup(window=30.0)
    assert d.count("0000:3b:00", 0.0, no_xid_message=True)  # the message first: counted
    assert not d.count("0000:3b:00", 1.0, no_xid_message=False)  # its Xid 79 line: the same loss
    assert d.count("0000:3b:00", 2.0, no_xid_message=False)  # a further Xid 79 line: a new one
    assert not d.count("0000:3b:00", 3.0, no_xid_message=True)  # a message beside it: not again
    assert not d.count("0000:3b:00", 4.0, no_xid_message=True)  # repeated messages: one per window
    assert d.count("0000:3b:00", 100.0, no_xid_message=True)
    for i in range(MAX_GPUS * 3):  # hostile addresses: memory stays bounded
        d.count(f"{i:04x}:00:00", 200.0, no_xid_message=True)
    assert len(d) <= MAX_GPUS
    assert d.pci_for("", 1000.0) == "" and d.pci_for("0000:01:00", 0.0) == "0000:01:00"


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=400),
    st.sampled_from(
        [
            "NVRM: The NVIDIA GPU 0000:3b:00.0",
            "fallen off the bus",
            'killing process 1 "',
            "Killing process '",
            'sending SIGTERM to process 7 "',
            "Killed process 5, UID 0, (",
            "Kill process 3 (x) score 1 or sacrifice child",
        ]
    ),
    st.text(max_size=400),
)
def test_fuzz_new_formats_around_keywords(a: str, keyword: str, b: str) -> None:
    for ident in (KILLER_KERNEL, KILLER_EARLYOOM):
        parse_message(a + keyword + b, ident)


def test_worst_case_bus_lost_record_is_fast() -> None:
    msg = ("NVRM: GPU 0000:3b:00.0 " * 200)[: MAX_MESSAGE - 30] + " fallen off the bus"
    t0 = time.monotonic()
    for _ in range(20):
        parse_message(msg)
    assert time.monotonic() - t0 < 2.0
