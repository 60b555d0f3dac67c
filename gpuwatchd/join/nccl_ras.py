"""NCCL RAS answers as evidence about one job: per-rank operation counts and how long since they
moved, the ranks NCCL calls missing (``dead`` or ``unresponsive``), asynchronous errors, and the
culprit in words ("rank 37 on 10.0.0.5 (pid 812) is unresponsive per NCCL RAS; the 63 others
wait in AllReduce #10234").

The document is NCCL's ``STATUS`` in JSON (``src/ras/client_support.cc``: ``jsonWriteHeader``,
``jsonWriteRankData``, ``jsonWriteMissingRank``): per communicator its ranks (``rank``, ``host``:
the IP of its RAS peer, ``pid`` as the rank's own namespace sees it, ``cuda_dev``, ``status``
with ``init_state``/``async_error`` as ncclResult_t and the flags, ``collective_counts`` per
collective function) and ``missing_ranks`` (``status.unresponsive``, ``status.considered_dead``).
The evidence uses the job's largest communicator (the world group: every rank is in it); the
counts are collectives *issued* by each rank, so the ranks the others wait for have the lowest.
NCCL counts only collectives launched through a kernel plan: a one-rank communicator's are local
copies (``ncclLaunchOneRank``) and its counts stay 0 whatever it does, so they say nothing
(``counted`` False: neither progress nor a stop; a world-size-1 job on the device showed 0).

Joined by (host, PID) to the job's ranks on this node: a RAS rank whose PID is a watched rank's
(host PID or the PID its container sees) and whose host is an address of this node. An answer
that names none of the job's ranks here is refused whole (another job's RAS answered). Pure: the
I/O is gpuwatchd/sources/nccl_ras.py, the cadence gpuwatchd/daemon/nccl_ras.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuwatchd.escape import printable
from gpuwatchd.join.ras_text import parse_text
from gpuwatchd.model import RankId
from gpuwatchd.model.nccl_ras import RasJob, RasRank, RasRankStatus
from gpuwatchd.model.stall import StallVerdict

MAX_COMMS = 256  # communicators read of one answer
MAX_RANKS = 8192  # ranks read of one communicator
MAX_NAMED = 4  # culprits named in the statement
# ncclResult_t (nccl.h): what a non-zero async_error means in words
NCCL_RESULTS = {1: "unhandled CUDA error", 2: "system error", 3: "internal error",
                4: "invalid argument", 5: "invalid usage", 6: "remote process error",
                7: "operation in progress"}  # fmt: skip
FUNCTIONS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


@dataclass(frozen=True)
class RasAnswer:
    nccl_version: str
    size: int  # ranks of the communicator
    ranks: tuple[RasRank, ...]  # present (text: only those with an asynchronous error)
    missing: tuple[RasRank, ...]
    text: bool = False  # NCCL 2.24-2.27's text (join/ras_text.py): no counts, no rank list


def _int(value: Any, what: str, low: int = -(2**63)) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
        raise ValueError(f"{what} is not an integer")
    return value


def _text(value: Any, limit: int, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string")
    text = value[:limit]
    if not text.isprintable():
        raise ValueError(f"{what} {printable(text)!s:.40} is not printable text")
    return text


def _rank(d: Any, missing: bool) -> RasRank:
    if not isinstance(d, dict):
        raise ValueError("a rank is not an object")
    status = d.get("status")
    st: dict[str, Any] = status if isinstance(status, dict) else {}
    common = dict(
        rank=_int(d.get("rank"), "rank", 0),
        host=_text(d.get("host"), 64, "host"),
        pid=_int(d.get("pid"), "pid", -1),
        cuda_dev=_int(d.get("cuda_dev", -1), "cuda_dev", -1),
    )
    if missing:
        why = (
            "dead"
            if st.get("considered_dead") is True
            else "unresponsive"
            if st.get("unresponsive") is True
            else "missing"
        )
        return RasRank(**common, missing=why)  # type: ignore[arg-type]
    counts = d.get("collective_counts")
    if not isinstance(counts, dict):
        raise ValueError("collective_counts is not an object")
    return RasRank(
        **common,  # type: ignore[arg-type]
        counts={_text(k, 32, "function"): _int(v, "count", 0) for k, v in list(counts.items())[:16]},
        init_state=_int(st.get("init_state", 0), "init_state"),
        async_error=_int(st.get("async_error", 0), "async_error"),
        abort=st.get("abort_flag") is True,
    )


def parse_status(doc: Any) -> RasAnswer:
    """NCCL's JSON ``STATUS`` -> its largest communicator; its text ``STATUS`` (a ``str``, NCCL
    2.24-2.27) -> what join/ras_text.py reads of it; ValueError for another shape."""
    if isinstance(doc, str):
        version, size, failed, missing = parse_text(doc)
        return RasAnswer(version, size, failed, missing, text=True)
    if not isinstance(doc, dict) or not isinstance(doc.get("communicators"), list):
        raise ValueError("not an NCCL RAS status (no communicators)")
    version = _text(doc.get("nccl_version", "?"), 16, "nccl_version")
    best: dict[str, Any] | None = None
    for comm in doc["communicators"][:MAX_COMMS]:
        if isinstance(comm, dict) and (
            best is None or _int(comm.get("size", 0), "size", 0) > _int(best.get("size", 0), "size", 0)
        ):
            best = comm
    if best is None:
        return RasAnswer(version, 0, (), ())
    ranks, missing = best.get("ranks", []), best.get("missing_ranks", [])
    if not isinstance(ranks, list) or not isinstance(missing, list):
        raise ValueError("ranks or missing_ranks is not a list")
    return RasAnswer(
        version,
        _int(best.get("size", 0), "size", 0),
        tuple(_rank(r, False) for r in ranks[:MAX_RANKS]),
        tuple(_rank(r, True) for r in missing[:MAX_RANKS]),
    )


@dataclass
class _Seen:
    ops: dict[tuple[str, int], int]  # (host, pid) -> ops
    moved_at: dict[tuple[str, int], float]
    any_moved_at: float
    missing_at: float | None = None  # the first answer of the current streak naming missing ranks


def counts_moving(ras: RasJob | None, pid: int, now: float, interval: float) -> bool:
    """RAS's latest answer for the job, asked within two intervals, shows the rank ``pid``'s
    operation count moved since the answer before: it issues collectives, so a stack that waits
    in one at every look (or a heartbeat that stopped) is a rank at work, not a stalled one."""
    if ras is None or ras.progressing is not True or now - ras.asked_at > 2 * interval:
        return False
    return any(s.pid == pid and s.moved_at == ras.asked_at for s in ras.local)


def _lagging_op(present: tuple[RasRank, ...]) -> tuple[str, int]:
    """The function the ranks disagree on most (else the busiest), and its highest count."""
    best, spread = "", -1
    for fn in sorted({k for r in present for k in r.counts}):
        values = [r.counts.get(fn, 0) for r in present]
        key = (max(values) - min(values), max(values))
        if key > (spread, max((r.counts.get(best, 0) for r in present), default=0)) or best == "":
            best, spread = fn, key[0]
    return best, max((r.counts.get(best, 0) for r in present), default=0)


def _ranks_words(rs: tuple[RasRank, ...], what: str) -> str:
    named = "; ".join(f"{r.where()} is {what or r.missing}" for r in rs[:MAX_NAMED])
    return named + (f" (and {len(rs) - MAX_NAMED} more)" if len(rs) > MAX_NAMED else "")


class RasTracker:
    """Per job, the previous answer's counts: whether they move, and since when they do not."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def forget(self, live_jobs: set[str]) -> None:
        for job in set(self._seen) - live_jobs:
            del self._seen[job]

    def observe(
        self,
        job_id: str,
        now: float,
        answer: RasAnswer,
        local: Mapping[int, tuple[int, int]],
        addresses: frozenset[str],
    ) -> RasJob:
        """``local``: RAS-visible PID (host or container PID) -> (gpuwatchd rank, host PID) of the
        job's live ranks here; ``addresses``: this node's addresses (empty: unknown, PID alone)."""
        if answer.text:
            return self._text(job_id, now, answer)
        mine = [r for r in answer.ranks if r.pid in local and (not addresses or r.host in addresses)]
        if not mine:
            return RasJob(
                job_id, now, error="the answer names none of the job's ranks here", nccl_version=answer.nccl_version
            )
        seen = self._seen.get(job_id)
        ops = {(r.host, r.pid): r.ops for r in answer.ranks}
        moved_at: dict[tuple[str, int], float] = {}
        moved = False
        for key, n in ops.items():
            before = seen.ops.get(key) if seen else None
            if before is not None and before == n:
                moved_at[key] = seen.moved_at.get(key, now) if seen else now
            else:
                moved_at[key] = now
                moved = moved or before is not None
        any_moved = now if seen is None or moved else seen.any_moved_at
        missing_at = (
            None
            if not answer.missing
            else (seen.missing_at if seen is not None and seen.missing_at is not None else now)
        )
        self._seen[job_id] = _Seen(ops, moved_at, any_moved, missing_at)
        counted = answer.size > 1  # a one-rank communicator's counts never move (module docstring)
        progressing = None if seen is None or not counted else moved
        if not counted:
            any_moved = now
        present = answer.ranks
        errors = tuple(r for r in present if r.async_error not in (0, 7) or r.abort)
        behind: tuple[RasRank, ...] = ()
        if progressing is False and present:
            low = min(r.ops for r in present)
            if any(r.ops != low for r in present):
                behind = tuple(r for r in present if r.ops == low)
        status = tuple(RasRankStatus(job_id, local[r.pid][0], local[r.pid][1], r.rank, r.ops,
                                     r.counts, moved_at[(r.host, r.pid)], now, r.async_error,
                                     counted=counted)
                       for r in sorted(mine, key=lambda r: r.rank))  # fmt: skip
        job = RasJob(
            job_id,
            now,
            nccl_version=answer.nccl_version,
            size=answer.size,
            local=status,
            missing=answer.missing,
            errors=errors,
            behind=behind,
            progressing=progressing,
            stopped_seconds=now - any_moved,
            missing_seconds=now - missing_at if missing_at is not None else 0.0,
        )
        return _with_statement(job, present)

    def _text(self, job_id: str, now: float, answer: RasAnswer) -> RasJob:
        """A text answer (NCCL 2.24-2.27): its missing and failed ranks, no counts, so neither
        progress nor a stop, and no local rank's row (it lists no healthy rank to join). The port
        was already proven the job's (every listener a socket of its ranks), which is what makes
        an answer that names none of them here acceptable."""
        self._seen.pop(job_id, None)
        errors = tuple(r for r in answer.ranks if r.async_error not in (0, 7) or r.abort)
        job = RasJob(
            job_id, now, nccl_version=answer.nccl_version, size=answer.size, missing=answer.missing, errors=errors
        )
        return _with_statement(job, answer.ranks)


def _with_statement(job: RasJob, present: tuple[RasRank, ...]) -> RasJob:
    parts = []
    culprits = job.missing or job.behind
    if job.missing:
        parts.append(_ranks_words(job.missing, "") + " per NCCL RAS")
    elif job.behind:
        parts.append(
            _ranks_words(job.behind, f"behind ({job.behind[0].ops} collectives issued)")
            + f" per NCCL RAS; counts have not moved for {job.stopped_seconds:.0f} s"
        )
    for r in job.errors[:MAX_NAMED]:
        why = NCCL_RESULTS.get(r.async_error, f"error {r.async_error}") if r.async_error else "aborted"
        parts.append(f"{r.where()} has an asynchronous NCCL error: {why}")
    if culprits:
        ahead = [r for r in present if r not in culprits]
        fn, top = _lagging_op(tuple(ahead) or present)
        if ahead and fn:
            parts[0] += f"; the {len(ahead)} others wait in {fn} #{top}"
    statement = "; ".join(parts)
    dead = sum(r.missing == "dead" for r in job.missing)
    named = tuple((r.rank, r.host, r.pid, r.missing or "behind") for r in culprits[:MAX_NAMED]) + tuple(
        (r.rank, r.host, r.pid, "async_error") for r in job.errors[:MAX_NAMED]
    )
    local = tuple(
        replace(
            s,
            dead=dead,
            unresponsive=len(job.missing) - dead,
            errors=len(job.errors),
            culprit=statement,
            culprits=named,
        )
        for s in job.local
    )
    return replace(job, statement=statement, local=local)


def confirm_by_ras(verdicts: Mapping[RankId, StallVerdict], jobs: Mapping[str, RasJob],
                   conclusive: float) -> dict[RankId, StallVerdict]:  # fmt: skip
    """A rank here that waits in a collective, proven still for the conclusive bound, is stalled
    then (``conclusive`` "ras_missing") when NCCL RAS agrees for as long: every answer of its job
    over the bound names missing ranks (dead or unresponsive: a process gone, stopped or hung
    whole, its RAS thread silent), and no count of the job moved over it. Both views at once,
    for that long, or nothing: a peer on another node that works alone (an evaluation, a
    checkpoint) is present to RAS, so its waiting peers here wait for ``after_seconds``; a rank
    merely behind is never conclusive (it may be on its way), nor counts that NCCL never moves (a
    one-rank communicator), nor a rank here that progresses, compiles, or waits for a local peer
    that progresses (``waits_for``). Returns the verdicts it makes stalled, only those."""
    out: dict[RankId, StallVerdict] = {}
    for key, v in verdicts.items():
        ras = jobs.get(key[0])
        if v.stalled or not v.alive or v.compiling or v.waits_for or v.analysis is None or ras is None:
            continue
        if ras.error or ras.size < 2 or ras.progressing is not False or not ras.missing:
            continue
        if min(ras.stopped_seconds, ras.missing_seconds, v.still_seconds) < conclusive:
            continue
        if "collective" not in v.analysis.kinds:
            continue
        out[key] = replace(v, stalled=True, ambiguous=False, conclusive="ras_missing")
    return out
