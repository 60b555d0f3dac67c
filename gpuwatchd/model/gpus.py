"""Which GPUs are a rank's: the one rule (``is_rank_gpu``), read by the stall spin rules
(join/stall_spin.py), the rule context's ``rank_gpus`` (findings/context.py), gil_saturated
(findings/gil.py) and the GIL schedule's signals (daemon/gil_signals.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from gpuwatchd.model import GpuDevice, GpuProcessRow, RankState


def is_rank_gpu(g: GpuDevice, named: Collection[str], held: Collection[int]) -> bool:
    """The one rule for "is ``g`` one of this rank's GPUs": its rank file names it (index or
    UUID: ``RankEntry.gpus``), or its process tree holds memory on it (``held``: the GPU indices,
    from NVML's processes). A discovered rank names none, so what its tree holds is all there is."""
    return g.index in held or g.uuid in named or str(g.index) in named


def held_by_rank(rows: Iterable[GpuProcessRow]) -> dict[tuple[str, str], set[int]]:
    """(job_id, rank) -> the GPU indices the join's GPU rows attribute to that rank's tree: one
    pass over the rows for a caller that asks ``rank_gpu_devices`` for every rank (the GIL
    schedule's signals each cycle: 64 ranks each filtering 64 rows, 4,096 steps, took 0.55-0.78 ms
    a cycle on the 2-core VM, with this index 0.14-0.16 ms)."""
    out: dict[tuple[str, str], set[int]] = {}
    for p in rows:
        out.setdefault((p.job_id, p.rank), set()).add(p.gpu_index)
    return out


def rank_gpu_devices(r: RankState, gpus: Iterable[GpuDevice], rows: Iterable[GpuProcessRow],
                     held: Mapping[tuple[str, str], Collection[int]] | None = None,
                     ) -> list[GpuDevice]:  # fmt: skip
    """A joined rank's GPUs (``is_rank_gpu``): those its rank file names and those the join's GPU
    rows attribute to its tree. ``held``: ``held_by_rank(rows)``, made once by a caller that asks
    for many ranks (``rows`` is not read then); ``rank_gpus`` of findings/context.py likewise."""
    rank = str(r.rank)
    if held is None:
        mine: Collection[int] = {p.gpu_index for p in rows if p.job_id == r.job_id and p.rank == rank}
    else:
        mine = held.get((r.job_id, rank), ())
    return [g for g in gpus if is_rank_gpu(g, r.gpus, mine)]
