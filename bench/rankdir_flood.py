#!/usr/bin/env python3
"""Cost of one rank-directory scan under a flood of junk files (issue 23 N1): N empty ``*.json``
files of one owner, scanned by ``RankFileReader.scan`` three times (the first parses, the others
hit the cache), wall time and the process's peak RSS, for this checkout and, with ``--before``,
another one (the code before a change), side by side in one run.

    python3 -m bench.rankdir_flood [--files 100000] [--before PATH]

Each checkout runs in a fresh interpreter started in that checkout (its ``gpuwatchd`` first on sys.path).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.benchlib import REPO

PROBE = r"""
import resource, sys, time
from gpuwatchd.sources.rankfiles import RankFileReader
r = RankFileReader(sys.argv[1])
times = []
for _ in range(3):
    t = time.perf_counter(); entries, bad = r.scan(); times.append(time.perf_counter() - t)
print(" ".join(f"{t:.3f}" for t in times), len(bad),
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--before", type=Path, default=None)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="gw-flood-"))
    try:
        for i in range(args.files):
            (d / f"!{i:06d}.json").touch()
        print(f"# {args.files} empty files of one owner, Python {sys.version.split()[0]}")
        print(f"{'checkout':<16} {'scan 1 s':>8} {'scan 2 s':>8} {'scan 3 s':>8} {'refusals':>8} {'peak RSS':>8}")
        for repo in [*([args.before] if args.before else []), REPO]:
            out = subprocess.run(
                [sys.executable, "-c", PROBE, str(d)], cwd=repo, capture_output=True, text=True, check=True
            ).stdout.split()
            print(f"{str(repo)[-16:]:<16} {out[0]:>8} {out[1]:>8} {out[2]:>8} {out[3]:>8} {out[4]:>5} MB")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
