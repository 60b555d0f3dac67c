"""orphan_gpu_memory: GPU memory held by a process that belongs to no live rank.

Input: ``ctx.parts.gpu.orphans`` (decided by ``gpuwatchd.join.orphans.OrphanTracker`` after the grace period),
``ctx.processes`` for the holder's age, ``ctx.parts.gpu.orphan_jobs`` (pid -> the job it belonged to
while that job was alive). Shell equivalent: ``nvidia-smi --query-compute-apps=pid,used_memory
--format=csv; ps -o pid,ppid,user,etime,comm -p PID``.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import DEFUNCT, JOB_ENDED, REPARENTED, UNREGISTERED, WARNING, Finding, Orphan
from gpuwatchd.units import fmt_age, fmt_bytes

_WHY = {
    REPARENTED: "its parent died and it was adopted by init",
    JOB_ENDED: "its job has no live rank any more",
    UNREGISTERED: "no registered rank on this node claims it",
    DEFUNCT: "the process is gone or a zombie, yet NVML still reports its memory",
}


def describe(o: Orphan, ctx: FindingContext) -> str:
    proc = ctx.processes.get(o.pid)
    age = f", running {fmt_age(ctx.now - proc.start_time)}" if proc is not None else ""
    who = f"{o.comm or '?'}, user {o.user or '?'}{age}"
    job = ctx.parts.gpu.orphan_jobs.get(o.pid)
    why = _WHY.get(o.reason, o.reason)
    if job and o.reason in (REPARENTED, JOB_ENDED):
        why += f" (it belonged to job {job})"
    return (
        f"PID {o.pid} ({who}) holds {fmt_bytes(o.used_memory_bytes)} on GPU {o.gpu_index} "
        f"({o.uuid}) and belongs to no live job: {why}; stale for "
        f"{fmt_age(ctx.now - o.first_seen)}"
    )


def find(ctx: FindingContext) -> Iterable[Finding]:
    # One finding per PID (the finding's identity is kind+pid), naming every GPU it holds.
    by_pid: dict[int, list[Orphan]] = {}
    for o in ctx.parts.gpu.orphans:
        by_pid.setdefault(o.pid, []).append(o)
    for pid, held in sorted(by_pid.items()):
        first = held[0]
        yield Finding(
            kind="orphan_gpu_memory",
            severity=WARNING,
            pid=str(pid),
            explanation="; ".join(describe(o, ctx) for o in held),
            evidence={
                "gpus": [o.gpu_index for o in held],
                "uuids": [o.uuid for o in held],
                "used_memory_bytes": [o.used_memory_bytes for o in held],
                "reason": first.reason,
                "comm": first.comm,
                "user": first.user,
            },
            since=min(o.first_seen for o in held),
        )
