"""The GIL fault of NVIDIA's catalog at the shipped stall bounds, without a GPU: fault to stalled.

A rank found by discovery (torchrun's variables) trains (a step's CPU work, then a wait) and starts a
thread that sleeps, then keeps the GIL in one catastrophic regular expression (as
``tests/gpu/fault_rank.py GIL``); a ``StallTracker`` at the shipped defaults (after_seconds 300,
conclusive_seconds 40, a cycle every 5 s, looks every 13.3 s) observes it each cycle. Prints the
delay from the fault to the ``gil`` verdict and the pacing of the dumps (the tracker's DEBUG lines),
for ``--main-repo`` checkouts side by side (each run alone, one after the other).

    .venv/bin/python -m bench.conclusive_gil [--main-repo /path/to/checkout ...] [--start 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent(
    """
    import re, sys, threading, time

    def hold():
        time.sleep(3.0)
        print("fault", time.time(), flush=True)
        re.match(r"(a?){40}a{40}", "a" * 40)  # keeps the GIL for good

    start, injected, t0 = float(sys.argv[1]), False, time.monotonic()
    print("ready", flush=True)
    while True:  # training: a step's CPU work, then a wait
        end = time.monotonic() + 0.03
        while time.monotonic() < end:
            pass
        time.sleep(0.1)
        if not injected and time.monotonic() - t0 > start:
            injected = True
            threading.Thread(target=hold, daemon=True).start()
    """
)

OBSERVE = textwrap.dedent(
    """
    import logging, os, subprocess, sys, time
    logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)8.0f %(message)s", stream=sys.stderr)
    from gpuwatchd.join.stall import StallTracker
    from gpuwatchd.model.stall import RankProbe
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.pyspy import PySpy, resolve_pyspy
    from gpuwatchd.sources.stall_looks import StallLooks
    from gpuwatchd.sources.threads import process_state

    rank, start = sys.argv[1], float(sys.argv[2])
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "g", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    p = subprocess.Popen([sys.executable, rank, str(start)], stdout=subprocess.PIPE, text=True, env=env)
    os.set_blocking(p.stdout.fileno(), False)
    t = StallTracker(300.0, StallLooks(PySpy(resolve_pyspy())), cycle_seconds=5.0, conclusive_seconds=40.0)
    fault, t0 = None, time.time()
    try:
        while time.time() - t0 < start + 120:
            for line in iter(p.stdout.readline, ""):
                if line.startswith("fault"):
                    fault = float(line.split()[1])
                    logging.debug("FAULT")
            now = time.time()
            state = process_state(HostPaths(), p.pid) or ""
            v = t.observe(now, [RankProbe("g", 1, p.pid, True, state, None)])[("g", 1)]
            if v.stalled:
                why = v.conclusive or "after_seconds"
                print(f"stalled {now - fault:.1f} s after the fault ({why})" if fault else "stalled before the fault")
                break
            time.sleep(max(0.0, 5.0 - (time.time() - now)))
        else:
            print("not stalled")
    finally:
        p.kill()
    """
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--main-repo", action="append", default=[], help="a checkout to run too (its gpuwatchd/)")
    ap.add_argument("--start", type=float, default=30.0, help="seconds of training before the thread starts")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    rank = Path("/tmp/conclusive_gil_rank.py")
    rank.write_text(RANK)
    for repo in [str(here), *args.main_repo]:
        rev = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        env = {**os.environ, "PYTHONPATH": repo}
        cmd = [sys.executable, "-c", OBSERVE, str(rank), str(args.start)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo)
        print(f"== {repo} ({rev.stdout.strip() or '?'}): {out.stdout.strip()}")
        for line in out.stderr.splitlines():
            if "stall pacing" in line or "FAULT" in line:
                print("   ", line.replace("stall pacing: ", "")[:200])
        if out.returncode:
            print(out.stderr[-2000:])


if __name__ == "__main__":
    main()
