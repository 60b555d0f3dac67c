"""Daemon side of the flight recorder: ask stalled jobs' ranks for a dump, read it, compare ranks.

When a rank of a job looks stalled (``StallOutput.verdicts``, from the stall part), every rank of
that job on this node gets a request (``JOB.RANK.frreq`` with a fresh nonce, written atomically into
the rank directory), at most every ``stall.flight_recorder_interval_seconds``. The rank's thread
(gpuwatchd/rank/flight_recorder.py) answers with ``JOB.RANK.fr``; the next cycle reads it under the
rank directory's rules: no symlink (O_NOFOLLOW), a regular file of at most ``MAX_BYTES`` owned by
root or by the rank process's uid, JSON only (PyTorch's own dumps are pickles: never read those),
its nonce the one asked for and its pid the rank's. Each rank's process groups become
``CollectiveStatus`` (last collective entered and completed, exported as
``gpuwatch_rank_collective_last_{started,completed}_seq``), and ``compare`` says in words which
rank never entered collective #N, or which ranks called different collectives (a desync).

The files (one small answer read per asked rank per cycle, one request written per rank of a
stalled job per interval) are read and written by gpuwatchd/sources/flight_recorder_files.py; this
module only parses and compares: no I/O.
Shell equivalent: ``python -c 'import torch; print(torch._C._distributed_c10d._dump_fr_trace_json())'``
inside each rank, then compare ``collective_seq_id`` across ranks (``torchfrtrace`` does it on
pickled dumps). The daemon's part that asks and reads each cycle is
gpuwatchd/daemon/flight_recorder.py.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from gpuwatchd.escape import printable
from gpuwatchd.model.collectives import MAX_ENTRIES_READ, MAX_GROUPS, CollectiveStatus
from gpuwatchd.model.parts import FrReading


def _label(value: Any, limit: int, what: str) -> str:
    text = str(value)[:limit]
    if not text.isprintable():
        raise ValueError(f"{what} {printable(text)!s:.40} is not printable text")
    return text


def parse_response(doc: Any, job_id: str, rank: int, pid: int) -> FrReading:
    """A response document -> FrReading; ValueError for anything not of the expected shape."""
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise ValueError("not a version-1 flight-recorder response")
    when = doc.get("time")
    when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else 0.0
    if "error" in doc:
        return FrReading(job_id, rank, pid, error=printable(str(doc["error"])[:200]))
    trace = doc.get("trace")
    if not isinstance(trace, dict) or not isinstance(trace.get("entries", []), list):
        raise ValueError("trace.entries is not a list")
    started: dict[str, int] = collections.defaultdict(lambda: -1)
    completed: dict[str, int] = collections.defaultdict(lambda: -1)
    names: dict[str, dict[int, str]] = collections.defaultdict(dict)
    for e in trace.get("entries", [])[:MAX_ENTRIES_READ]:
        if not isinstance(e, dict) or e.get("is_p2p") is True:
            continue
        seq = e.get("collective_seq_id")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            continue
        pg = _label(e.get("pg_id", "0"), 16, "pg_id")
        if pg not in started and len(started) >= MAX_GROUPS:
            continue
        started[pg] = max(started[pg], seq)
        if e.get("state") == "completed":
            completed[pg] = max(completed[pg], seq)
        names[pg][seq] = _label(e.get("profiling_name", "?"), 64, "profiling_name")
    status = trace.get("pg_status")
    if isinstance(status, dict):  # torch's own counters, when present, fill in what was cut off
        for pg, st in list(status.items())[:MAX_GROUPS]:
            if not isinstance(st, dict):
                continue
            pg = _label(pg, 16, "pg_id")
            for key, table in (("last_completed_collective", completed),
                               ("last_started_collective", started),
                               ("last_enqueued_collective", started)):  # fmt: skip
                with contextlib.suppress(TypeError, ValueError):
                    table[pg] = max(table[pg], int(st.get(key, -1)))
    groups = tuple(
        CollectiveStatus(job_id, rank, pid, pg, started[pg], completed[pg],
                         names[pg].get(started[pg], ""), when)
        for pg in sorted(started) if started[pg] >= 0 or completed[pg] >= 0
    )  # fmt: skip
    return FrReading(job_id, rank, pid, groups, {pg: dict(v) for pg, v in names.items()})


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def compare(readings: Iterable[FrReading]) -> list[str]:
    """Statements about one job's ranks: who never entered collective #N, who desynced, who did
    not answer. Empty when the dumps agree (or there are fewer than two)."""
    readings = list(readings)
    out = []
    silent = [r.rank for r in readings if r.error == "no answer"]
    failed = [r for r in readings if r.error and r.error not in ("no answer", "waiting")]
    good = [r for r in readings if not r.error]
    pgs = sorted({g.pg for r in good for g in r.groups})
    for pg in pgs:
        started = {r.rank: next((g.last_started for g in r.groups if g.pg == pg), -1) for r in good}
        if len(started) < 2:
            continue
        top = max(started.values())
        ahead = [k for k, s in started.items() if s == top]
        behind = [k for k, s in started.items() if s < top]
        name = next((r.names.get(pg, {}).get(top, "") for r in good if r.rank in ahead), "")
        if behind:
            lows = ", ".join(f"rank {k} #{started[k]}" for k in sorted(behind))
            out.append(
                f"flight recorder: {_ranks_text(behind)} never entered collective #{top}"
                f"{f' ({name})' if name else ''} of process group {pg} that "
                f"{_ranks_text(ahead)} entered (last entered: {lows})"
            )
        # a desync: the same sequence number, different collectives
        common = set.intersection(*(set(r.names.get(pg, {})) for r in good))
        for seq in sorted(common, reverse=True)[:8]:
            calls = {r.rank: r.names[pg][seq] for r in good}
            if len(set(calls.values())) > 1:
                by_name: dict[str, list[int]] = collections.defaultdict(list)
                for k, n in calls.items():
                    by_name[n].append(k)
                parts = " but ".join(f"{n} on {_ranks_text(ks)}" for n, ks in sorted(by_name.items()))
                out.append(f"desync: collective #{seq} of process group {pg} is {parts}")
                break
    if silent and (good or failed):
        out.append(
            f"flight recorder: {_ranks_text(silent)} did not answer the dump request "
            "(stopped, or its Python threads are blocked)"
        )
    for r in failed:
        out.append(f"flight recorder of rank {r.rank} unavailable: {r.error}")
    return out
