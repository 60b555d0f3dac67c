"""The fork_after_cuda rule's evidence for one cycle (the NVML subsystem's part, daemon/nvml.py).

Reads, through ``sources.devfds.EvidenceReader`` (which rescans a process's fds only when they
changed), the processes of rank trees that can show a fork after CUDA: those NVML lists as
holding a CUDA context and the children of any process holding a CUDA device. A rank's
DataLoader workers hold hundreds of fds each; reading all of them every cycle was most of the
cycle at 64 torch ranks with 3 workers each (bench/cycle_profile.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuwatchd.model import ProcessInfo, ProcEvidence, RankEntry
from gpuwatchd.sources.devfds import EvidenceReader


def fork_evidence(
    reader: EvidenceReader,
    entries: Sequence[RankEntry],
    processes: Mapping[int, ProcessInfo],
    descendants: Mapping[int, tuple[int, ...]],
    gpu_pids: set[int] | None,
) -> dict[int, ProcEvidence]:
    """The devfds evidence the fork_after_cuda rule needs: of the trees of ranks with children
    where a process holds a CUDA context (``gpu_pids``, NVML's process list; None when NVML gave
    no reading: every tree), the processes NVML lists and the children of any process that holds
    a CUDA device, in breadth-first order (a parent before its children). A child of a process
    without one can be no fork-after-CUDA child, so its hundreds of fds are not looked at."""
    evidence: dict[int, ProcEvidence] = {}
    for e in entries:
        tree = (e.pid, *descendants.get(e.pid, ()))
        if e.pid not in processes or len(tree) < 2:
            continue
        if gpu_pids is not None and not gpu_pids.intersection(tree):
            continue
        for pid in tree:
            if gpu_pids is not None and pid not in gpu_pids:
                info = processes.get(pid)
                parent = evidence.get(info.ppid) if info is not None else None
                if parent is None or not parent.holds_cuda_device:
                    continue
            info = processes.get(pid)
            ev = reader.read(pid, info.open_fds if info is not None else None)
            if ev is not None:
                evidence[pid] = ev
    reader.forget(evidence)
    return evidence
