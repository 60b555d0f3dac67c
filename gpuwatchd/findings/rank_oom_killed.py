"""rank_oom_killed: a rank (or one of its workers) was killed by the kernel OOM killer,
systemd-oomd or earlyoom.

Reads the recent kernel events the kernel-log subsystem puts in ``ctx.parts.kernel.events``
(gpuwatchd/join/kernel_events.py) and the joined rank states (for the peers still alive). Pure; costs
nothing. Shell equivalent: ``dmesg -T | grep -i 'killed process'`` and matching the PID against the
launcher's rank map by hand.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import PAGE, Finding
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import scope_phrase
from gpuwatchd.units import fmt_bytes, fmt_clock

# A kill stays a finding for as long as the GPURankOOMKilled rule looks back (increase()[10m]),
# and for as long as the killed rank stays registered and dead.
ACTIVE_SECONDS = 600.0

_BY = {"kernel": "the kernel OOM killer", "systemd-oomd": "systemd-oomd", "earlyoom": "earlyoom"}


def _still_down(ctx: FindingContext, ev: Event) -> bool:
    return any(r.job_id == ev.job_id and str(r.rank) == ev.rank and not r.alive and r.pid == ev.pid for r in ctx.ranks)


def explain(ev: Event, peers_alive: int) -> str:
    f = ev.fields
    when = fmt_clock(ev.time)
    if ev.worker:
        who = (
            f"worker pid {ev.pid} ({ev.comm}) of rank {ev.rank} of job {ev.job_id} (rank pid {f.get('rank_pid', '?')})"
        )
    else:
        who = f"rank {ev.rank} of job {ev.job_id} (pid {ev.pid}, {ev.comm})"
    text = f"{who} was killed by {_BY.get(ev.killer, ev.killer)} at {when}"
    rss = f.get("rss_bytes")
    if isinstance(rss, int):
        text += f" holding {fmt_bytes(rss)} RSS"
    if f.get("memcg"):
        text += f" in memory cgroup {f['memcg']}"
    if ev.killer == "kernel":
        text += scope_phrase(
            str(f.get("scope", "")), str(f.get("constraint", "")), str(f.get("oom_memcg", "")), str(f.get("memcg", ""))
        )
    if peers_alive:
        text += f"; {peers_alive} peers alive: they will wait in their next collective"
    else:
        text += "; no peer of the job is alive on this node"
    if f.get("memory_snapshot_summary"):  # memory_evidence.py: what it was doing before
        text += f". Before the kill: {f['memory_snapshot_summary']}"
    return text


def _container_note(ctx: FindingContext, ev: Event) -> str:
    """ "; pid 1 in its container, Kubernetes pod UID" for a rank in a container (the kernel
    names host PIDs only)."""
    for r in ctx.ranks:
        if r.job_id == ev.job_id and str(r.rank) == ev.rank and (r.ns_pid is not None or r.container):
            inner = f"rank pid {r.ns_pid} in its container" if r.ns_pid is not None else ""
            return "; " + ", ".join(x for x in (inner, r.container) if x)
    return ""


def find(ctx: FindingContext) -> Iterable[Finding]:
    events: Iterable[Event] = ctx.parts.kernel.events
    for ev in events:
        if ev.kind != "oom_kill" or not ev.job_id:
            continue
        if ctx.now - ev.time > ACTIVE_SECONDS and not _still_down(ctx, ev):
            continue
        peers = sum(1 for r in ctx.ranks if r.job_id == ev.job_id and str(r.rank) != ev.rank and r.alive)
        yield Finding(
            kind="rank_oom_killed",
            severity=PAGE,
            explanation=explain(ev, peers) + _container_note(ctx, ev),
            job_id=ev.job_id,
            rank=ev.rank,
            pid=str(ev.pid) if ev.pid is not None else "",
            evidence={
                "killer": ev.killer,
                "comm": ev.comm,
                "worker": ev.worker,
                "time": ev.time,
                "rss_bytes": ev.fields.get("rss_bytes"),
                "memcg": ev.fields.get("memcg", ""),
                "peers_alive": peers,
                "event": ev.key,
                "memory_snapshot": ev.fields.get("memory_snapshot", ""),
            },
            since=ev.time,
        )
