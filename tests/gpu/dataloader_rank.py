"""A "rank" that initialises CUDA, then starts a DataLoader with a given start method.

    python3 tests/gpu/dataloader_rank.py --start-method fork|spawn|forkserver --ready-file PATH

Writes ``{"pid": ..., "workers": [...]}`` to the ready file once the workers are running, then
keeps iterating slowly until killed. GPU suite helper for the fork_after_cuda finding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> int:
        time.sleep(0.05)
        return i


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--start-method", default="fork")
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    x = torch.ones(1 << 20, device="cuda")  # CUDA context first: this is what makes fork unsafe
    torch.cuda.synchronize()
    loader = DataLoader(
        Slow(),
        batch_size=1,
        num_workers=args.workers,
        multiprocessing_context=args.start_method,
        persistent_workers=True,
    )
    it = iter(loader)
    next(it)
    workers = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "workers": workers}, f)
    os.replace(tmp, args.ready_file)
    while True:
        next(it)
        x += 1


if __name__ == "__main__":
    sys.exit(main())
