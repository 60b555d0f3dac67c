"""Kernel and killer log formats beyond the mainline ones in kernel_log.py (pure parsers).

Each format here was missed before and is tested on lines from public reports
(tests/fixtures/kernel/README.md names the source of each):

- earlyoom before 1.6 (no ``uid``): ``sending SIGTERM to process N "comm": badness B, VmRSS R MiB``
  (1.3-1.5), ``killing process N "comm" with signal 15: badness B, VmRSS R MiB`` (1.2) and
  ``Killing process 'comm' with signal 15, pid: N, badness: B, VmRSS: R MiB`` (1.1);
- a GPU that fell off the bus, reported by the NVIDIA driver without an Xid number: at probe time
  (``NVRM: The NVIDIA GPU 0000:b3:00.0`` / ``NVRM: (PCI ID: 10de:26b5) installed in this system
  has`` / ``NVRM: fallen off the bus and is not responding to commands.``, one record with embedded
  newlines, escaped as ``\\x0a`` in /dev/kmsg; older kernels store one record per line) and from
  ``NV_DEV_PRINTF`` (``NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.``).

The RHEL/CentOS 6-7 ``Killed process N (comm), UID U, ...`` forms and the pre-4.19 scope on the
``Kill process ... or sacrifice child`` line are handled where the mainline kill line is parsed
(kernel_log.OOM_KILLED, kernel_events.KillGrouper). Cost: one or two bounded regexes per record
that already passed kernel_log's cheap keyword checks.
"""

from __future__ import annotations

import re

# (pid, comm, signal name, rest) of the three pre-1.6 earlyoom kill lines
EARLYOOM_NO_UID = re.compile(
    r"^sending (?P<signal>SIG[A-Z]+) to process (?P<pid>\d{1,10}) \"(?P<comm>.{0,64}?)\": (?P<rest>.*)$"
)
EARLYOOM_1_2 = re.compile(
    r"^killing process (?P<pid>\d{1,10}) \"(?P<comm>.{0,64}?)\" with signal (?P<signo>\d{1,2}): "
    r"(?P<rest>.*)$"
)
EARLYOOM_1_1 = re.compile(
    r"^Killing process '(?P<comm>.{0,64}?)' with signal (?P<signo>\d{1,2}), pid: (?P<pid>\d{1,10}), "
    r"(?P<rest>.*)$"
)
EARLYOOM_RSS_ANY = re.compile(r"VmRSS:? (?P<mib>\d{1,12}) MiB")
SIGNALS = {"9": "SIGKILL", "15": "SIGTERM"}

_PCI = r"(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?"
# One record (embedded newlines, or their \x0a escapes from /dev/kmsg) naming the GPU and the loss.
BUS_LOST = re.compile(r"NVRM: (?:The NVIDIA )?GPU " + _PCI + r"(?P<rest>.{0,400}?)fallen off the bus", re.DOTALL)
# The split form of older kernels: the GPU on one record, the loss on a later one.
GPU_NAMED = re.compile(r"NVRM: The NVIDIA GPU " + _PCI + r"(?:\s|$)")
BUS_LOST_ALONE = re.compile(r"fallen off the bus and is not responding to commands")
PCI_ID = re.compile(r"PCI ID: (?P<id>[0-9a-fA-F]{4}:[0-9a-fA-F]{4})")


def parse_earlyoom_old(msg: str) -> tuple[int, str, str, int | None] | None:
    """(pid, comm, signal, rss kB or None) of a pre-1.6 earlyoom kill line, else None."""
    m = EARLYOOM_NO_UID.match(msg)
    if m:
        signal = m["signal"]
    else:
        m = EARLYOOM_1_2.match(msg) or EARLYOOM_1_1.match(msg)
        if m is None:
            return None
        signal = SIGNALS.get(m["signo"], f"signal {m['signo']}")
    rss = EARLYOOM_RSS_ANY.search(m["rest"])
    return int(m["pid"]), m["comm"], signal, int(rss["mib"]) * 1024 if rss else None


def parse_bus_lost(msg: str) -> tuple[str, str, str] | None:
    """("bus_lost" | "gpu_named", pci "0000:b3:00" or "", PCI id "10de:26b5" or "") of an NVRM
    record that says a GPU fell off the bus without an Xid number; None for anything else."""
    if "fallen off the bus" in msg:
        m = BUS_LOST.search(msg)
        pci_id = PCI_ID.search(msg)
        ident = pci_id["id"].lower() if pci_id else ""
        if m:
            return "bus_lost", m["pci"].lower(), ident
        if BUS_LOST_ALONE.search(msg):
            return "bus_lost", "", ident
        return None
    m = GPU_NAMED.search(msg)
    if m:
        return "gpu_named", m["pci"].lower(), ""
    return None
