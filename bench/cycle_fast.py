#!/usr/bin/env python3
"""The daemon's steady-state CPU per cycle at torch-shaped ranks, without waiting for the clock.

    .venv/bin/python -m bench.cycle_fast [--ranks 64] [--warmup 70] [--cycles 150] [--rounds 3]
        [--main-repo /path/to/other/checkout] [--beside NAME=PATH ...] [--parts]

``bench/cycle_profile.py`` paces its cycles at the real interval, so a window that fills the
memory and straggler histories (300 s) takes minutes per checkout. Here every cycle runs back to
back in-process while ``time.time`` / ``time.monotonic`` advance ``--interval`` seconds per
cycle, so each cadence of the daemon (TTLs, discovery, look and dump intervals, history windows)
sees what a live daemon sees at that interval; the ranks' heartbeats are written by this script
(their step and an mtime on the advanced clock) into files that the ranks' rank files name, so
the heartbeat path is the one measured. The ranks are ``cycle_profile.py``'s (real processes of
``--threads`` threads), NVML its replay widened to their PIDs; the shipped defaults otherwise.

Per checkout and round it prints the CPU of one cycle plus one render of the scrape: the main
thread's and the whole process's (collector threads included), after ``--warmup`` cycles; with
``--main-repo`` the two checkouts alternate, round by round, and the minimum and median of each
are printed side by side (the 2-core VM moves by 10-20 % between runs). ``--parts``: the CPU of
each part of the cycle (``cycle_profile.INSTRUMENT``, as ``cycle_profile.py --phases``). It measures the cycle only: no
scrapes over HTTP, no py-spy runs (the GIL sampler's thread is left idle), no waiting threads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import cycle_profile
from bench.benchlib import REPO

CHILD = r"""
import collections, dataclasses, gc, glob, os, resource, sys, time
cfg_path, hb_dir, warmup, cycles, interval, parts, prof = sys.argv[1:8]
warmup, cycles, interval, parts, prof = int(warmup), int(cycles), float(interval), parts == "1", int(prof)
_time, _mono = time.time, time.monotonic
offset = [0.0]
time.time = lambda: _time() + offset[0]
time.monotonic = lambda: _mono() + offset[0]
import gpuwatchd.daemon.core as core
try:
    from gpuwatchd.config.schema import load_config
except ImportError:  # a checkout from before config/ (a7db82e)
    from gpuwatchd.config import load_config
cfg = load_config(cfg_path)
cfg = dataclasses.replace(cfg, web=dataclasses.replace(cfg.web, listen_address="127.0.0.1:0"))
exec(INSTRUMENT)  # cycle_profile.INSTRUMENT: acc, timed, instrument
d = core.Daemon(cfg)
d.start()
if parts:
    instrument(core, d)
render = timed("render (one scrape)", d.registry.encode_text)
beats = sorted(glob.glob(os.path.join(hb_dir, "*.hb"))) if hb_dir else []
profiler = None
gc.freeze()
gc.set_threshold(getattr(core, "GC_YOUNG_THRESHOLD", 700), *gc.get_threshold()[1:])  # as run() does
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def thread_ticks():
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), f"tid {tid}")
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])
    return out
beat_cpu = 0.0
for i in range(warmup + cycles):
    if i == warmup:
        acc.clear()
        beat_cpu, t0, p0, ticks0 = 0.0, time.thread_time(), cpu(), thread_ticks()
        if prof:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
    b0, now = time.thread_time(), time.time()
    for h in beats:  # each rank's heartbeat(step), on the advanced clock
        with open(h, "w") as f:
            f.write(f"{i}\n")
        os.utime(h, (now - 0.5, now - 0.5))
    beat_cpu += time.thread_time() - b0
    d.cycle()
    render()
    offset[0] += interval
if profiler is not None:
    profiler.disable()
main = (time.thread_time() - t0 - beat_cpu) / cycles
proc = (cpu() - p0 - beat_cpu) / cycles
findings = collections.Counter(f.kind for f in d.state.findings)
d.shutdown()
ticks1 = thread_ticks()
print(f"RESULT {1e3 * main:.3f} {1e3 * proc:.3f} {dict(findings)}")
hz = os.sysconf("SC_CLK_TCK")
for name in sorted(ticks1, key=lambda n: ticks0.get(n, 0) - ticks1[n]):
    used = (ticks1[name] - ticks0.get(name, 0)) / hz / cycles
    if used > 0:
        note = " (the script's heartbeat writes included)" if name == "MainThread" else ""
        print(f"    {1e3 * used:6.2f} ms  thread {name}{note}")
for name, v in acc.most_common():
    print(f"    {1e3 * v / cycles:6.2f} ms  {name}")
if profiler is not None:
    import io, pstats
    out = io.StringIO()
    st = pstats.Stats(profiler, stream=out)
    st.sort_stats("tottime").print_stats(prof)
    st.sort_stats("cumulative").print_stats(prof)
    print("\n".join("    " + ln for ln in out.getvalue().splitlines()))
"""


def heartbeat_ranks(tmp: Path, heartbeats: bool = True) -> tuple[Path, Path | None]:
    """A second rank directory naming the same processes, whose heartbeats only this script
    writes (the ranks' own beat on the real clock, which the advanced clock would read as stale);
    ``heartbeats=False``: the same rank files without a heartbeat (the stall rule's dumps)."""
    import json

    ranks, beats = tmp / "ranks-fast", tmp / "beats-fast"
    ranks.mkdir()
    beats.mkdir()
    for f in sorted((tmp / "ranks").glob("*.json")):
        doc = json.loads(f.read_text())
        for r in doc["ranks"]:
            if not heartbeats:
                r.pop("heartbeat", None)
                continue
            r["heartbeat"] = str(beats / Path(r.get("heartbeat") or f"{f.stem}.hb").name)
            Path(r["heartbeat"]).write_text("0\n")
        (ranks / f.name).write_text(json.dumps(doc))
    return ranks, beats if heartbeats else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=24)
    ap.add_argument("--children", type=int, default=0)
    ap.add_argument("--fds", type=int, default=300)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument(
        "--warmup",
        type=int,
        default=70,
        help="cycles before the measured ones (70 x 5 s: the 300 s history windows full)",
    )
    ap.add_argument("--cycles", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--main-repo", default="", help="another checkout, measured in turn ('before')")
    ap.add_argument(
        "--beside",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one more checkout measured in turn, under NAME (repeatable): e.g. the "
        "tip before a fix beside the fix and the old 'before'",
    )
    ap.add_argument("--parts", action="store_true", help="the CPU of each part of the cycle")
    ap.add_argument(
        "--no-heartbeat",
        action="store_true",
        help="rank files without heartbeats: the stall rule's looks and py-spy dumps "
        "(every rank stalled after stall.after_seconds: the ranks sleep)",
    )
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="print this many of cProfile's top functions (tottime) of the measured cycles",
    )
    args = ap.parse_args()
    args.idle = False
    tmp = Path(tempfile.mkdtemp(prefix="gw-cycle-fast-"))
    procs, pids = cycle_profile.start_ranks(args, tmp)
    try:
        fixture = tmp / "nvml.json"
        cycle_profile.derive_fixture(pids, fixture)
        ranks, beats = heartbeat_ranks(tmp, not args.no_heartbeat)
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        checkouts = {"gpuwatchd": str(REPO)}
        if args.main_repo:
            checkouts["before"] = args.main_repo
        for item in args.beside:
            name, _, path = item.partition("=")
            checkouts[name] = path
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in checkouts}
        print(
            f"{args.ranks} ranks of {args.threads} threads, "
            f"{'no heartbeats' if args.no_heartbeat else 'heartbeats'}, {args.interval} s interval "
            f"advanced per cycle; {args.warmup} + {args.cycles} cycles a round; "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        for rnd in range(args.rounds):
            for name, repo in checkouts.items():
                cfg = tmp / f"{name}-{rnd}.yaml"
                cfg.write_text(
                    f"rank_dir: {ranks}\nstate_dir: {tmp / name}-{rnd}\ninterval_seconds: "
                    f"{args.interval}\nnvml:\n  fixture: {fixture}\ngil:\n  pyspy_path: {pyspy}\n"
                )
                child = f"INSTRUMENT = {cycle_profile.INSTRUMENT!r}\n{CHILD}"
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        child,
                        str(cfg),
                        str(beats or ""),
                        str(args.warmup),
                        str(args.cycles),
                        str(args.interval),
                        "1" if args.parts else "0",
                        str(args.cprofile),
                    ],
                    env={**os.environ, "PYTHONPATH": repo},
                    cwd=repo,
                    capture_output=True,
                    text=True,
                    timeout=1800,
                )
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"  {name}: no result\n{out.stdout[-2000:]}{out.stderr[-2000:]}", flush=True)
                    return 1
                _, main_ms, proc_ms, findings = line.split(" ", 3)
                results[name].append((float(main_ms), float(proc_ms)))
                print(
                    f"  round {rnd + 1} {name:10s} main thread {float(main_ms):6.2f} ms, process "
                    f"{float(proc_ms):6.2f} ms per cycle (one render included); findings {findings}",
                    flush=True,
                )
                print(
                    "\n".join(ln for ln in out.stdout.splitlines() if ln.startswith("    ")), flush=True
                )  # each thread's CPU; the parts and the profile when asked
        for name, rows in results.items():
            procs_ms = [p for _, p in rows]
            mains = [m for m, _ in rows]
            print(
                f"  {name:10s} process ms per cycle: min {min(procs_ms):.2f}, median "
                f"{statistics.median(procs_ms):.2f}; main thread: min {min(mains):.2f}, median "
                f"{statistics.median(mains):.2f}",
                flush=True,
            )
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
