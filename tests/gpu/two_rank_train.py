"""A small data-parallel training job for tests/gpu/test_nccl_oom_hang.py, started by torchrun.

Each rank registers itself with ``gpuwatchd.register_rank()`` (torchrun's RANK/LOCAL_RANK/
WORLD_SIZE/TORCHELASTIC_RUN_ID) and calls ``gpuwatchd.heartbeat(step)`` after every optimizer step.
Gradients are averaged with ``dist.all_reduce``. Both ranks share one device (``cuda:0`` with the
gloo backend, since NCCL refuses two ranks on one GPU; ``cpu`` for development without a GPU).

Once the file ``--leak-when`` exists, rank ``--leak-rank`` starts keeping ``--leak-mib`` MiB of
host memory per step (a "keep every batch for logging" leak) until the kernel OOM-kills it inside
the memory cgroup the test moved it into.

Why a forked helper: gloo talks TCP, and a dead peer's sockets are closed by the kernel, so gloo
would fail the survivor's all_reduce at once ("Connection closed by peer"). NCCL inside a node
(P2P/NVLink/shared memory) notices nothing and waits until the process group's timeout; that
hang is the story under test. Right after ``init_process_group`` each rank forks a helper process
(as DataLoader workers and asynchronous checkpoint writers are forked), which inherits the rank's
gloo sockets and keeps them open after the rank dies, so the survivor waits in all_reduce until
the timeout given by ``--timeout-seconds``, as an NCCL rank would.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import time

import torch
import torch.distributed as dist

import gpuwatchd


def keep_inherited_sockets(lifetime: float) -> None:
    """The forked helper: holds the inherited file descriptors; ends after ``lifetime`` s."""
    deadline = time.monotonic() + lifetime
    while time.monotonic() < deadline:
        time.sleep(0.5)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device, world: int) -> float:
    x = torch.randn(64, 256, device=device)
    loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--timeout-seconds", type=float, default=600.0)
    ap.add_argument("--step-seconds", type=float, default=0.2)
    ap.add_argument("--leak-rank", type=int, default=1)
    ap.add_argument("--leak-mib", type=int, default=32)
    ap.add_argument("--leak-when", default="")
    ap.add_argument("--out", required=True, help="directory for <rank>.helper and <rank>.step")
    ap.add_argument("--helper-lifetime", type=float, default=300.0)
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_seconds))
    rank, world = dist.get_rank(), dist.get_world_size()
    # forked before CUDA is touched, so the helper holds no /dev/nvidia* descriptors
    helper = multiprocessing.get_context("fork").Process(
        target=keep_inherited_sockets, args=(args.helper_lifetime,), daemon=True
    )
    helper.start()
    with open(os.path.join(args.out, f"{rank}.helper"), "w") as f:
        f.write(f"{helper.pid}\n")
    assert gpuwatchd.register_rank(strict=True)

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    step = 0
    while True:
        loss = train_step(model, opt, device, world)
        gpuwatchd.heartbeat(step)
        if step % 10 == 0:
            print(f"rank {rank} step {step} loss {loss:.4f}", flush=True)
        with open(os.path.join(args.out, f"{rank}.step.tmp"), "w") as f:
            f.write(f"{step}\n")
        os.replace(os.path.join(args.out, f"{rank}.step.tmp"), os.path.join(args.out, f"{rank}.step"))
        if rank == args.leak_rank and args.leak_when and os.path.exists(args.leak_when):
            kept.append(torch.ones(args.leak_mib << 20, dtype=torch.uint8))  # every page written
        time.sleep(args.step_seconds)
        step += 1


if __name__ == "__main__":
    main()
