"""Rank 0 evaluates alone on the GPU while rank 1 waits in a barrier, for
tests/gpu/test_job_progress.py: the shape issue 33 measured paged (rank 1 40 s into the wait, rank 0
20 s later) on every job whose rank 0 evaluates, saves or uploads a checkpoint while the rest wait.

usage: torchrun --nproc-per-node 2 eval_alone_rank.py EVAL_SECONDS ROUNDS
Each round: 20 training steps on both ranks (a small MLP on cuda:0, its loss all_reduced over
gloo), then rank 0 evaluates for EVAL_SECONDS (``torch.no_grad()``, ``.item()`` per batch) while
rank 1 waits in ``dist.barrier()``; rank 0 joins the barrier after its evaluation. Both ranks
hold memory on GPU 0 (a one-GPU machine). Rank 0 prints "ready" after the first steps and
"eval N" as each evaluation starts, "done" at the end.
"""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
eval_seconds, rounds = float(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to("cuda:0")
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(512, 1024, device="cuda:0")


def say(text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def train(steps: int) -> None:
    for _ in range(steps):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)


train(5)
say("ready")
for n in range(rounds):
    train(20)
    if rank == 0:
        say(f"eval {n}")
        t0 = time.monotonic()
        with torch.no_grad():
            while time.monotonic() - t0 < eval_seconds:
                batch = torch.randn(512, 1024, device="cuda:0")
                model(batch).square().mean().item()
    dist.barrier()
say("done")
dist.destroy_process_group()
