"""An NCCL training job for tests/gpu/test_nccl_ras_gpu.py, started by torchrun, every rank on cuda:0.

World size 1 is one process. With ``--split-hosts`` each rank sets ``NCCL_HOSTID`` to its own
value before NCCL starts: NCCL tells nodes apart by that hash (src/misc/utils.cc
``getHostHash``), so two ranks on one GPU are two "nodes" to it, joined by its socket transport
(``NCCL_SOCKET_IFNAME=lo`` from the test), and it no longer refuses them as a duplicate GPU
(src/init.cc, "Duplicate GPU detected": same host hash and bus ID). Their communicator has two
ranks, whose collectives NCCL counts (a one-rank communicator's it never does).

It registers with ``gpuwatchd.register_rank(flight_recorder=False)`` (so a flight-recorder dump can
only come through torch's own pipe) and then trains: a Linear layer whose gradients go through
``dist.all_reduce`` on the NCCL backend, every ``--step-seconds``. Its phases, from files in
``--out``: ``quiet`` (keeps training, no more ``heartbeat()``: the job looks stalled to gpuwatchd
while NCCL's counts move), ``hang`` (no more collectives either: sleeps in Python). It writes
``step`` after every step and ``nccl`` (torch.cuda.nccl.version()) at start (rank 0 only).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import gpuwatchd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--step-seconds", type=float, default=0.1)
    ap.add_argument("--split-hosts", action="store_true")
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.split_hosts:
        os.environ["NCCL_HOSTID"] = f"gpuwatch-ras-test-{rank}"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    if rank == 0:
        with open(os.path.join(args.out, "nccl"), "w") as f:
            f.write(".".join(map(str, torch.cuda.nccl.version())) + "\n")
    assert gpuwatchd.register_rank(args.job_id, strict=True, flight_recorder=False)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        if os.path.exists(os.path.join(args.out, "hang")):
            time.sleep(0.1)
            continue
        loss = model(torch.randn(64, 256, device="cuda")).square().mean()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if not os.path.exists(os.path.join(args.out, "quiet")):
            gpuwatchd.heartbeat(step)
        if rank == 0:
            tmp = os.path.join(args.out, "step.tmp")
            with open(tmp, "w") as f:
                f.write(f"{step}\n")
            os.replace(tmp, os.path.join(args.out, "step"))
        step += 1
        time.sleep(args.step_seconds)


if __name__ == "__main__":
    main()
