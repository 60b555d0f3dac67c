"""Which GPUs are a rank's: the one rule (``is_rank_gpu``), read by the stall spin rules
(join/stall_spin.py), the rule context's ``rank_gpus`` (findings/context.py), gil_saturated
(findings/gil.py) and the GIL schedule's signals (daemon/gil_signals.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from gpuwatchd.model import GpuDevice, GpuProcessRow, RankState


def is_rank_gpu(g: GpuDevice, named: Collection[str], held: Collection[int]) -> bool:
    """The one rule for "is ``g`` one of this rank's GPUs": its rank file names it (index or
    UUID: ``RankEntry.gpus``), or its process tree holds memory on it (``held``: the GPU indices,
    from NVML's processes). A discovered rank names none, so what its tree holds is all there is."""
    return g.index in held or g.uuid in named or str(g.index) in named


def rank_gpu_devices(r: RankState, gpus: Iterable[GpuDevice],
                     rows: Iterable[GpuProcessRow]) -> list[GpuDevice]:  # fmt: skip
    """A joined rank's GPUs (``is_rank_gpu``): those its rank file names and those the join's GPU
    rows attribute to its tree. For one rank; ``rank_gpus`` of findings/context.py asks for many."""
    rank = str(r.rank)
    held = {p.gpu_index for p in rows if p.job_id == r.job_id and p.rank == rank}
    return [g for g in gpus if is_rank_gpu(g, r.gpus, held)]
