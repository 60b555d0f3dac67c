"""sources/kernel_log.py: parsers on recorded lines, /dev/kmsg for real, hostile input."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatchd.model.kernel import KILLER_EARLYOOM, KILLER_KERNEL, KILLER_OOMD, LogRecord, rss_bytes
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import kernel_log as kl
from gpuwatchd.sources.journal import JournalSource, journal_available
from gpuwatchd.sources.kernel_lines import KmsgRecord, parse_kmsg, parse_message
from gpuwatchd.sources.kmsg import KmsgSource, read_boot_id

FIX = Path(__file__).parent / "fixtures" / "kernel"
RECORDED = FIX / "memcg_v1_kill_6.18.kmsg"
FORMATS = json.loads((FIX / "research_formats.json").read_text())


def recorded_records() -> list[KmsgRecord]:
    out = []
    for line in RECORDED.read_bytes().splitlines():
        rec = parse_kmsg(line)
        assert rec is not None, line
        out.append(rec)
    return out


def test_recorded_kmsg_records_parse_in_order() -> None:
    recs = recorded_records()
    assert len(recs) == 78
    assert [r.seq for r in recs] == list(range(recs[0].seq, recs[0].seq + 78))
    assert all(r.facility == 0 for r in recs)
    assert recs[-1].priority == 3  # "Killed process" is KERN_ERR


def test_recorded_memcg_kill_lines() -> None:
    parsed = [p for r in recorded_records() if (p := parse_message(r.message))]
    assert [p.kind for p in parsed] == ["invoked", "memcg_stats", "summary", "killed"]
    summary, killed = parsed[2], parsed[3]
    assert summary.pid == killed.pid == 5653
    assert summary.fields["task_memcg"] == "/gw_h4_capture"
    assert summary.fields["constraint"] == "CONSTRAINT_MEMCG"
    assert killed.comm == "python3"
    assert killed.fields["kind"] == "Memory cgroup out of memory"
    assert rss_bytes(killed) == (72192 + 6640 + 0) * 1024


def test_research_xid_formats() -> None:
    for case in FORMATS["xids"]:
        p = parse_message(case["line"])
        assert p is not None and p.kind == "xid", case["line"]
        assert p.fields["pci"] == case["expect"]["pci"]
        assert int(p.fields["xid"]) == case["expect"]["xid"]
        assert p.pid == case["expect"]["pid"]
    mig = parse_message(FORMATS["xids"][5]["line"])
    assert mig is not None and mig.fields["gi"] == "01" and mig.fields["ci"] == "00"
    gpu_at = parse_message(FORMATS["gpu_at"])
    assert gpu_at is not None and gpu_at.fields["uuid"].startswith("GPU-8a3e5c1f")


def test_userspace_killer_formats_only_from_their_identifier() -> None:
    for line in FORMATS["oomd"]:
        p = parse_message(line, KILLER_OOMD)
        assert p is not None and p.kind == "oomd" and p.fields["cgroup"].startswith("/")
        assert parse_message(line, KILLER_KERNEL) is None
    line = FORMATS["kills"][7]["lines"][1]
    p = parse_message(line, KILLER_EARLYOOM)
    assert p is not None and p.pid == 9301 and p.comm == "python3"
    assert parse_message(line, "sshd") is None  # only the killers' own identifiers count


def test_oom_prefix_not_anchored() -> None:
    # Proposed kernels prefix OOM lines (e.g. "OOM[12]: "); the summary/kill are searched for.
    p = parse_message(
        "OOM[12]: Memory cgroup out of memory: Killed process 77 (python3) total-vm:1kB, "
        "anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0"
    )
    assert p is not None and p.kind == "killed" and p.pid == 77


HOSTILE = [
    b"",
    b";",
    b"garbage without fields",
    b"6,1,2;",
    b"x,1,2,-;Killed process 1 (a) total-vm:1kB, anon-rss:1kB, file-rss:1kB",
    b"3,99999999999999999999999,1,-;Killed process 1",
    b"3,5,1,-;Killed process 99999999999 (python3) total-vm:1kB, anon-rss:1kB, file-rss:1kB",
    b"3,5,1,-;Memory cgroup out of memory: Killed process 12 (pyth",  # truncated
    b"6,6,1,-;oom-kill:constraint=CONSTRAINT_MEMCG,pid=,task=x",
    b"6,6,1,-;oom-kill:" + b"a=b," * 5000,
    b"4,7,1,-;NVRM: Xid (PCI:0000:3b:00): 999999999999, pid=1, name=x, y",
    b"\xff\xfe\x00\x01" * 1000,
    b"3,8,1,-;Killed process 1 (" + b")" * 100000 + b" total-vm:1kB",
    b"3,9,1,-;" + os.urandom(4096),
    b"4,10,1,c,extra;continuation \\x00 NVRM: Xid (PCI:zzzz:3b:00): 79",
    b"6,11,1,-;text\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0",
]


def test_hostile_records_never_raise_and_stay_fast() -> None:
    t0 = time.monotonic()
    for raw in HOSTILE:
        rec = parse_kmsg(raw)
        if rec is not None:
            for ident in (KILLER_KERNEL, KILLER_OOMD, KILLER_EARLYOOM):
                parse_message(rec.message, ident)
        parse_message(raw.decode("utf-8", "replace"))
    assert time.monotonic() - t0 < 2.0
    bad = parse_kmsg(b"3,5,1,-;Killed process 99999999999 (python3) total-vm:1kB, anon-rss:1kB, file-rss:1kB")
    assert bad is not None and parse_message(bad.message) is None  # pid > 10 digits
    dev = parse_kmsg(HOSTILE[-1])
    assert dev is not None and dev.message == "text"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_fuzz_kmsg_bytes(raw: bytes) -> None:
    rec = parse_kmsg(raw)
    if rec is not None:
        parse_message(rec.message)


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=400),
    st.sampled_from(["Killed process ", "oom-kill:", "NVRM: Xid (PCI:", "sending SIGKILL to "]),
    st.text(max_size=400),
)
def test_fuzz_messages_around_keywords(a: str, keyword: str, b: str) -> None:
    for ident in (KILLER_KERNEL, KILLER_EARLYOOM, KILLER_OOMD):
        parse_message(a + keyword + b, ident)


# --- /dev/kmsg, for real -------------------------------------------------------------------------


class Collector:
    def __init__(self) -> None:
        self.records: list[LogRecord] = []
        self.lock = threading.Lock()

    def __call__(self, rec: LogRecord) -> None:
        with self.lock:
            self.records.append(rec)


def start(src: KmsgSource, sink: Collector) -> threading.Thread:
    t = threading.Thread(target=src.run, args=(sink,), daemon=True)
    t.start()
    assert src.ready.wait(10), "kmsg source never caught up with the ring"
    return t


def wait_for(cond, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def test_spoofed_oom_line_from_userspace_is_ignored(tmp_path: Path) -> None:
    rejected: list[str] = []
    src = KmsgSource(str(tmp_path), on_reject=rejected.append)
    sink = Collector()
    t = start(src, sink)
    try:
        marker = f"gw-h4-spoof-{os.getpid()}-{time.time_ns()}"
        fake = (
            f"<0>Memory cgroup out of memory: Killed process 1 ({marker[:15]}) total-vm:1kB, "
            "anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0\n"
        )
        with open("/dev/kmsg", "w") as f:  # a real userspace write, even with <0> = KERN_EMERG
            f.write(fake)
        assert wait_for(lambda: "not_kernel" in rejected), "the spoofed record was never read"
        with sink.lock:
            assert not any(marker[:15] in r.message for r in sink.records)
        assert src.stats.rejected.get("not_kernel", 0) >= 1
    finally:
        src.stop()
        t.join(5)
    assert not t.is_alive()


def test_resume_after_restart_is_exact(tmp_path: Path) -> None:
    src = KmsgSource(str(tmp_path))
    first = Collector()
    t = start(src, first)
    src.stop()
    t.join(5)
    state = json.loads((tmp_path / "kmsg.json").read_text())
    assert state["boot_id"] == read_boot_id(HostPaths())
    assert first.records and state["seq"] >= max(r.seq or 0 for r in first.records)
    # A restart delivers nothing already delivered.
    src2 = KmsgSource(str(tmp_path))
    second = Collector()
    t2 = start(src2, second)
    src2.stop()
    t2.join(5)
    seen = {r.seq for r in first.records}
    assert not any(r.seq in seen for r in second.records)
    # A different boot id means a new boot: the whole ring is read again.
    (tmp_path / "kmsg.json").write_text(json.dumps({"boot_id": "other-boot", "seq": state["seq"]}))
    src3 = KmsgSource(str(tmp_path))
    third = Collector()
    t3 = start(src3, third)
    src3.stop()
    t3.join(5)
    assert {r.seq for r in third.records} >= seen


def test_corrupt_position_file_reads_from_start(tmp_path: Path) -> None:
    (tmp_path / "kmsg.json").write_bytes(b"\x00{not json")
    src = KmsgSource(str(tmp_path))
    assert src.load_position() is None
    (tmp_path / "kmsg.json").write_text(json.dumps({"boot_id": src.boot_id, "seq": -5}))
    assert src.load_position() is None


def ring_size() -> int:
    import ctypes

    n = int(ctypes.CDLL(None).klogctl(10, None, 0))  # SYSLOG_ACTION_SIZE_BUFFER
    assert n > 0
    return n


def test_kmsg_overrun_is_counted_and_reading_continues(tmp_path: Path) -> None:
    """Fill the ring past its size while the reader sleeps, with printk_devkmsg=on so that the
    userspace lines are not rate-limited; the next read() returns EPIPE, counted, not fatal."""
    knob = Path("/proc/sys/kernel/printk_devkmsg")
    old = knob.read_text().strip()
    overruns: list[int] = []
    src = KmsgSource(str(tmp_path), on_overrun=lambda: overruns.append(1))
    gate = threading.Event()
    sink = Collector()

    def slow(rec: LogRecord) -> None:
        sink(rec)
        gate.wait(30)  # the reader is stuck in the handler while the ring wraps

    t = threading.Thread(target=src.run, args=(slow,), daemon=True)
    t.start()
    # the reader holds /dev/kmsg open and sits in the handler before the flood: a reader that opens
    # only after the ring wrapped (a loaded machine) starts past the loss and sees no EPIPE
    assert wait_for(lambda: bool(sink.records), 10), "the reader read nothing"
    try:
        knob.write_text("on\n")
        tag = f"gw-h4-flood-{time.time_ns()}"
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, f"<6>{tag} start\n".encode())
            # every write() is one record (< 1 KiB); 4x the ring size (klogctl SIZE_BUFFER,
            # 128 KiB here, a few MiB at most elsewhere) is guaranteed to wrap it
            for i in range(4 * ring_size() // 800 + 1):
                os.write(fd, f"<7>{tag} {i} {'x' * 760}\n".encode())
        finally:
            os.close(fd)
    finally:
        knob.write_text(old + "\n")
        gate.set()
    assert wait_for(lambda: bool(overruns), 10), "no EPIPE after wrapping the ring"
    assert src.stats.overruns >= 1
    assert t.is_alive()  # still reading
    src.stop()
    t.join(5)
    assert not t.is_alive()


def test_open_kernel_log_modes(tmp_path: Path) -> None:
    paths = HostPaths()
    assert kl.open_kernel_log("off", paths, str(tmp_path)) is None
    # No journald on this host (no /run/systemd/journal/socket): auto falls back to /dev/kmsg.
    assert not journal_available(paths)
    assert isinstance(kl.open_kernel_log("auto", paths, str(tmp_path)), KmsgSource)
    assert isinstance(kl.open_kernel_log("journal", paths, str(tmp_path)), JournalSource)
    fake_root = tmp_path / "root"
    (fake_root / "run/systemd/journal").mkdir(parents=True)
    (fake_root / "run/systemd/journal/socket").touch()
    with_journald = HostPaths(rootfs=str(fake_root))
    assert journal_available(with_journald)
    assert isinstance(kl.open_kernel_log("auto", with_journald, str(tmp_path)), JournalSource)
    try:
        kl.open_kernel_log("kmsg", HostPaths(devfs=str(tmp_path)), str(tmp_path))
        raise AssertionError("missing /dev/kmsg must be reported")
    except kl.KernelLogUnavailable as e:
        assert "kmsg" in str(e)


def test_vmstat_reader(tmp_path: Path) -> None:
    assert isinstance(kl.read_vmstat_oom_kill(HostPaths()), int)
    (tmp_path / "vmstat").write_text("nr_free_pages 1\noom_kill 7\n")
    assert kl.read_vmstat_oom_kill(HostPaths(procfs=str(tmp_path))) == 7
