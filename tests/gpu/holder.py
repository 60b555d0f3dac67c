"""A process that holds GPU memory until killed (GPU suite helper, also used by bench/).

    python3 tests/gpu/holder.py --gib 5 [--device 0] [--ready-file PATH]

Allocates ``--gib`` GiB with torch on one CUDA device, writes its PID to the ready file (or prints
``READY <pid>``), then sleeps (or, with ``--work-ms``, works a little every 50 ms). Exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--ready-file", default="")
    ap.add_argument("--heartbeat", default="", help="touch this file every second (a rank's gpuwatchd.heartbeat)")
    ap.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="instead of sleeping a second at a "
        "time, use this many ms of CPU every 50 ms (the CPU side of a training loop), "
        "heartbeat once a second",
    )
    args = ap.parse_args()
    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    block = torch.empty(int(args.gib * (1 << 30)), dtype=torch.uint8, device=f"cuda:{args.device}")
    block.fill_(1)
    torch.cuda.synchronize()
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, args.ready_file)
    else:
        print(f"READY {os.getpid()}", flush=True)
    while True:
        if args.heartbeat:
            with open(args.heartbeat, "a"):
                os.utime(args.heartbeat)
        if not args.work_ms:
            time.sleep(1)
            continue
        for _ in range(20):
            t = time.perf_counter()
            while time.perf_counter() - t < args.work_ms / 1e3:
                pass
            time.sleep(max(0.0, 0.05 - args.work_ms / 1e3))


if __name__ == "__main__":
    sys.exit(main())
