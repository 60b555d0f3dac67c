"""One rank of a 2-rank torchrun job that trains on the GPU and injects one fault of NVIDIA's catalog.

The faults are the eleven of nvidia-resiliency-ext's ``Fault`` enum
(``src/nvidia_resiliency_ext/inprocess/tools/inject_fault.py``), injected the way that tool
injects them, written again here (the tool needs its package; the shapes are what matter):

- ``GPU``: a device-side assert (an out-of-range index on the GPU), from a thread;
- ``GPU_SLEEP``: ``torch.cuda._sleep`` of 2**62 cycles on the rank's device, from a thread: the
  main thread's next synchronisation waits behind a kernel that never ends;
- ``ASYNC_EXC``: an exception raised asynchronously in the main thread;
- ``SIGNAL_EXC``: SIGUSR1 from a forked helper, whose handler raises;
- ``ABORT``: ``os.abort()`` from a thread (SIGABRT);
- ``GIL``: a catastrophic regular expression in a thread, which holds the GIL for good;
- ``SEGFAULT``: ``ctypes.string_at(1)`` from a thread (SIGSEGV);
- ``INT``, ``KILL``, ``TERM``, ``STOP``: that signal from a forked helper.

Usage (under torchrun, which sets RANK/WORLD_SIZE/MASTER_*):
``fault_rank.py FAULT --fault-rank 1 --delay SECONDS``. Every rank prints ``ready`` after its first
step; the faulted rank prints ``fault <unix time>`` at the moment it injects. Each step does a
matmul on cuda:0, a backward pass, a gloo ``all_reduce`` of the gradients and an SGD step (both
ranks share one GPU: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

FAULTS = ("GPU", "GPU_SLEEP", "ASYNC_EXC", "SIGNAL_EXC", "ABORT", "GIL", "SEGFAULT", "INT", "KILL", "TERM", "STOP")


class InjectedError(Exception):
    pass


def said_fault() -> None:
    print(f"fault {time.time():.3f}", flush=True)


def _signal_later(pid: int, sig: int, delay: float) -> None:
    time.sleep(delay)
    print(f"fault {time.time():.3f}", flush=True)
    os.kill(pid, sig)


def _raise_in(tid: int, delay: float) -> None:
    time.sleep(delay)
    said_fault()
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    set_async_exc(tid, InjectedError)


def _gpu_error(delay: float) -> None:
    time.sleep(delay)
    said_fault()
    index = torch.ones(1, dtype=torch.int64, device="cuda")
    target = torch.ones(1, dtype=torch.int64, device="cuda")
    target[index] = 0  # index 1 of a 1-element tensor: a device-side assert


def _gpu_sleep(delay: float, device: int) -> None:
    time.sleep(delay)
    said_fault()
    torch.cuda.set_device(device)
    torch.cuda._sleep(1 << 62)


def _hold_gil(delay: float) -> None:
    time.sleep(delay)
    said_fault()
    re.match(r"(a?){40}a{40}", "a" * 40)


def _segfault(delay: float) -> None:
    time.sleep(delay)
    said_fault()
    ctypes.string_at(1)


def _abort(delay: float) -> None:
    time.sleep(delay)
    said_fault()
    os.abort()


def _on_usr1(signum: int, frame: object) -> None:
    raise InjectedError


def inject(fault: str, delay: float) -> None:
    fork = multiprocessing.get_context("fork")
    signals = {
        "SIGNAL_EXC": signal.SIGUSR1,
        "INT": signal.SIGINT,
        "KILL": signal.SIGKILL,
        "TERM": signal.SIGTERM,
        "STOP": signal.SIGSTOP,
    }
    if fault in signals:
        if fault == "SIGNAL_EXC":
            signal.signal(signal.SIGUSR1, _on_usr1)
        fork.Process(target=_signal_later, args=(os.getpid(), signals[fault], delay), daemon=True).start()
        return
    threads = {
        "ASYNC_EXC": (_raise_in, (threading.main_thread().ident, delay)),
        "GPU": (_gpu_error, (delay,)),
        "GPU_SLEEP": (_gpu_sleep, (delay, torch.cuda.current_device())),
        "GIL": (_hold_gil, (delay,)),
        "SEGFAULT": (_segfault, (delay,)),
        "ABORT": (_abort, (delay,)),
    }
    target, args = threads[fault]
    threading.Thread(target=target, args=args, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("fault", choices=[*FAULTS, "NONE"])
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--delay", type=float, default=5.0)
    ap.add_argument("--step-seconds", type=float, default=0.05)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = 0
    while True:
        x = torch.randn(256, 1024, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            grad = p.grad.cpu()
            dist.all_reduce(grad)
            p.grad.copy_(grad / world)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if step == 0:
            print("ready", flush=True)
            if rank == args.fault_rank and args.fault != "NONE":
                inject(args.fault, args.delay)
        step += 1
        time.sleep(args.step_seconds)


if __name__ == "__main__":
    sys.exit(main())
