"""Hung and compiling ranks on a real GPU for tests/gpu/test_hang_shapes.py.

usage: hang_shape_rank.py MODE RANK_DIR JOB_ID RANK [PORT]
Each registers with gpuwatchd.register_rank() (GPU 0) and beats gpuwatchd.heartbeat(step) a few
times, prints "ready", then:
  sync_busy     torch.cuda.synchronize() behind a minutes-long kernel (torch.cuda._sleep)
  item_busy     .item() behind the same kind of kernel
  deadlock_gpu  seed 003: 2 GiB held on the GPU, two threads deadlocked on two locks, main joins
  idle_wait     torch.cuda.synchronize() behind a stream that waits for a value nobody writes
                (cuStreamWaitValue32, on a stream of its own): the GPU is idle, the wait
                never completes
  compile       torch.compile of a small model, then trains (heartbeats resume after compiling);
                GW_DEVICE=cpu compiles for the CPU (Inductor's C++ backend), for a machine
                without a GPU
  gloo          rank RANK of a 2-rank gloo job (TCP on 127.0.0.1:PORT): four all_reduces
                together, then rank 1 stops before collective #5 and rank 0 waits in it;
                with GW_GLOO_DESYNC=1 rank 1 calls broadcast as #5 instead (a desync)
"""

import ctypes
import datetime
import os
import sys
import threading
import time

import torch

import gpuwatchd

mode, rank_dir, job_id, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gpuwatchd.register_rank(job_id, rank, rank_dir=rank_dir, gpus=["0"], world_size=2 if mode == "gloo" else 1)
for step in range(3):
    gpuwatchd.heartbeat(step)
    time.sleep(0.05)
CYCLES = int(4e11)  # ~200 s of torch.cuda._sleep on an H200


def ready() -> None:
    print("ready", flush=True)


if mode == "sync_busy":
    x = torch.ones(1, device="cuda")
    torch.cuda._sleep(CYCLES)
    ready()
    torch.cuda.synchronize()
elif mode == "item_busy":
    x = torch.ones(1, device="cuda")
    torch.cuda._sleep(CYCLES)
    ready()
    x.item()
elif mode == "deadlock_gpu":
    held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
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
    for t in threads:
        t.start()
    ready()
    for t in threads:
        t.join()
elif mode == "idle_wait":
    # On a stream of its own (the legacy default stream 0 serialises with every other stream):
    # the stream waits for a value nobody writes, and synchronize() waits for that stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = getattr(cuda, "cuStreamWaitValue32_v2", None) or cuda.cuStreamWaitValue32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    print("enqueue wait", flush=True, file=sys.stderr)
    rc = fn(ctypes.c_void_p(side.cuda_stream), ctypes.c_uint64(flag.data_ptr()), 1, 0x1)  # EQ
    print(f"cuStreamWaitValue32 rc={rc}", flush=True, file=sys.stderr)
    assert rc == 0, f"cuStreamWaitValue32 returned {rc}"
    ready()
    side.synchronize()
elif mode == "compile":
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.LayerNorm(512)]
    device = os.environ.get("GW_DEVICE", "cuda")
    net = torch.nn.Sequential(*layers).to(device)
    f = torch.compile(net)
    ready()
    step = 3
    while True:
        f(torch.randn(64, 512, device=device)).sum().item()
        gpuwatchd.heartbeat(step)
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(0.05)
elif mode == "gloo":
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{sys.argv[5]}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )
    t = torch.ones(4)
    for step in range(1, 5):
        dist.all_reduce(t)
        gpuwatchd.heartbeat(step)
    ready()
    if rank == 1 and os.environ.get("GW_GLOO_DESYNC"):
        dist.broadcast(t, src=0)  # a desync: rank 0 calls all_reduce as collective #5
    elif rank == 1:
        time.sleep(10**6)  # stops before collective #5
    dist.all_reduce(t)  # rank 0 waits here for rank 1
