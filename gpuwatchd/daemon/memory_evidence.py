"""Evidence kept while memory runs short: a ``memory_snapshot`` event per raise / worsening of
``rank_memory_pressure``, so that an OOM kill that follows (which destroys the rank and with it
any chance to ask what it was doing) can point at what the rank was doing and which of its
processes held and gained the memory.

A snapshot is one event in ``state_dir/events.jsonl``: a non-blocking ``py-spy dump`` of the rank
process (the frame it was in, and up to ``MAX_THREADS`` threads of ``MAX_FRAMES`` frames), the
``TOP_PROCESSES`` largest growers of its tree, and the cgroup numbers. A new one is taken when the
headroom or the time left has halved since the last. Bounded: per rank process at most
``memory.snapshots_per_rank``, at least ``memory.snapshot_min_interval_seconds`` apart, one
py-spy dump at a time (a second request while one runs is dropped); the event log's compaction
bounds the total.

Summary, e.g.: "at 14:21:50, at 93 % of 80.0 GiB, rank 3 was in load_shard (data.py:88); worker
48222 (pt_data_worker) had grown 9.0 GiB in 5 min".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuwatchd.model import INFO, Finding, RankMemory, frozen_map
from gpuwatchd.model.events import Event
from gpuwatchd.model.threads import ThreadStack
from gpuwatchd.units import fmt_bytes, fmt_clock, fmt_span

MAX_THREADS = 4
MAX_FRAMES = 12
KIND = "memory_snapshot"


def _thread_of_interest(stacks: Sequence[ThreadStack]) -> ThreadStack | None:
    """The GIL owner, else a running thread, else the first (main) thread with frames."""
    with_frames = [s for s in stacks if s.frames]
    for pick in (lambda s: s.owns_gil, lambda s: s.active, lambda s: True):
        for s in with_frames:
            if pick(s):
                return s
    return None


def snapshot_event(
    f: Finding,
    m: RankMemory,
    at: float,
    stacks: Sequence[ThreadStack] | None,
    stack_error: str,
    seq: int,
) -> Event:
    """The snapshot of one rank at ``at``; ``stacks`` None when py-spy failed (``stack_error``)."""
    share = f.evidence.get("share")
    limit = f" of {fmt_bytes(m.limit_bytes)}" if m.limit_bytes else ""
    level = (
        f"at {float(share) * 100:.0f} %{limit}"
        if isinstance(share, float)
        else f"with {fmt_bytes(m.tree_rss_bytes)} RSS in its tree"
    )
    words = f"at {fmt_clock(at)}, {level}, rank {m.rank}"
    chosen = _thread_of_interest(stacks or ())
    if chosen is not None:
        words += f" was in {str(chosen.frames[0])[:160]}"
    else:
        words += f" (stack unavailable: {stack_error or 'no Python frames'})"
    growers = [p for p in m.top if p.gained_bytes > 0]
    if growers:
        g = growers[0]
        who = f"worker {g.pid} ({g.comm})" if g.worker else f"the rank process {g.pid}"
        words += f"; {who} had grown {fmt_bytes(g.gained_bytes)} in {fmt_span(g.over_seconds)}"
    threads: list[dict[str, Any]] = [
        {
            "tid": s.tid,
            "name": s.name[:64],
            "owns_gil": s.owns_gil,
            "active": s.active,
            "frames": [str(fr)[:200] for fr in s.frames[:MAX_FRAMES]],
        }
        for s in list(stacks or ())[:MAX_THREADS]
    ]
    return Event(
        key=f"memory_snapshot:{m.job_id}:{m.rank}:{m.pid}:{at:.3f}:{seq}",
        kind=KIND,
        time=at,
        severity=INFO,
        summary=words,
        job_id=m.job_id,
        rank=str(m.rank),
        pid=m.pid,
        fields=frozen_map(
            {
                "finding": f.explanation[:400],
                "share": share,
                "seconds_to_limit": f.evidence.get("seconds_to_limit"),
                "cgroup": m.cgroup,
                "limit_bytes": m.limit_bytes,
                "working_set_bytes": m.working_set_bytes,
                "tree_rss_bytes": m.tree_rss_bytes,
                "where": str(chosen.frames[0]) if chosen is not None else "",
                "threads": threads,
                "stack_error": stack_error[:200],
                "processes": [
                    {
                        "pid": p.pid,
                        "comm": p.comm,
                        "rss_bytes": p.rss_bytes,
                        "gained_bytes": p.gained_bytes,
                        "over_seconds": round(p.over_seconds, 1),
                        "worker": p.worker,
                    }
                    for p in m.top
                ],
            }
        ),
    )


def worse(f: Finding, last: Finding) -> bool:
    """Worth a new snapshot: the headroom left below the limit halved, or the time left halved.
    Halving keeps the count small (logarithmic) and puts the last snapshots close to the kill."""
    s, s0 = f.evidence.get("share"), last.evidence.get("share")
    if isinstance(s, float) and isinstance(s0, float) and 1.0 - s <= (1.0 - s0) / 2:
        return True
    for key in ("seconds_to_limit", "seconds_to_node_end"):
        t, t0 = f.evidence.get(key), last.evidence.get(key)
        if isinstance(t, float) and isinstance(t0, float) and t < t0 / 2:
            return True
    return False
