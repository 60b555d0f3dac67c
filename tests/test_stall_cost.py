"""The cost shape of the job's view of a stall, per cycle: linear in a job's ranks.

``judge_jobs`` (join/stall_verdicts.py) ran ``v in list`` over a job's verdicts, which compares
frozen dataclasses field by field: 64 beating ranks of one job cost 2.3 ms a cycle on the 2-core
VM (bench/results/cycle_cost_64ranks_a7db82e_vs_head_2cpu_vm.txt). ``rank_gpu_readings``
(join/stall_spin.py) scanned every holder of a GPU for every rank on it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from gpuwatchd.join.stall_spin import rank_gpu_readings
from gpuwatchd.join.stall_verdicts import judge_jobs
from gpuwatchd.model import GpuDevice, GpuProcess, GpuProcessRow, RankState
from gpuwatchd.model.stall import StallVerdict

EQ_CALLS = [0]


class CountedVerdict(StallVerdict):
    """A verdict that counts its field-by-field comparisons."""

    def __eq__(self, other: object) -> bool:
        EQ_CALLS[0] += 1
        return super().__eq__(other)

    __hash__ = StallVerdict.__hash__


def _job(n: int, now: float, **kw: object) -> dict:
    vs = [CountedVerdict("j", r, 100 + r, True, now - 1.0, False, "heartbeat", 1.0,
                         doing="beats (last heartbeat 1 s ago)") for r in range(n)]
    vs = [replace(v, **kw) for v in vs] if kw else vs  # type: ignore[arg-type]
    return {v.key: v for v in vs}


def test_judge_jobs_compares_no_verdicts_field_by_field() -> None:
    """64 beating ranks of one job, then 64 still ones (held past the bound, a dead peer): the
    job's view is the same and no verdict is compared to another. Before: 2,016 comparisons for
    the beating job alone (each rank against the ones before it in ``progressing``)."""
    now = 1000.0
    beating = _job(64, now)
    EQ_CALLS[0] = 0
    out = judge_jobs(beating, now, 40.0, 53.0)
    assert EQ_CALLS[0] == 0
    assert all(out[k] is v for k, v in beating.items())  # nothing to say about a beating job
    still = _job(64, now, progress_timestamp=now - 100.0, still_seconds=100.0)
    dead_key = next(iter(still))
    still[dead_key] = replace(still[dead_key], alive=False)
    EQ_CALLS[0] = 0
    out = judge_jobs(still, now, 40.0, 53.0)
    assert EQ_CALLS[0] == 0
    assert [v.conclusive for k, v in out.items() if k != dead_key] == ["peer_down"] * 63


def test_rank_gpu_readings_exclusive_as_every_holder_of_the_rank_job() -> None:
    """Against the rule itself, on random nodes: a rank's GPUs are its job's alone when every
    process holding memory on them is a rank of that job."""
    rnd = random.Random(7)
    for _ in range(200):
        gpus = tuple(GpuDevice(i, f"GPU-{i}", "H100", str(i), 1, 1, rnd.random(),
                               memory_utilization_ratio=rnd.random()) for i in range(rnd.randint(1, 4)))
        ranks = tuple(RankState(rnd.choice("ab"), r, 10 + r, r, 8, True, None,
                                gpus=(str(rnd.randrange(len(gpus))),) if rnd.random() < 0.3 else ())
                      for r in range(rnd.randint(1, 8)))
        rows = tuple(GpuProcessRow(g.index, g.uuid, r.pid, 1 << 30, "python", "u", r.job_id, str(r.rank))
                     for r, g in itertools.product(ranks, gpus) if rnd.random() < 0.5)
        rows += tuple(GpuProcessRow(g.index, g.uuid, 900 + g.index, 1 << 30, "python", "u", "", "")
                      for g in gpus if rnd.random() < 0.2)
        named = {r.rank_id: r.gpus for r in ranks}
        owner = {r.pid: r.rank_id for r in ranks}
        procs = tuple(GpuProcess(p.gpu_index, p.uuid, p.pid, p.used_memory_bytes) for p in rows)
        out = rank_gpu_readings(50.0, named, owner, gpus, procs)
        for r in ranks:
            mine = [g for g in gpus if any(p.gpu_index == g.index and (p.job_id, p.rank) == (r.job_id, str(r.rank))
                                           for p in rows) or str(g.index) in r.gpus]
            if not mine:
                assert r.rank_id not in out
                continue
            alone = all(p.job_id == r.job_id for g in mine for p in rows if p.gpu_index == g.index)
            assert out[r.rank_id].exclusive == alone, (r, rows)
