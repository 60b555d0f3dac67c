"""gpu_lost: a GPU fell off the PCI bus, or NVML reports it lost.

Reads ``ctx.parts.gpu.gpus_removed`` (udev ``remove``/``unbind`` uevents of sources/udev.py, recorded by the
NVML subsystem's callback the moment they arrive, so the next cycle pages without waiting for NVML
to notice; kept until an ``add``/``bind`` of the same address) and ``ctx.parts.gpu.gpus_lost``
(NVML_ERROR_GPU_IS_LOST at this cycle's reading). One finding per node, since a finding's identity
has no GPU label: its explanation and evidence name every GPU gone. Pure; costs nothing.
Shell equivalent: ``udevadm monitor --kernel --subsystem-match=pci``; ``nvidia-smi -L``;
``dmesg -T | grep 'Xid 79'``.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import PAGE, Finding, GpuDevice, GpuUevent
from gpuwatchd.units import fmt_clock

ADVICE = "check 'dmesg' for Xid 79 and the node's hardware"


def lost_finding(ev: GpuUevent, gpu_index: str = "", uuid: str = "") -> Finding:
    """One GPU's udev removal (``gpu_index``/``uuid``: what NVML showed at its address)."""
    name = f"GPU {gpu_index} ({uuid}, PCI {ev.slot})" if gpu_index else f"GPU at PCI {ev.slot}"
    return Finding(
        kind="gpu_lost",
        severity=PAGE,
        explanation=(
            f"{name} disappeared from the PCI bus ({ev.action} uevent at "
            f"{fmt_clock(ev.timestamp)}); processes on "
            f"it will fail; {ADVICE}"
        ),
        evidence={"pci_bus_id": ev.slot, "action": ev.action, "gpu": gpu_index, "uuid": uuid},
        since=ev.timestamp,
    )


def nvml_lost_finding(index: int, known: GpuDevice | None, now: float) -> Finding:
    """NVML answered NVML_ERROR_GPU_IS_LOST for this GPU (it fell off the bus or hung)."""
    name = f"GPU {index}" + (f" ({known.uuid}, PCI {known.pci_bus_id})" if known else "")
    return Finding(
        kind="gpu_lost",
        severity=PAGE,
        explanation=(
            f"{name}: NVML reports the GPU is lost (NVML_ERROR_GPU_IS_LOST); its processes will fail; {ADVICE}"
        ),
        evidence={"gpu": str(index), "uuid": known.uuid if known else "", "source": "nvml"},
        since=now,
    )


def find(ctx: FindingContext) -> Iterable[Finding]:
    lost = [lost_finding(r.uevent, r.gpu_index, r.uuid) for r in ctx.parts.gpu.gpus_removed]
    lost += [nvml_lost_finding(g.index, g.known, g.seen_at) for g in ctx.parts.gpu.gpus_lost]
    if lost:
        yield Finding(
            kind="gpu_lost",
            severity=PAGE,
            explanation="; ".join(f.explanation for f in lost),
            evidence={"gpus": [dict(f.evidence) for f in lost]},
            since=min(f.since for f in lost),
        )
