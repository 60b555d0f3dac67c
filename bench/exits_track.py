#!/usr/bin/env python3
"""The exits part's cost: ``ExitsSubsystem.track`` at 64 watched ranks (real sleeping processes,
a pidfd each), 500 calls in-process, and the CPU of its watcher thread while nothing exits.

    .venv/bin/python -m bench.exits_track
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from bench.benchlib import cpu_seconds
from gpuwatchd.config.schema import Config
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.exits import ExitsSubsystem
from gpuwatchd.daemon.services import Services
from gpuwatchd.daemon.subsystem import Ranks
from gpuwatchd.model import RankEntry
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.procfs import ProcfsReader

RANKS = 64
CALLS = 500


class Context:
    """What of a daemon the part uses (``DaemonContext``)."""

    def __init__(self, paths: HostPaths) -> None:
        self.config = Config()
        self.paths = paths
        self.clock = time.time
        self.counters = CounterStore()
        self.procfs = ProcfsReader(paths)
        self.stop_event = threading.Event()
        self.services = Services.build(self.config, paths, event_log=False)

    def request_exit(self, status: int, why: str) -> None:
        raise SystemExit(why)


def main() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(RANKS)]
    try:
        time.sleep(1)
        ctx = Context(HostPaths())
        part = ExitsSubsystem(ctx.services)
        part.start(ctx)  # type: ignore[arg-type]
        entries = tuple(RankEntry(job_id="bench", rank=i, pid=p.pid, source="environ") for i, p in enumerate(procs))
        processes = {p.pid: ctx.procfs.read_process(p.pid) for p in procs}
        ranks = Ranks(time.time(), entries, processes, {}, {})
        part.track(ctx, ranks)  # type: ignore[arg-type]
        assert part.watcher.watched == RANKS
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(CALLS):
            part.track(ctx, ranks)  # type: ignore[arg-type]
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        print(f"track at {RANKS} ranks: {cpu / CALLS * 1e6:.0f} us CPU per cycle ({wall / CALLS * 1e6:.0f} us wall)")
        thread = part.watcher._thread
        assert thread is not None and thread.native_id is not None
        before = cpu_seconds("self", children=False, tid=thread.native_id)
        time.sleep(10)
        spent = cpu_seconds("self", children=False, tid=thread.native_id) - before
        print(f"watcher thread CPU over 10 s with nothing exiting: {spent:.2f} s")
        part.stop()
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
