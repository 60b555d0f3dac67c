#!/usr/bin/env python3
"""Cost of the memory subsystem per cycle (issue 17, DESIGN §7 budget), beside the procfs part.

For N ranks (real processes) in real v1 memory cgroups, laid out two ways — all N in one cgroup
(one Slurm job: the levels are read once per cycle and shared) and one cgroup each (N containers)
— measures the CPU time of ``MemorySubsystem.track`` (cgroup files, PSI, meminfo, the
tracker) as the difference between the real ``Daemon.cycle()`` with and without the subsystem,
side by side with the cycle without it (rank files, /proc, join), per cycle and per rank.

    sudo .venv/bin/python -m bench.memory_cycle [--sizes 8,64] [--cycles 50]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from gpuwatchd.config.schema import Config, DiscoveryConfig, GilConfig, NvmlConfig
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.wiring import Parts, no_parts
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.pyspy import PySpy
from tests.kernel_oom_helpers import MemCgroup

CHILD = "import sys; x = bytearray(8 << 20); print(flush=True); sys.stdin.read()"


def measure(n: int, shared: bool, cycles: int) -> tuple[float, float]:
    groups = (
        [MemCgroup("gwmemory_bench", 1 << 30)]
        if shared
        else [MemCgroup(f"gwmemory_bench{i}", 1 << 30) for i in range(n)]
    )
    try:
        procs = [groups[0 if shared else i].spawn(CHILD) for i in range(n)]
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Config(
                rank_dir=f"{tmp}/ranks",
                state_dir=f"{tmp}/state",
                kernel_log="off",
                gil=GilConfig(enabled=False),
                nvml=NvmlConfig(enabled=False),
                discovery=DiscoveryConfig(enabled=False),
            )
            write_rank_file(
                cfg.rank_dir,
                {
                    "version": 1,
                    "job_id": "bench",
                    "world_size": n,
                    "ranks": [{"rank": i, "pid": p.pid} for i, p in enumerate(procs)],
                },
                "bench.json",
            )
            plain = Daemon(cfg, parts=no_parts, write_state=False)
            with_memory = Daemon(
                cfg, write_state=False, parts=lambda c, s: Parts(memory=MemorySubsystem(c, s, spy=PySpy(None)))
            )
            cpu = {}
            for name, d in (("plain", plain), ("memory", with_memory)):
                d.cycle()  # rank files and start times learnt
                t0 = time.process_time()
                for _ in range(cycles):
                    d.cycle()
                cpu[name] = (time.process_time() - t0) / cycles
            return cpu["memory"] - cpu["plain"], cpu["plain"]
    finally:
        for g in groups:
            g.remove()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8,64")
    ap.add_argument("--cycles", type=int, default=50)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {args.cycles} cycles each")
    for n in (int(x) for x in args.sizes.split(",")):
        for shared in (True, False):
            mem, proc = measure(n, shared, args.cycles)
            layout = "one cgroup (one job)" if shared else "a cgroup each"
            print(
                f"N={n:3d} ranks, {layout:21s}: memory {mem * 1e3:6.2f} ms CPU/cycle "
                f"({mem / n * 1e6:5.1f} us/rank) | rest of the cycle {proc * 1e3:6.2f} ms "
                f"({proc / n * 1e6:5.1f} us/rank) | at a 5 s cycle the memory part is "
                f"{mem / 5 * 100:.3f} % of a core"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
