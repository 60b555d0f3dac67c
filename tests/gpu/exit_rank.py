"""A rank of a 2-rank torchrun job for tests/gpu/test_rank_exits.py: a CUDA matmul and a gloo
all_reduce every step; rank 1 meets FAULT after AFTER seconds (segv: ``ctypes.string_at(1)``;
exc: an uncaught exception; assert: a device-side assert, an out-of-range CUDA index; kill:
SIGKILL to itself). Rank 0 steps on until its launcher ends it or its all_reduce fails.

    torchrun --nproc-per-node 2 ... exit_rank.py FAULT AFTER
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

fault, after = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
dev = torch.device("cuda", 0)
x = torch.randn(1024, 1024, device=dev)
t0 = time.monotonic()
while True:
    y = x @ x
    t = torch.ones(1)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 1 and time.monotonic() - t0 > after:
        if fault == "segv":
            ctypes.string_at(1)
        elif fault == "exc":
            raise RuntimeError("a bug in the training step")
        elif fault == "assert":
            torch.arange(4, device=dev)[torch.tensor([10], device=dev)]
            torch.cuda.synchronize()
        elif fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
