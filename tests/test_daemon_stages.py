"""Issue 26 item 1: the track stage calls each part by name with what it needs, and each source
read runs under the isolation wrapper.

- The flight recorder gets the stall part's verdicts as an argument, not through a list
  position: with the flight recorder listed *before* the stall part, two real ranks that stop
  beating still get asked for their dumps (before, the flight recorder read a ``cycle.stall``
  that only a py-spy part earlier in the list had filled, and never asked).
- A memory-cgroup read that raises loses that reading only: the memory collector stays up and the
  node's memory and the rank's tree RSS are still there (before, the whole memory part was lost
  and exported as collector down).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daemonutil import write_config

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.flight_recorder import FlightRecorderSubsystem
from gpuwatchd.daemon.memory import MemorySubsystem
from gpuwatchd.daemon.stall import StallSubsystem
from gpuwatchd.daemon.wiring import Parts
from gpuwatchd.model import CgroupMemory, CgroupPaths
from gpuwatchd.sources.memcg import MemcgReader
from gpuwatchd.sources.pyspy import PySpy

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "fixtures" / "pyspy" / "programs"
FIX = Path(__file__).parent / "fixtures" / "hang"


def test_flight_recorder_gets_the_stall_verdicts_whatever_the_list_order(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, stall={"after_seconds": 1.0})
    cfg = load_config(str(path))
    d = Daemon(
        cfg,
        write_state=False,
        parts=lambda c, s: Parts(  # the flight recorder first
            flight_recorder=FlightRecorderSubsystem(c.stall.flight_recorder_interval_seconds),
            stall=StallSubsystem(c, s, spy=PySpy(None, unavailable_reason="not needed here")),
        ),
    )
    ranks = []
    try:
        for r in (0, 1):
            p = subprocess.Popen(
                [sys.executable, str(PROGRAMS / "hang_rank.py"), "fr", cfg.rank_dir, "stages-fr", str(r)],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO), "GW_FR_RECORDING": str(FIX / f"fr_gloo_rank{r}.json")},
            )
            ranks.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for s in d.subsystems:
            s.start(d)
        deadline = time.monotonic() + 30
        state = d.cycle()
        while not state.collectives and time.monotonic() < deadline:
            time.sleep(0.5)
            state = d.cycle()
        assert any(r.stalled for r in state.ranks), "the ranks never read as stalled"
        assert {(c.job_id, c.rank) for c in state.collectives} == {("stages-fr", 0), ("stages-fr", 1)}
    finally:
        d.shutdown()
        for p in ranks:
            p.kill()
            p.wait()


class BrokenMemcg(MemcgReader):
    """The real reader, but every cgroup read fails as a vanished file system would."""

    def read(self, where: CgroupPaths, memo: dict[tuple[int, str], Any] | None = None) -> CgroupMemory | None:
        raise OSError(5, "Input/output error")


def test_a_failing_memcg_read_loses_only_that_reading(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path)
    cfg = load_config(str(path))
    d = Daemon(
        cfg,
        write_state=False,
        parts=lambda c, s: Parts(
            memory=MemorySubsystem(c, s, reader=BrokenMemcg(s.paths, c.memory.cgroup_root), spy=PySpy(None))
        ),
    )
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        from gpuwatchd.rank.rankfile import write_rank_file

        write_rank_file(
            cfg.rank_dir,
            {"version": 1, "job_id": "stages-mem", "world_size": 1, "ranks": [{"rank": 0, "pid": p.pid}]},
            "stages-mem-0.json",
        )
        for sub in d.subsystems:
            sub.start(d)
        state = d.cycle()
        memory = next(c for c in state.collectors if c.name == "memory")
        assert memory.success, memory.error
        assert state.node_memory is not None and state.node_memory.total_bytes > 0
        (m,) = [m for m in state.rank_memory if m.job_id == "stages-mem"]
        assert m.tree_rss_bytes > 0 and m.cgroup == ""  # RSS still read; no cgroup this cycle
    finally:
        d.shutdown()
        p.kill()
        p.wait()
