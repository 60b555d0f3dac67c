"""rank_stalled: a rank that is alive but has made no progress for ``stall.after_seconds``.

Input: the stall verdicts of gpuwatchd/join/stall.py (``ctx.parts.stall.verdicts``: (job_id, rank) ->
``StallVerdict``: last progress, method, the stuck frames of the rank's main Python thread, the
thread states, every Python thread folded with its hang pattern (gpuwatchd/join/hang.py), and whether
it is the job's odd one out on this node), plus the GPUs of the join (utilisation, memory held by
the rank's tree). The explanation says the pattern in words (likely deadlock, waiting on a busy
or an idle GPU, in a collective, starved), names the rank's GPUs ("GPU 0 idle, 2.0 GiB held"),
shows each thread that matters and names the suspect rank, so that the on-call engineer looks at
the rank that never reached the collective instead of the fifteen that wait in it.

``rank_compiling`` (info): the rank has not progressed for ``stall.after_seconds`` but sits in
torch.compile / Inductor / Triton frames with its CPU busy; it becomes ``rank_stalled`` only after
``stall.compile_after_seconds``.
``rank_stall_unconfirmed`` (warning, never a page): the same stack in every dump for
``stall.after_seconds`` while a Python thread burns a core at that line, and nothing confirms a
stall (join/stall_spin.py: the GPU busy with no memory traffic or idle in every NVML reading, a
peer of the job stalled without ambiguity): a healthy loop that syncs every step or calls one
GIL-releasing C function again and again looks the same. It says what would confirm it.
``rank_waiting`` (info, never a page): a rank that would be stalled, but waits in a collective
or on its GPU while a peer of its job progresses (join/stall_verdicts.py judge_jobs): the job is
not hung while that peer works (rank 0 evaluating or saving alone while the others wait in a
barrier). It says for whom and what that peer does; the rank is paged once the peer stops too.
A ``rank_stalled`` paged within ``stall.conclusive_seconds`` (a shape that leaves no doubt) says
which shape made it conclusive.
Shell equivalent: ``stat -c %y HEARTBEAT``; ``py-spy dump --nonblocking -p PID`` repeated;
``cat /proc/PID/task/*/wchan``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuwatchd.findings.context import (
    FindingContext,
    collective_words,
    rank_finding,
    rank_gpus,
    rank_label,
    ranks_gpu_memory,
)
from gpuwatchd.model import INFO, PAGE, WARNING, Finding, RankId, RankState
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.units import fmt_bytes, fmt_clock_utc

GPU_IDLE_RATIO = 0.05  # below 5 % utilisation a GPU is idle
GPU_BUSY_RATIO = 0.6

HOW = {
    "heartbeat": "no heartbeat",
    "stack": "the same Python stack in every dump",
    "proc": "the same thread states, wchan and CPU pattern in every look",
    "stopped": "the process is stopped (state T, SIGSTOP or a debugger)",
    "compiling": "no heartbeat while compiling",
}


def gpu_text(gpus: list[tuple[str, float | None, int | None]]) -> str:
    """``GPU 0 idle, 2.0 GiB held`` / ``GPU 0 100 % busy, 2.0 GiB held``."""
    parts = []
    for index, util, held in gpus:
        if util is None:
            state = "utilisation unknown"
        elif util < GPU_IDLE_RATIO:
            state = "idle"
        else:
            state = f"{util * 100:.0f} % busy"
        parts.append(f"GPU {index} {state}" + (f", {fmt_bytes(held)} held" if held else ""))
    return ", ".join(parts)


def gpu_wait_text(v: StallVerdict, gpus: list[tuple[str, float | None, int | None]]) -> str:
    """Busy vs idle, when the rank waits on its GPU (or spins in native code holding one)."""
    kinds = v.analysis.kinds if v.analysis else ()
    holds = any(held for _, _, held in gpus)
    if "gpu_wait" not in kinds and not ("native_spin" in kinds and holds):
        return ""
    utils = [u for _, u, _ in gpus if u is not None]
    if not utils:
        return "; the GPU's utilisation is unknown"
    if max(utils) >= GPU_BUSY_RATIO:
        return "; the GPU is busy: a long kernel, or an NCCL kernel spinning for a peer"
    if max(utils) < GPU_IDLE_RATIO:
        return (
            "; the GPU is idle: the work it waits for was never launched or never "
            "completes (a lost launch, or a stream waiting on an event nobody records)"
        )
    return ""


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def find(ctx: FindingContext) -> Iterable[Finding]:
    verdicts: Mapping[RankId, StallVerdict] = ctx.parts.stall.verdicts
    # made once for all the stalled ranks (64 stalled ranks each walked every verdict, every GPU
    # process and every flight record: quadratic, each cycle)
    memory: dict[tuple[str, str], dict[str, int]] | None = None
    suspects_of: dict[str, list[StallVerdict]] | None = None
    words_of: dict[str, list[str]] = {}
    for r in ctx.ranks:
        v = verdicts.get(r.rank_id)
        if v is not None and r.alive and v.compiling and not v.stalled and v.pid == r.pid:
            yield _compiling(r, v, ctx)
            continue
        if v is not None and r.alive and v.ambiguous and not v.stalled and v.pid == r.pid:
            yield _unconfirmed(r, v, ctx)
            continue
        if v is not None and r.alive and v.waits_for and not v.stalled and v.pid == r.pid:
            yield _waiting(r, v)
            continue
        if v is None or not r.alive or not r.stalled or not v.stalled or v.pid != r.pid:
            continue
        since = ""
        if v.progress_timestamp is not None:
            since = f" (last progress {fmt_clock_utc(v.progress_timestamp)})"
        where = stuck_where(v)
        if suspects_of is None:
            suspects_of = {}
            for s in verdicts.values():
                if s.suspect:
                    suspects_of.setdefault(s.job_id, []).append(s)
        suspects = [s for s in suspects_of.get(r.job_id, ()) if s.rank != r.rank]
        if v.suspect:
            odd = f"; suspect: this rank is the odd one out ({v.suspect_reason})"
        elif suspects:
            odd = "; suspect: " + "; ".join(f"rank {s.rank} (pid {s.pid}) {s.suspect_reason}" for s in suspects)
        else:
            odd = ""
        memory = ranks_gpu_memory(ctx) if memory is None else memory
        gpus = rank_gpus(r, ctx, memory)
        patterns = v.analysis.patterns_text() if v.analysis else ""
        lead = f"{patterns}{gpu_wait_text(v, gpus)}; " if patterns else ""
        on_gpu = f"; {gpu_text(gpus)}" if gpus else ""
        threads = f"; threads: {v.analysis.threads_text()}" if v.analysis else ""
        fr = words_of.get(r.job_id)
        if fr is None:
            fr = words_of[r.job_id] = collective_words(ctx, r.job_id)
        lead += "".join(f"{x}; " for x in fr)
        if v.conclusive:
            lead += f"conclusive: {CONCLUSIVE[v.conclusive].format(_duration(v.still_seconds))}; "
        if v.confirmed_by:
            lead += f"{CONFIRMED[v.confirmed_by]} ({v.gpu_evidence}); "
        if v.unchanged is not None and v.unchanged_quiet_ms is not None:
            lead += (
                f"its Python threads slept at the same place at every look since the dump at "
                f"{fmt_clock_utc(v.unchanged[0])}, with {v.unchanged_quiet_ms:.1f} ms of CPU in "
                "all (schedstat), so that dump stands; "
            )
        elif v.unchanged is not None:
            lead += (
                f"no thread ran since the dump at {fmt_clock_utc(v.unchanged[0])} (schedstat at "
                f"{fmt_clock_utc(v.unchanged[1]).removesuffix(' UTC')}: the same tasks, run times "
                "and slice counts), so its stacks still hold; "
            )
        yield rank_finding(
            r,
            kind="rank_stalled",
            severity=PAGE,
            explanation=(
                f"{rank_label(r)} made no progress for {_duration(v.no_progress_seconds)}{since}: "
                f"{HOW.get(v.method, v.method)}; {lead}stuck in {where}{on_gpu}{threads}; "
                f"{v.threads_summary}{odd}"
            ),
            evidence={
                "method": v.method,
                "no_progress_seconds": round(v.no_progress_seconds, 1),
                "stuck_frames": list(v.stuck_frames),
                "threads": v.threads_summary,
                "suspect": v.suspect,
                "suspect_ranks": sorted(s.rank for s in suspects) or ([r.rank] if v.suspect else []),
                "patterns": list(v.analysis.kinds) if v.analysis else [],
                "flight_recorder": fr,
                "confirmed_by": v.confirmed_by,
                "conclusive": v.conclusive,
                "unchanged_since_dump": None if v.unchanged is None else round(v.unchanged[0], 3),
                "quiet_cpu_ms_since_dump": None if v.unchanged_quiet_ms is None else round(v.unchanged_quiet_ms, 1),
                "gpus": [{"gpu": i, "utilization": u, "held_bytes": h} for i, u, h in gpus],
            },
        )


def stuck_where(v: StallVerdict) -> str:
    """Its top frames, innermost first; for a stopped rank only from a dump taken since it stopped."""
    if v.stuck_frames:
        return " <- ".join(v.stuck_frames[:5])
    return "stack not read since it stopped" if v.method == "stopped" else "stack unknown (no py-spy)"


# why a rank_stalled did not wait for stall.after_seconds ({} is how long it was proven still)
CONCLUSIVE = {
    "deadlock": "a lock-order deadlock, its threads blocked acquiring locks at 0 % CPU with the "
    "same stacks for {} (stall.conclusive_seconds)",
    "gil": "a thread held the GIL at the same line in two dumps over {} while the main thread "
    "waits for it (stall.conclusive_seconds)",
    "gpu_spin": "a kernel that never ends under it for {} (stall.conclusive_seconds)",
    "stopped": "stopped for {} while its peers run (stall.conclusive_seconds)",
    "peer_down": "a rank of its job is down and this one has not moved for {} (stall.conclusive_seconds)",
    "odd_one_out": "the odd one out: still outside the collective for {} while its peers wait in "
    "it and none progresses (stall.conclusive_seconds)",
    "waits_for_stuck": "it waits in the collective for {} for a peer stuck elsewhere, the odd one "
    "out (stall.conclusive_seconds)",
    "ras_missing": "it waits in a collective, still for {}, and NCCL RAS agrees: every answer over "
    "that time names a missing rank and no collective count of the job moved "
    "(stall.conclusive_seconds)",
}

CONFIRMED = {
    "gpu_spin": "confirmed by the GPU: busy with no memory traffic in every reading, a kernel that "
    "never ends (a spin, or a collective waiting for a peer)",
    "gpu_idle": "confirmed by the GPU: idle in every reading while the rank waits for it",
    "peer": "confirmed by its peers: a rank of the same job is stalled without ambiguity",
}


def _unconfirmed(r: RankState, v: StallVerdict, ctx: FindingContext) -> Finding:
    gpus = rank_gpus(r, ctx)
    on_gpu = f"; {gpu_text(gpus)}" if gpus else ""
    where = stuck_where(v)
    patterns = f"{v.analysis.patterns_text()}; " if v.analysis and v.analysis.patterns else ""
    return rank_finding(
        r,
        kind="rank_stall_unconfirmed",
        severity=WARNING,
        explanation=(
            f"{rank_label(r)} shows no change for {_duration(v.no_progress_seconds)}: "
            f"{HOW.get(v.method, v.method)}, with a thread burning a core at {where}; {patterns}"
            f"not paged: a loop that syncs the GPU every step or calls one GIL-releasing C function "
            f"again and again looks the same from outside as a GPU that never finishes or a C call "
            f"that never returns ({v.gpu_evidence or 'no GPU reading'}){on_gpu}. A stall would be "
            f"confirmed by its GPU busy with no memory traffic (or idle) in every NVML reading, or "
            f"a peer of the job stalled; for certainty give the job a heartbeat "
            f"(GPUWATCHD_HEARTBEAT=1 in its environment, or gpuwatchd.heartbeat(step)) and look "
            f"now with `gpuwatchd doctor {r.pid}` (docs/runbooks.md#rank_stall_unconfirmed)"
        ),
        evidence={
            "method": v.method,
            "no_progress_seconds": round(v.no_progress_seconds, 1),
            "stuck_frames": list(v.stuck_frames),
            "gpu_evidence": v.gpu_evidence,
            "patterns": list(v.analysis.kinds) if v.analysis else [],
        },
    )


def _waiting(r: RankState, v: StallVerdict) -> Finding:
    return rank_finding(
        r,
        kind="rank_waiting",
        severity=INFO,
        explanation=(
            f"{rank_label(r)}: {v.waits_for}; not paged while its job progresses (the job is hung "
            "when none of its ranks makes progress; docs/runbooks.md#rank_waiting)"
        ),
        evidence={
            "no_progress_seconds": round(v.no_progress_seconds, 1),
            "waits_for": v.waits_for,
            "stuck_frames": list(v.stuck_frames),
        },
    )


def _compiling(r: RankState, v: StallVerdict, ctx: FindingContext) -> Finding:
    gpus = rank_gpus(r, ctx)
    on_gpu = f"; {gpu_text(gpus)}" if gpus else ""
    text = v.analysis.patterns_text() if v.analysis else "in torch.compile"
    return rank_finding(
        r,
        kind="rank_compiling",
        severity=INFO,
        explanation=(
            f"{rank_label(r)} made no progress for {_duration(v.no_progress_seconds)} but is "
            f"{text}{on_gpu}; paged as stalled only after "
            f"{_duration(ctx.config.stall.compile_after_seconds)} (stall.compile_after_seconds)"
        ),
        evidence={
            "no_progress_seconds": round(v.no_progress_seconds, 1),
            "patterns": list(v.analysis.kinds) if v.analysis else [],
        },
    )
