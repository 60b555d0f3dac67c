"""Ranks that nobody changed, for tests/gpu/test_discovered_shapes.py (issue 22): no
register_rank(), no heartbeat; the daemon finds them by torchrun's variables (RANK,
TORCHELASTIC_RUN_ID, set by the test) and judges them by their stacks, /proc and NVML.

usage: discovered_rank.py MODE [PORT PAUSE]
  item_loop    healthy: a matmul loop synced with .item() every step
  ckpt         healthy: rank RANK of a 2-rank gloo job; each step a matmul + .item() and an
               all_reduce; every 10th step rank 0 "checkpoints" for PAUSE s (hashlib in C, the GIL
               released) while rank 1 waits in all_reduce
  gpu_spin     hung: one kernel that never ends (torch.cuda._sleep) while the rank waits in
               torch.cuda.synchronize()
  gpu_spin_item hung: the same behind .item()
  deadlock     hung: two threads deadlocked on two locks, the main thread joins them
  data_hang    rank RANK of a WORLD_SIZE-rank gloo job: two all_reduces together, then the last
               rank blocks in load_batch forever (0 % CPU) and the others wait in all_reduce
Prints "ready" when the shape is in place (for the healthy ones: after a few steps).
"""

import datetime
import hashlib
import os
import sys
import threading
import time

import torch

mode = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))


def ready() -> None:
    print("ready", flush=True)


def step(a: torch.Tensor) -> float:
    return (a @ a).sum().item()


if mode == "item_loop":
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(5):
        step(a)
    ready()
    while True:
        step(a)
elif mode in ("ckpt", "data_hang"):
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "2"))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{sys.argv[2]}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    t = torch.ones(4)
    if mode == "data_hang":
        for _ in range(2):
            dist.all_reduce(t)
        ready()

        def load_batch() -> None:
            threading.Event().wait()  # the batch never comes: 0 % CPU

        if rank == world - 1:
            load_batch()
        dist.all_reduce(t)  # the others wait here for the last rank
    pause = float(sys.argv[3])
    a = torch.randn(4096, 4096, device=f"cuda:{0}")
    buf = bytes(64 << 20)
    n = 0
    while True:
        step(a)
        dist.all_reduce(t)
        n += 1
        if n == 5:
            ready()
        if n % 10 == 0 and rank == 0:
            t0 = time.monotonic()
            while time.monotonic() - t0 < pause:  # a checkpoint: serialising, hashing in C
                hashlib.sha256(buf).digest()
elif mode in ("gpu_spin", "gpu_spin_item"):
    x = torch.ones(1, device="cuda")
    torch.cuda._sleep(int(4e11))  # ~200 s on an H200
    ready()
    if mode == "gpu_spin":
        torch.cuda.synchronize()
    else:
        x.item()
elif mode == "deadlock":
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    params, grads = threading.Lock(), threading.Lock()
    both = threading.Barrier(2)

    def loader() -> None:
        both.wait()
        with params:
            time.sleep(0.1)
            with grads:
                pass

    def writer() -> None:
        both.wait()
        with grads:
            time.sleep(0.1)
            with params:
                pass

    threads = [threading.Thread(target=loader, name="loader"), threading.Thread(target=writer, name="writer")]
    for th in threads:
        th.start()
    ready()
    for th in threads:
        th.join()
else:
    raise SystemExit(f"unknown mode {mode}")
