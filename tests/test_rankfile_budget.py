"""Issue 37 R6: one user's rank files cost a bounded time and memory per cycle, and never another
owner's reading. Every rank of every file was parsed before any cap: 256 files of 4096 ranks each
got the daemon OOM-killed in its 256 MiB cgroup within 10 s (16 files of 100 KB: 76 MB of RSS;
64 files: 137 MB), and ``gpuwatchd check`` took 16 s and 1.4 GB. A real second user writes the
files; the real reader (the daemon's and ``check``'s) reads them in a process of its own, whose
peak RSS and time are measured against the same reader on root's file alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from userutil import as_user, rank_world_fixture, system_user

U1 = "gw-crowd-u1"  # test_rankfile_crowding.py's user
REPO = Path(__file__).resolve().parent.parent

# argv: rank_dir. Three scans (three cycles) with one reader, as the daemon makes them.
SCAN = r"""
import json, resource, sys, time
from gpuwatchd.sources.rankfiles import RankFileReader
reader = RankFileReader(sys.argv[1])
t0 = time.monotonic()
for _ in range(3):
    entries, bad = reader.scan()
print(json.dumps({"seconds": time.monotonic() - t0, "jobs": sorted({e.job_id for e in entries}),
                  "entries": len(entries), "bad": [b.reason for b in bad],
                  "unread": sorted(reader.unread_owners),
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

# argv: rank_dir, files, ranks per file: U1's files, ~25 bytes a rank (4096 ranks: 100 KB).
WRITE = r"""
import json, os, sys
d, files, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for f in range(files):
    doc = {"version": 1, "job_id": f"flood{f}", "ranks": [{"rank": r, "pid": os.getpid()} for r in range(ranks)]}
    with open(f"{d}/flood{f:03d}.json", "w") as out:
        json.dump(doc, out, separators=(",", ":"))
"""


@pytest.fixture(scope="module")
def u1() -> Iterator[int]:
    with system_user(U1) as uid:
        yield uid


world = rank_world_fixture("gw-budget-")


def _scan(ranks: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", SCAN, str(ranks)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.mark.parametrize(("files", "per_file", "size"), [(64, 4096, 100_000), (64, 200, 5000)])
def test_r6_one_users_rank_files_cost_a_bounded_parse(
    u1: int, world: Path, files: int, per_file: int, size: int
) -> None:
    """64 files of 4096 ranks (each refused before it is decoded: more ranks than an owner may
    have), and 64 files of 200 (read until the owner's 1024 ranks are reached)."""
    ranks = world / "ranks"
    (ranks / "root.json").write_text(
        json.dumps({"version": 1, "job_id": "rootjob", "ranks": [{"rank": 0, "pid": os.getpid()}]})
    )
    alone = _scan(ranks)
    assert alone["jobs"] == ["rootjob"]
    written = as_user(U1, "/usr/bin/python3", "-c", WRITE, str(ranks), str(files), str(per_file))
    assert written.returncode == 0, written.stderr
    assert 0.9 * size < (ranks / "flood000.json").stat().st_size < 1.1 * size
    flooded = _scan(ranks)
    grew = flooded["maxrss_mb"] - alone["maxrss_mb"]
    print(
        f"root's file alone: {alone['maxrss_mb']:.0f} MB, {alone['seconds']:.2f} s; with U1's {files} "
        f"files of {per_file} ranks: {flooded['maxrss_mb']:.0f} MB (+{grew:.0f}), "
        f"{flooded['seconds']:.2f} s for three scans, {flooded['entries']} entries"
    )
    assert "rootjob" in flooded["jobs"]
    assert grew < 20, flooded  # was +130 MB: every rank of every file parsed
    assert flooded["seconds"] < 2.0, flooded
    # root's rank and at most one owner's share (the file that reaches it is read whole)
    assert flooded["entries"] <= 1 + 1024 + per_file
    assert u1 in flooded["unread"]  # check --kill spares U1's processes: their files were not all read
