"""Kernel log lines -> what they say: the pure parsers of /dev/kmsg records and of OOM-kill, Xid,
systemd-oomd and earlyoom messages, and the records the sources hand to the event processor.

No I/O. Bounded: a message is cut at ``MAX_MESSAGE`` before any regex runs. Line formats:
shared/research/gil-hang-oom.md §4; older formats in sources/kernel_formats.py; tested on the
recorded lines in tests/fixtures/kernel/.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.model.kernel import KILLER_EARLYOOM, KILLER_KERNEL, KILLER_OOMD, LogRecord, Parsed
from gpuwatchd.sources import kernel_formats

log = logging.getLogger(__name__)

# Parsing is bounded: kernel records are < 1 KiB (PRINTKRB_RECORD_MAX); anything longer is
# hostile or garbage and only its head can matter. Keeps every regex below linear-time in practice.
MAX_MESSAGE = 2048
KMSG_READ_SIZE = 16384  # a read() shorter than the record fails with EINVAL (dev-kmsg ABI doc)


# ---------------------------------------------------------------------------------------------
# Parsers (pure)
# ---------------------------------------------------------------------------------------------

KMSG = re.compile(
    r"^(?P<prio>\d{1,6}),(?P<seq>\d{1,20}),(?P<usec>\d{1,20}),(?P<flags>[^,;]*)[^;]*;(?P<msg>.*)$",
    re.DOTALL,
)
OOM_KILLED = re.compile(
    r"(?:(?P<kind>Out of memory|Memory cgroup out of memory|"
    r"Out of memory \(oom_kill_allocating_task\)): )?"
    # RHEL/CentOS 6 put ", UID U," before the comm, RHEL/CentOS 7 after it (Red Hat backports)
    r"Killed process (?P<pid>\d{1,10})(?:, UID (?P<uid_el6>\d{1,10}),)? \((?P<comm>[^\n]{0,64}?)\)"
    r"(?:, UID (?P<uid_el7>\d{1,10}),)? total-vm:(?P<total_vm_kb>\d+)kB, "
    r"anon-rss:(?P<anon_rss_kb>\d+)kB, file-rss:(?P<file_rss_kb>\d+)kB"
    r"(?:, shmem-rss:(?P<shmem_rss_kb>\d+)kB)?"
    r"(?:, UID:(?P<uid>\d+))?(?: pgtables:(?P<pgtables_kb>\d+)kB)?"
    r"(?: oom_score_adj:(?P<oom_score_adj>-?\d+))?"
)
OOM_KILL_OLD = re.compile(
    r"(?P<kind>Out of memory|Memory cgroup out of memory): Kill process (?P<pid>\d{1,10}) "
    r"\((?P<comm>[^\n]{0,64}?)\) score (?P<score>\d+) or sacrifice child"
)
OOM_SUMMARY = re.compile(r"oom-kill:(?P<kv>.*)$")
OOM_SUMMARY_SPLIT = re.compile(r",(?=[a-z_]+=)|,(?=global_oom)")
OOM_INVOKED = re.compile(
    r"^(?P<comm>.{0,64}?) invoked oom-killer: gfp_mask=(?P<gfp>[^,]+).*?order=(?P<order>-?\d+), "
    r"oom_score_adj=(?P<adj>-?\d+)"
)
OOM_REAPER = re.compile(
    r"^oom_reaper: reaped process (?P<pid>\d{1,10}) \((?P<comm>.{0,64}?)\), "
    r"now anon-rss:(?P<anon>\d+)kB"
)
OOM_TASK_IN = re.compile(r"^Task in (?P<task_memcg>\S+) killed as a result of limit of (?P<memcg>\S+)")
OOM_GROUP = re.compile(r"^Tasks in (?P<memcg>\S+) are going to be killed due to memory\.oom\.group set")
# 3.10 prints the statistics on the same line ("... for /kubepods/x: cache:32KB rss:...")
MEMCG_STATS = re.compile(r"^Memory cgroup stats for (?P<memcg>\S+?)(?::\s|:?$)")
XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\): (?P<xid>\d{1,5}), "
    r"(?:pid=(?P<pid>'<unknown>'|\d{1,10}), (?:name=(?P<name>.{0,256}?), )?)?(?P<rest>.*)$"
)
NVRM_GPU_AT = re.compile(
    r"NVRM: GPU at PCI:(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}): "
    r"(?P<uuid>GPU-[0-9a-fA-F-]{36})"
)
OOMD_KILLED = re.compile(r"^Killed (?P<cgroup>/\S*) due to (?P<reason>.*)$")
EARLYOOM_KILL = re.compile(
    r"^sending (?P<signal>SIG[A-Z]+) to process (?P<pid>\d{1,10}) uid (?P<uid>\d+) "
    r"\"(?P<comm>.{0,64}?)\": (?P<rest>.*)$"
)
# A user process's fatal fault, printed by the kernel before the signal kills it (show_signal_msg,
# arch/x86/mm/fault.c; do_trap / do_general_protection, arch/x86/kernel/traps.c), e.g.
#   python3[12977]: segfault at 1 ip 00007f4f84f74219 sp 00007ffd093c1a88 error 4 in libc.so.6[...]
#   traps: python3[13122] general protection fault ip:7f4092f74219 sp:7ffe3160f078 error:0 in ...
#   traps: python3[13163] trap invalid opcode ip:7ff361612000 sp:7ffd0d1f75f8 error:0 in ...
# (tests/fixtures/kernel/faults.txt, recorded on this project's VM, kernel 6.18). Ratelimited by
# the kernel (print_fatal_signals off: segfault lines only while show_unhandled_signals is 1).
SEGFAULT = re.compile(
    r"^(?P<comm>[^\n]{1,64}?)\[(?P<pid>\d{1,10})\]: (?P<what>segfault at [0-9a-fA-F]{1,16}) "
    r"ip (?P<ip>[0-9a-fA-F]{1,16}) sp [0-9a-fA-F]{1,16} error (?P<error>\d{1,3})"
    r"(?: (?:cpu \d+ )?in (?P<where>[^\s\[]{1,256}))?"
)
TRAP = re.compile(
    r"^traps: (?P<comm>[^\n]{1,64}?)\[(?P<pid>\d{1,10})\] (?P<what>general protection(?: fault)?|"
    r"trap [a-z0-9 ]{1,40}?) ip:(?P<ip>[0-9a-fA-F]{1,16}) sp:[0-9a-fA-F]{1,16} "
    r"error:(?P<error>[0-9a-fA-F]{1,8})(?: in (?P<where>[^\s\[]{1,256}))?"
)
EARLYOOM_RSS = re.compile(r"VmRSS (?P<mib>\d+) MiB")
# Message shapes that matter; a non-kernel record that looks like one of them is a spoof attempt.
INTERESTING = re.compile(
    r"Killed process|Kill process|oom-kill:|invoked oom-killer|NVRM: Xid|fallen off the bus|"
    r"segfault at |^traps: "
)


@dataclass(frozen=True)
class KmsgRecord:
    priority: int  # facility << 3 | level
    seq: int
    usec: int  # microseconds since boot (printk's local_clock)
    flags: str
    message: str

    @property
    def facility(self) -> int:
        return self.priority >> 3


def parse_kmsg(raw: bytes) -> KmsgRecord | None:
    """One /dev/kmsg record (``prio,seq,usec,flags;message`` plus ``\\n KEY=value`` lines)."""
    text = raw[: MAX_MESSAGE + 128].decode("utf-8", "replace")
    head, _, _dict = text.partition("\n")  # device dictionary lines follow the first newline
    m = KMSG.match(head)
    if m is None:
        return None
    return KmsgRecord(
        priority=int(m["prio"]),
        seq=int(m["seq"]),
        usec=int(m["usec"]),
        flags=m["flags"],
        message=m["msg"][:MAX_MESSAGE],
    )


def parse_message(message: str, identifier: str = KILLER_KERNEL) -> Parsed | None:
    """Recognise one kernel (or userspace killer) log message; None when it is not one we need."""
    msg = message[:MAX_MESSAGE].rstrip("\n")
    if identifier == KILLER_OOMD:
        m = OOMD_KILLED.match(msg)
        if m:
            return Parsed("oomd", fields={"cgroup": m["cgroup"], "reason": m["reason"][:256]})
        return None
    if identifier == KILLER_EARLYOOM:
        m = EARLYOOM_KILL.match(msg)
        if m:
            rss = EARLYOOM_RSS.search(m["rest"])
            f = {"signal": m["signal"], "uid": m["uid"]}
            if rss:
                f["rss_kb"] = str(int(rss["mib"]) * 1024)
            return Parsed("earlyoom", pid=int(m["pid"]), comm=m["comm"], fields=f)
        old = kernel_formats.parse_earlyoom_old(msg)
        if old is not None:
            victim, name, signal, rss_kb = old
            f = {"signal": signal} if rss_kb is None else {"signal": signal, "rss_kb": str(rss_kb)}
            return Parsed("earlyoom", pid=victim, comm=name, fields=f)
        return None
    if identifier != KILLER_KERNEL:
        return None
    if "NVRM" in msg:
        m = XID.search(msg)
        if m:
            pid = m["pid"]
            f = {k: v for k, v in m.groupdict().items() if v is not None and k != "pid"}
            f["pci"] = m["pci"].lower()
            return Parsed(
                "xid",
                pid=int(pid) if pid and pid.isdigit() else None,
                comm=(m["name"] or "").strip("'"),
                fields=f,
            )
        m = NVRM_GPU_AT.search(msg)
        if m:
            return Parsed("gpu_at", fields={"pci": m["pci"].lower(), "uuid": m["uuid"]})
        lost = kernel_formats.parse_bus_lost(msg)
        if lost is not None:
            kind, pci, pci_id = lost
            return Parsed(kind, fields={"pci": pci, "pci_id": pci_id, "rest": msg[:400]})
        return None
    if "segfault at " in msg or msg.startswith("traps: "):
        m = SEGFAULT.match(msg) or TRAP.match(msg)
        if m:
            f = {"what": m["what"], "ip": m["ip"], "error": m["error"], "where": m["where"] or ""}
            return Parsed("fault", pid=int(m["pid"]), comm=m["comm"], fields=f)
        return None
    if "ill" in msg:  # cheap pre-filter: Killed / Kill / oom-kill / killer
        m = OOM_KILLED.search(msg)
        if m:
            f = {k: v for k, v in m.groupdict().items() if v is not None}
            uid_el6, uid_el7 = f.pop("uid_el6", None), f.pop("uid_el7", None)
            uid = uid_el6 or uid_el7
            if uid is not None:
                f.setdefault("uid", uid)
            return Parsed("killed", pid=int(m["pid"]), comm=m["comm"], fields=f)
        m = OOM_SUMMARY.search(msg)
        if m:
            kv: dict[str, str] = {}
            for part in OOM_SUMMARY_SPLIT.split(m["kv"]):
                k, eq, v = part.partition("=")
                kv[k] = v if eq else "1"
            pid_s = kv.get("pid", "")
            if not pid_s.isdigit() or len(pid_s) > 10:
                return None
            return Parsed("summary", pid=int(pid_s), comm=kv.get("task", ""), fields=kv)
        m = OOM_KILL_OLD.search(msg)
        if m:
            return Parsed("kill_old", pid=int(m["pid"]), comm=m["comm"], fields={"kind": m["kind"]})
        m = OOM_INVOKED.match(msg)
        if m:
            return Parsed("invoked", comm=m["comm"], fields={"order": m["order"], "gfp": m["gfp"]})
        m = OOM_TASK_IN.match(msg)
        if m:
            return Parsed("task_in", fields={"task_memcg": m["task_memcg"], "memcg": m["memcg"]})
        m = OOM_GROUP.match(msg)
        if m:
            return Parsed("oom_group", fields={"memcg": m["memcg"]})
    m = OOM_REAPER.match(msg)
    if m:
        f = {"anon_rss_kb": m["anon"]}
        return Parsed("reaper", pid=int(m["pid"]), comm=m["comm"], fields=f)
    if msg.startswith("Memory cgroup stats for "):
        m = MEMCG_STATS.match(msg)
        if m:
            return Parsed("memcg_stats", fields={"memcg": m["memcg"]})
    return None


# ---------------------------------------------------------------------------------------------
# Records handed to the event processor
# ---------------------------------------------------------------------------------------------


class SourceStats:
    """What a source counts about itself (thread-safe enough: ints updated by one thread)."""

    def __init__(self) -> None:
        self.records = 0
        self.overruns = 0  # EPIPE: the ring wrapped before we read; records were lost
        self.rejected: dict[str, int] = {}
        self.last_error = ""

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


Handler = Callable[[LogRecord], None]
RejectHandler = Callable[[str], None]
