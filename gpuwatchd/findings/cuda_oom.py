"""cuda_oom: a rank hit CUDA out-of-memory; who else held memory on that GPU.

Reads ``ctx.parts.gpu.cuda_ooms``: the events the ranks' hook wrote (rank/cuda_oom.py), attributed by the
join at the cycle that read them (join/cuda_oom.py: host PID, GPU index, each co-tenant's job and
rank or why it is an orphan, as they were then) and kept there ``FINDING_SECONDS`` after the
error. One warning per job, rank and PID, its ``since`` the moment of the error. Pure; costs one
sort of the co-tenants. Shell equivalent: ``nvidia-smi --query-compute-apps=pid,used_memory
--format=csv`` at the moment of the error.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import WARNING, Finding
from gpuwatchd.model.cuda_oom import AttributedOom, CoTenant

REASON_TEXT = {
    "reparented_to_init": "its parent died and it was adopted by init",
    "job_ended": "its job has ended",
    "unregistered": "claimed by no registered rank",
    "defunct": "gone or a zombie",
}


def _fmt(n: float | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _tenant_text(t: CoTenant) -> str:
    if t.job_id:
        whose = f"rank {t.rank} of job {t.job_id}"
    else:
        reason = t.orphan_reason
        whose = "not in any job" + (f", {REASON_TEXT.get(reason, reason)}" if reason else "")
    name = f"{t.comm}, " if t.comm else ""
    return f"PID {t.pid} ({name}{whose}) held {_fmt(t.used_memory_bytes)} there"


def oom_finding(oom: AttributedOom) -> Finding:
    """The finding of one attributed event: the rank, the GPU, what it asked for, and each other
    process on that GPU, largest holder first."""
    ev = oom.event
    others = [t for t in sorted(oom.co_tenants, key=lambda t: -(t.used_memory_bytes or 0)) if t.pid != ev.pid]
    where = f"GPU {oom.gpu}" if oom.gpu else f"GPU {ev.device_uuid or '?'}"
    ask = f" (tried to allocate {_fmt(ev.requested_bytes)})" if ev.requested_bytes else ""
    in_ctr = f" ({oom.ns_pid} in its container)" if oom.ns_pid is not None else ""
    head = f"rank {ev.rank} of job {ev.job_id} (pid {ev.pid}{in_ctr}) hit CUDA OOM on {where}{ask}"
    tail = "; ".join(_tenant_text(t) for t in others) if others else "no other process held memory there"
    return Finding(
        kind="cuda_oom",
        severity=WARNING,
        explanation=f"{head}; {tail}",
        job_id=ev.job_id,
        rank=str(ev.rank),
        pid=str(ev.pid),
        evidence={
            "gpu": oom.gpu,
            "uuid": ev.device_uuid,
            "requested_bytes": ev.requested_bytes,
            "co_tenants": [{"pid": t.pid, "used_memory_bytes": t.used_memory_bytes} for t in others],
        },
        since=ev.timestamp,
    )


def find(ctx: FindingContext) -> Iterable[Finding]:
    return [oom_finding(o) for o in ctx.parts.gpu.cuda_ooms]
