"""What the stall tracker's verdicts say beyond one rank (its values, ``RankProbe`` and
``StallVerdict``, are in model/stall.py): how a stalled rank's threads read, and the odd one out
of a job's ranks.

Pure, no I/O, no memory across cycles: ``name_suspects`` compares one cycle's verdicts of the
ranks of each job (cost linear in their number). ``join/stall.py`` holds the tracker itself.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace

from gpuwatchd.model import RankId
from gpuwatchd.model.stall import HangAnalysis, StallVerdict
from gpuwatchd.model.threads import ThreadInfo, ThreadStack
from gpuwatchd.units import fmt_span

log = logging.getLogger(__name__)


def main_stack(stacks: Iterable[ThreadStack]) -> ThreadStack | None:
    """The thread a human looks at first: MainThread, else the GIL owner, else the first."""
    stacks = tuple(stacks)
    for s in stacks:
        if s.name == "MainThread":
            return s
    for s in stacks:
        if s.owns_gil:
            return s
    return stacks[0] if stacks else None


def summarize_threads(threads: Iterable[ThreadInfo], spinning: Iterable[int] = ()) -> str:
    """``5 threads: 4 S futex_do_wait, 1 R``; plus which burn CPU."""
    threads = tuple(threads)
    kinds = collections.Counter(f"{t.state} {t.wchan}".strip() for t in threads)
    text = f"{len(threads)} threads: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common(4))
    spin = tuple(spinning)
    if spin:
        text += f"; {len(spin)} burning CPU"
    return text


# a thread that used at least this share of a core between two looks burns it (stall.SPIN_SHARE),
# one below WORK_SHARE did no work (stall.WORK_SHARE)
SPIN_SHARE = 0.9
WORK_SHARE = 0.05
# where a rank's wait may be for a peer of its job: a collective or barrier, the GPU (an NCCL
# kernel waits for its peers there), or a kernel that never ends (confirmed by the GPU)
PEER_WAITS = frozenset({"collective", "gpu_wait", "native_spin"})
# the conclusive shapes of one rank alone; a peer's progress does not explain them
OWN_SHAPES = frozenset({"deadlock", "gil"})


def gil_holder(analysis: HangAnalysis) -> bool:
    """In the analysed dump a thread other than the main one holds the GIL and burns a core,
    while the main thread did no work since the last look and waits for neither a queue nor a
    thread: the main thread waits for the GIL (a catastrophic regex, one C call that never lets
    it go). The tracker adds that the same thread held it at the same line, the main thread at
    the same place, in every dump over the bound (join/stall_track.py GilWatch.since)."""
    main = next((t for t in analysis.threads if t.name == "MainThread"), None)
    holder = next((t for t in analysis.threads if t.owns_gil), None)
    if main is None or holder is None or holder is main:
        return False
    return (
        (holder.cpu_share or 0.0) >= SPIN_SHARE
        and (main.cpu_share or 0.0) < WORK_SHARE
        and main.kind not in ("idle", "queue", "join")
    )


def waits_on(v: StallVerdict) -> str:
    """Where a rank waits that may be for a peer of its job, in words ("barrier"), else ""."""
    if v.confirmed_by == "gpu_spin" or v.conclusive == "gpu_spin":
        return "a kernel that never ends on its GPU"
    if v.analysis is None:
        return ""
    for t in v.analysis.threads:
        if t.kind == "collective":
            return t.waits_on.removeprefix("collective ")
    if set(v.analysis.kinds) & PEER_WAITS:
        return "its GPU"
    return ""


def _in_collective(v: StallVerdict) -> bool:
    return (v.analysis is not None and "collective" in v.analysis.kinds) or v.conclusive == "gpu_spin"


def _stuck_elsewhere(v: StallVerdict) -> bool:
    """Still outside a collective, its main thread blocked (on a lock, or asleep where nothing
    says it waits for work: not idle in a queue, a select or ``Event.wait``, where a DataLoader's
    busy workers or a slow socket may still deliver, unless its workers are dead or stopped:
    ``starved``), with none of its Python threads burning a core (the ambiguous spin,
    join/stall_spin.py) or in uninterruptible I/O (D: a checkpoint to a slow filesystem)."""
    a = v.analysis
    if a is None or _in_collective(v) or v.stopped_seconds is not None:
        return False
    main = next((t for t in a.threads if t.name == "MainThread"), None)
    if main is None or (main.kind not in ("lock", "waiting") and "starved" not in a.kinds):
        return False
    return not any((t.cpu_share or 0.0) >= SPIN_SHARE or t.state == "D" for t in a.threads)


def judge_jobs(verdicts: Mapping[RankId, StallVerdict], now: float, conclusive: float,
               fresh: float) -> dict[RankId, StallVerdict]:  # fmt: skip
    """The job's view of each rank's verdict (ranks of one job on this node, linear in them).

    - A rank stalled while it waits where a peer may hold it (a collective, the GPU: PEER_WAITS),
      and not in a shape of its own (OWN_SHAPES), is not stalled while a peer of its job
      progresses (its verdict saw progress within ``fresh`` seconds: a heartbeat, work on its CPU
      or GPU, a new stack), is ambiguous, or is not judged yet (alive, not stalled). Its
      ``waits_for`` says for whom and what that peer does.
    - Conclusive with the peers, once proven still for ``conclusive`` seconds: a rank stopped
      (state T) while a peer runs; a rank whose peer is dead; the odd one out of a collective (a
      rank still elsewhere, ``_stuck_elsewhere``, while a peer waits in the collective and none
      progresses) and the ranks that wait for it.
    """
    out = dict(verdicts)
    jobs: dict[str, list[StallVerdict]] = collections.defaultdict(list)
    for v in verdicts.values():
        jobs[v.job_id].append(v)
    for ranks in jobs.values():
        if len(ranks) < 2:
            continue
        progressing = [v for v in ranks if v.alive and not v.stalled and not v.ambiguous
                       and v.stopped_seconds is None and v.doing
                       and v.progress_timestamp is not None
                       and now - v.progress_timestamp <= fresh]  # fmt: skip
        # a peer that burns a core at one line with nothing to confirm a hang (its own verdict
        # is ambiguous: rank_stall_unconfirmed): a rank 0 evaluating on the GPU with .item() per
        # batch looks so (seen on the H100: its waiting peer was paged 8 s into the barrier)
        unsure = [v for v in ranks if v.alive and not v.stalled and v.ambiguous
                  and v.stopped_seconds is None]  # fmt: skip
        dead = [v for v in ranks if not v.alive]
        held = [v for v in ranks if v.alive and not v.stalled and v.still_seconds >= conclusive]
        waiting = [v for v in ranks if v.alive and (v.stalled or v.still_seconds >= conclusive)
                   and _in_collective(v)]  # fmt: skip
        odd = [v for v in held if _stuck_elsewhere(v)] if waiting and not progressing else []
        # a peer alive and not stalled, neither progressing nor ambiguous, nor the odd one out:
        # its own verdict is not in yet (still for less than after_seconds), so the job has not
        # been still for after_seconds and a rank waiting for it waits for that verdict (the
        # H100: rank 0 evaluating alone, its .item() loop not yet judged, and rank 1 paged 12 s
        # into the barrier at after_seconds 8). The delay is bounded by the peer's own bound.
        # Not a peer that waits in a collective itself (it waits too, maybe for a rank on
        # another node), and never against a conclusive verdict: a pending peer excused the
        # H100's GPU_SLEEP rank, "a kernel that never ends", while rank 0 waited in all_reduce.
        # Membership by identity (a job's verdicts are distinct objects, one per rank), not the
        # dataclass's field-by-field __eq__, and each rank's peers listed only where they decide:
        # "v in list" and a peer list per rank made each job quadratic in its ranks (64 beating
        # ranks of one job: 2.3 ms a cycle on the 2-core VM, 0.08 ms so)
        skip = {id(v) for v in progressing} | {id(v) for v in odd}
        pending = [v for v in ranks if v.alive and not v.stalled and not v.ambiguous
                   and v.stopped_seconds is None and id(v) not in skip
                   and not _in_collective(v)]  # fmt: skip
        held_ids, odd_ids, waiting_ids = {id(v) for v in held}, {id(v) for v in odd}, {id(v) for v in waiting}
        for v in ranks:
            if not v.alive:
                continue
            # the peers only where they decide (a stalled rank waiting where a peer may hold it)
            where = waits_on(v) if v.stalled and v.conclusive not in OWN_SHAPES else ""
            peers = [p for p in progressing if p.rank != v.rank] if where else []
            maybe = (
                [p for p in unsure + (pending if not v.conclusive else []) if p.rank != v.rank]
                if where and not peers
                else []
            )
            if v.stalled and (peers or maybe) and where and v.conclusive not in OWN_SHAPES:
                if peers:
                    p = min(peers, key=lambda x: x.rank)
                    doing = p.doing
                else:  # ambiguous or not judged yet, so this one is not paged either
                    p = min(maybe, key=lambda x: x.rank)
                    doing = ("burns a core at one line: a loop that syncs its GPU every step, or "
                             "a hang nothing confirms yet (its rank_stall_unconfirmed)") \
                        if p.ambiguous else (
                        f"has made no progress for {fmt_span(now - (p.progress_timestamp or now))}, not proven "
                        f"stuck yet (its own verdict comes at after_seconds)")  # fmt: skip
                words = (
                    f"rank {v.rank} waits in {where} for rank {p.rank}, which {doing}; "
                    f"waiting for {fmt_span(v.no_progress_seconds)}"
                )
                out[v.key] = replace(v, stalled=False, ambiguous=False, conclusive="", confirmed_by="", waits_for=words)
                # a stalled (or conclusive) verdict held back by its peers: why a page came late
                log.debug("stall excused: pid %d (%s): %s", v.pid, v.conclusive or "stalled", words)
                continue
            if v.stalled:
                continue
            why = ""
            if (
                v.stopped_seconds is not None
                and v.stopped_seconds >= conclusive
                and any(o.rank != v.rank and o.alive and o.stopped_seconds is None for o in ranks)
            ):
                why = "stopped"
                out[v.key] = replace(
                    v,
                    stalled=True,
                    method="stopped",
                    conclusive=why,
                    progress_timestamp=min(v.progress_timestamp or now, now - v.stopped_seconds),
                    still_seconds=max(v.still_seconds, v.stopped_seconds),  # its stop proves it still, not two dumps
                )
                continue
            if id(v) not in held_ids:
                continue
            if dead:
                why = "peer_down"
            elif id(v) in odd_ids:
                why = "odd_one_out"
            elif id(v) in waiting_ids and odd:
                why = "waits_for_stuck"
            if why:
                out[v.key] = replace(v, stalled=True, ambiguous=False, conclusive=why)
    return out


def name_suspects(
    verdicts: Mapping[RankId, StallVerdict],
) -> dict[RankId, StallVerdict]:
    """Mark the odd one out per job: only when some rank of the job is stalled or dead.

    Each rank gets a place: "dead", "progressing", or where it is stuck (its top frames without line
    numbers). If one place holds a strict majority (at least two ranks), every rank elsewhere is a
    suspect; a dead rank among live peers always is.
    """
    out = dict(verdicts)
    jobs: dict[str, list[StallVerdict]] = collections.defaultdict(list)
    for v in verdicts.values():
        jobs[v.job_id].append(v)
    for ranks in jobs.values():
        if len(ranks) < 2 or not any(v.stalled or not v.alive for v in ranks):
            continue

        def place(v: StallVerdict) -> tuple[str, ...]:
            if not v.alive:
                return ("dead",)
            if not v.stalled:
                return ("progressing",)
            return v.location or ("stalled",)

        counts = collections.Counter(place(v) for v in ranks)
        (top, n), *rest = counts.most_common()
        majority = n >= 2 and all(n > m for _, m in rest)
        for v in ranks:
            where = place(v)
            reason = ""
            if where == ("dead",) and any(r.alive for r in ranks):
                peers = sum(r.rank != v.rank for r in ranks)
                reason = f"dead while {peers} peer(s) on this node are alive"
            elif majority and where != top:
                what = "progressing" if top == ("progressing",) else "stuck in " + " <- ".join(top)
                mine = "still progressing" if where == ("progressing",) else ("stuck in " + " <- ".join(where))
                reason = f"{mine}, while {n} peer(s) are {what}"
            if reason:
                out[v.key] = replace(v, suspect=True, suspect_reason=reason)
    return out
