"""fork_after_cuda: a rank that holds a CUDA context forked a child (e.g. a DataLoader worker with
the ``fork`` start method) that inherited its ``/dev/nvidia*`` descriptors.

CUDA does not survive fork: the child's copy of the context is unusable and any CUDA call in it
fails or corrupts state (CUDA C Programming Guide, "Initialization"; PyTorch "CUDA in
multiprocessing" note). How fork is told from spawn/forkserver, from /proc only
(``ctx.parts.gpu.fork_evidence``: pid -> ``model.ProcEvidence``), all three must hold:

1. the parent holds a CUDA context: ``/dev/nvidiactl`` or ``/dev/nvidia-uvm`` open;
2. no fresh exec in the child: same ``/proc/PID/exe`` *and* identical ``/proc/PID/cmdline`` as the
   parent. A fork child keeps the parent's argv; a ``spawn`` child is exec'd as
   ``python -c 'from multiprocessing.spawn import spawn_main; ...'``; a ``forkserver`` child is a
   child of the forkserver process (itself exec'd, without CUDA), not of the rank;
3. the child has the parent's NVIDIA fds at the *same fd numbers* (inherited, not re-opened).

Measured on an H200 (tests/fixtures/nvml/README.md): the fork workers of a DataLoader showed the
rank's cmdline and the same 31 /dev/nvidia* fds (8 -> /dev/nvidiactl, 9 -> /dev/nvidia-uvm, ...);
spawn workers had a different cmdline and no /dev/nvidia* fd at all.

Whether the children used the GPU is said, not assumed: a child that NVML lists with memory of its
own (its own CUDA context, ``ctx.gpu_processes``) or that has a /dev/nvidia* descriptor its parent
did not hand it (a fd number or device opened after the fork) used the GPU: a fault in the
making ("CUDA error: initialization error" or state corrupted in that worker). Children with only
the inherited descriptors are a latent risk: nothing broke yet, a CUDA call in them would (the
usual DataLoader worker, which only moves CPU tensors). Both are ``warning``: the finding is the
rank owner's to fix, and a worker's CUDA error surfaces in the rank's own log and exit.
Shell equivalent: ``ls -l /proc/{RANK,CHILD}/fd | grep nvidia; cat /proc/CHILD/cmdline``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuwatchd.findings.context import FindingContext, rank_label
from gpuwatchd.model import WARNING, Finding, ProcEvidence
from gpuwatchd.units import fmt_bytes


def forked_children(parent: ProcEvidence, candidates: Iterable[ProcEvidence]) -> list[ProcEvidence]:
    if not parent.holds_cuda_device:
        return []
    inherited = set(parent.nvidia_fds)
    out = []
    for c in candidates:
        if c.ppid != parent.pid or c.pid == parent.pid:
            continue
        if c.exe != parent.exe or c.cmdline_digest != parent.cmdline_digest:
            continue  # fresh exec: spawn / forkserver / a subprocess
        if not inherited.intersection(c.nvidia_fds):
            continue
        out.append(c)
    return out


def gpu_use(parent: ProcEvidence, child: ProcEvidence, memory: Mapping[int, list[tuple[int, int | None]]]) -> list[str]:
    """What shows that ``child`` used the GPU itself ([] for inherited descriptors only)."""
    out = []
    for gpu, used in memory.get(child.pid, []):
        held = f" holding {fmt_bytes(used)}" if used is not None else ""
        out.append(f"PID {child.pid} has its own CUDA context on GPU {gpu}{held} (NVML)")
    inherited = set(parent.nvidia_fds)
    opened = sorted({t for fd, t in child.nvidia_fds if (fd, t) not in inherited})
    if opened:
        out.append(f"PID {child.pid} opened {', '.join(opened[:3])} after the fork")
    return out


def find(ctx: FindingContext) -> Iterable[Finding]:
    evidence: Mapping[int, ProcEvidence] = ctx.parts.gpu.fork_evidence
    if not evidence:
        return
    memory: dict[int, list[tuple[int, int | None]]] = {}
    for row in ctx.gpu_processes:
        memory.setdefault(row.pid, []).append((row.gpu_index, row.used_memory_bytes))
    for r in ctx.ranks:
        if not r.alive:
            continue
        tree = [evidence[p] for p in r.tree if p in evidence]
        for parent in tree:
            kids = forked_children(parent, tree)
            if not kids:
                continue
            pids = ", ".join(str(k.pid) for k in kids)
            handed = set(parent.nvidia_fds)
            shared = sorted({t for k in kids for fd, t in k.nvidia_fds if (fd, t) in handed})
            who = rank_label(r) if parent.pid == r.pid else f"PID {parent.pid} in {rank_label(r)}"
            used = [u for k in kids for u in gpu_use(parent, k, memory)]
            if used:
                state = (
                    "; a child used the GPU after the fork (a fault: CUDA fails or corrupts "
                    f"state there): {'; '.join(used[:4])}"
                )
            else:
                state = (
                    "; no child used the GPU (inherited descriptors only: a latent risk, a "
                    "CUDA call in a child would fail)"
                )
            yield Finding(
                kind="fork_after_cuda",
                severity=WARNING,
                job_id=r.job_id,
                rank=str(r.rank),
                pid=str(parent.pid),
                explanation=(
                    f"{who} holds a CUDA context and forked {len(kids)} child process(es) "
                    f"(PID {pids}) that inherited its NVIDIA device descriptors "
                    f"({', '.join(shared[:4])}){state}; use the 'spawn' or 'forkserver' start "
                    f"method (DataLoader(multiprocessing_context='spawn'))"
                ),
                evidence={
                    "children": [k.pid for k in kids],
                    "devices": shared,
                    "used_gpu": bool(used),
                    "gpu_use": used[:8],
                },
            )
