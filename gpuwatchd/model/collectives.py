"""A rank's collectives as its flight recorder tells them, and the bounds of reading one.

Made by gpuwatchd/join/flight_recorder.py from a rank's answer (the rank API's request file, or
PyTorch's dump pipe: gpuwatchd/sources/torch_dump_pipe.py); exported as
``gpuwatch_rank_collective_last_*``. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_GROUPS = 16  # process groups kept per rank (series budget)
MAX_ENTRIES_READ = 4096  # flight-recorder entries read of one answer or dump


@dataclass(frozen=True)
class CollectiveStatus:
    """One process group of one rank, from its flight-recorder dump (gpuwatchd/join/flight_recorder.py)."""

    job_id: str
    rank: int
    pid: int
    pg: str  # process group id as the flight recorder names it ("0" = the default group)
    last_started: int  # highest collective sequence number the rank entered (-1: none)
    last_completed: int  # highest one it completed (-1: none)
    last_name: str = ""  # profiling name of the last one entered, e.g. "gloo:all_reduce"
    timestamp: float = 0.0  # when the rank wrote the dump
