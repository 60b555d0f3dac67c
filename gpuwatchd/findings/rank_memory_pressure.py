"""rank_memory_pressure: a rank is about to run out of host memory (before the OOM killer acts).

Raised (warning) when the working set of the memory cgroup that bounds a rank passes
``memory.ratio_threshold`` of its limit, or when its growth reaches the limit within
``memory.horizon_seconds``, or when the growth of the rank's whole tree would use up the node's
MemAvailable within the horizon. The explanation says when, in words and clock time.

Reads ``ctx.parts.memory.rank_memory`` (``RankMemory`` per live rank, memory_subsystem.py) and
``ctx.parts.memory.node``. Pure; costs nothing. Shell equivalent:
``cat /sys/fs/cgroup/memory/<path>/memory.{usage_in_bytes,limit_in_bytes}`` twice, a minute
apart, and dividing.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import WARNING, Finding, NodeMemoryState, RankMemory, RankProcess
from gpuwatchd.units import fmt_bytes, fmt_clock, fmt_duration

KIND = "rank_memory_pressure"


def _rate(bps: float) -> str:
    return f"{fmt_bytes(bps)}/s"


def assess(
    m: RankMemory, node: NodeMemoryState | None, ratio_threshold: float, horizon: float
) -> dict[str, float | str] | None:
    """What is wrong with ``m``, or None: reason (share | limit_trend | node_trend), the share
    of the limit, seconds to the limit or to the node's end."""
    out: dict[str, float | str] = {}
    if m.limit_bytes and m.working_set_bytes is not None:
        share = m.working_set_bytes / m.limit_bytes
        out["share"] = share
        g = m.cgroup_growth_bytes_per_second
        if g is not None and g > 0:
            out["seconds_to_limit"] = max(0.0, (m.limit_bytes - m.working_set_bytes) / g)
        if share >= ratio_threshold:
            out["reason"] = "share"
        elif float(out.get("seconds_to_limit", horizon + 1)) <= horizon:
            out["reason"] = "limit_trend"
    g_tree = m.tree_growth_bytes_per_second
    if "reason" not in out and node is not None and g_tree is not None and g_tree > 0:
        ttl = node.available_bytes / g_tree
        if ttl <= horizon:
            out.update(reason="node_trend", seconds_to_node_end=ttl)
    return out if "reason" in out else None


def explain(m: RankMemory, node: NodeMemoryState | None, a: dict[str, float | str], now: float) -> str:
    who = f"rank {m.rank} of job {m.job_id} (pid {m.pid})"
    if a["reason"] == "node_trend":
        ttl = float(a["seconds_to_node_end"])
        avail = fmt_bytes(node.available_bytes) if node else "unknown"
        return (
            f"{who}: its process tree grows {_rate(m.tree_growth_bytes_per_second or 0)} "
            f"(RSS {fmt_bytes(m.tree_rss_bytes)}) and the node has {avail} available: at this "
            f"rate the node runs out of memory in {fmt_duration(ttl)} "
            f"(~{fmt_clock(now + ttl)}), then the kernel "
            "OOM-kills the largest process"
        )
    share = float(a["share"])
    text = (
        f"{who} is at {share * 100:.0f} % of the {fmt_bytes(m.limit_bytes)} limit of memory "
        f"cgroup {m.cgroup[:200]} (working set {fmt_bytes(m.working_set_bytes)})"
    )
    g = m.cgroup_growth_bytes_per_second
    if "seconds_to_limit" in a and g:
        ttl = float(a["seconds_to_limit"])
        text += (
            f" and grows {_rate(g)}: it reaches the limit in {fmt_duration(ttl)} "
            f"(~{fmt_clock(now + ttl)}), then the kernel "
            "OOM-kills a process of the cgroup"
        )
    else:
        text += "; it is not growing, but little headroom is left before the kernel OOM-kills"
    if (
        m.high_bytes is not None and m.working_set_bytes is not None and m.working_set_bytes >= m.high_bytes
    ):  # cgroup v2: reclaim throttles it already
        text += f"; it is above its memory.high of {fmt_bytes(m.high_bytes)}: the kernel throttles it"
    return text


def find(ctx: FindingContext) -> Iterable[Finding]:
    readings: Iterable[RankMemory] = ctx.parts.memory.rank_memory
    node: NodeMemoryState | None = ctx.parts.memory.node
    cfg = ctx.config.memory
    # only ranks the join accepted (trust rules, PID reuse) and found alive
    live = {r.rank_process for r in ctx.ranks if r.alive}
    for m in readings:
        if RankProcess(m.job_id, m.rank, m.pid) not in live:
            continue
        a = assess(m, node, cfg.ratio_threshold, cfg.horizon_seconds)
        if a is None:
            continue
        yield Finding(
            kind="rank_memory_pressure",
            severity=WARNING,
            explanation=explain(m, node, a, ctx.now),
            job_id=m.job_id,
            rank=str(m.rank),
            pid=str(m.pid),
            evidence={
                **a,
                "cgroup": m.cgroup,
                "limit_bytes": m.limit_bytes,
                "working_set_bytes": m.working_set_bytes,
                "tree_rss_bytes": m.tree_rss_bytes,
                "growth_bytes_per_second": m.cgroup_growth_bytes_per_second
                if m.cgroup_growth_bytes_per_second is not None
                else m.tree_growth_bytes_per_second,
            },
        )
