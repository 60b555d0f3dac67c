"""xid_critical: a GPU reported an Xid that means broken hardware, memory or links.

Reads the recent kernel events the kernel-log subsystem puts in ``ctx.parts.kernel.events``
(``NVRM: Xid`` lines, gpuwatchd/join/kernel_events.py). Pure; costs nothing. Shell equivalent:
``dmesg -T | grep 'NVRM: Xid'`` and the NVIDIA Xid catalog.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import PAGE, Finding
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import CRITICAL_XIDS
from gpuwatchd.units import fmt_clock, fmt_time

# As long as the GPUXidCritical rule looks back (increase()[10m]).
ACTIVE_SECONDS = 600.0


def find(ctx: FindingContext) -> Iterable[Finding]:
    events: Iterable[Event] = ctx.parts.kernel.events
    latest: dict[tuple[str, int], Event] = {}
    for ev in events:
        xid = ev.fields.get("xid")
        if ev.kind != "xid" or not isinstance(xid, int) or xid not in CRITICAL_XIDS:
            continue
        if ctx.now - ev.time > ACTIVE_SECONDS:
            continue
        latest[(str(ev.fields.get("pci", "")), xid)] = ev  # one finding per GPU and Xid
    for (pci, xid), ev in sorted(latest.items()):
        gpu = ev.fields.get("gpu", "")
        on = [r for r in ctx.ranks if r.alive and gpu != "" and str(gpu) in r.gpus]
        text = ev.summary.replace(fmt_time(ev.time), fmt_clock(ev.time))
        if on:
            text += "; ranks on this GPU: " + ", ".join(f"{r.job_id}/{r.rank}" for r in on)
        yield Finding(
            kind="xid_critical",
            severity=PAGE,
            explanation=text,
            job_id=ev.job_id,
            rank=ev.rank,
            pid=str(ev.pid) if ev.pid is not None else "",
            evidence={"xid": xid, "pci": pci, "gpu": gpu, "uuid": ev.fields.get("uuid", ""), "event": ev.key},
            since=ev.time,
        )
