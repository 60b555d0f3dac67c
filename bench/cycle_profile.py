#!/usr/bin/env python3
"""Daemon CPU per cycle and per scrape at torch-shaped ranks, without a GPU (issue 14, goals 1-2).

    .venv/bin/python -m bench.cycle_profile [--ranks 64] [--seconds 120] [--main-repo /work/main]
        [--profile] [--config-extra YAML]

Reproduces the shape of bench/nvml_poll.py's device workload on any Linux box:

* ``--ranks`` real Python processes shaped like torch ranks: ``--threads`` threads each (a CUDA
  torch rank has dozens), ``--children`` forked DataLoader-like workers (one of them forked from a
  non-main thread, so it is listed only in that thread's ``/proc/PID/task/TID/children``),
  ``--fds`` open fds, registered with ``gpuwatchd.register_rank()`` and beating
  ``gpuwatchd.heartbeat(step)`` once a second (what ``ranks-hb`` of nvml_poll.py does);
* NVML: a 1 GPU / N process replay derived from ``tests/fixtures/nvml/h200_bench_9procs.json``
  (recorded on the H200 with 9 holders; its compute-process list is widened to the real PIDs of
  the N ranks, 1 GiB + context each), through config ``nvml.fixture``: the real NvmlSource code;
* a real ``gpuwatchd run`` with the shipped defaults otherwise (GIL sampling with py-spy, kernel
  log, discovery), scraped every ``--interval`` seconds over loopback; with ``--main-repo`` the
  same daemon from another checkout runs beside it in the same window ("before");
* ``--nohb-beside``: beside each checkout's daemon, one more reading a copy of the rank
  directory without the heartbeats: the same ranks, asleep a second at a time between their
  beats, judged by /proc and dumps (the sleeping holders of nvml_poll.py ``--work-ms 0``); with
  ``--pyspy bench/pyspy_counting.sh`` the py-spy runs of each daemon are counted;
* ``--idle`` (with ``--no-heartbeat``): ranks found by discovery instead (torchrun's variables,
  no rank file, no flight-recorder thread) whose every thread blocks: what an idle holder or a
  hang costs, where schedstat proves the last dump's stacks still hold (issue 22).

Prints, per daemon: CPU % of a core (utime+stime from /proc/PID/stat; own, and with its reaped
py-spy children), CPU ms per cycle (window CPU / cycles, scrapes included), CPU ms per scrape
(a burst of back-to-back scrapes after the window), RSS, and the window's CPU and wake-ups per
second by thread name: the daemons run under bench/thread_names.py (comm = Python thread name;
exited threads, e.g. one per collector run, report their thread_time), /proc sampled every second.
``--profile``: a second window with ``py-spy record --format raw`` on the first daemon, folded by
phase (cycle / scrape / GIL sampler / kernel log) and by our own functions.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.benchlib import CLK, REPO, cpu_seconds, free_port, get, rss_kib, task_ticks

FIXTURE = REPO / "tests/fixtures/nvml/h200_bench_9procs.json"
SHIM = REPO / "bench/thread_names.py"  # names every thread (comm) and totals exited threads' CPU

RANK = r"""
import os, sys, threading, time
import gpuwatchd
i, n, rank_dir, threads, children, fds, ready = sys.argv[1:8]
i, n, threads, children, fds = int(i), int(n), int(threads), int(children), int(fds)
held = [os.open('/dev/null', os.O_RDONLY) for _ in range(fds)]
idle = threading.Event()
def worker():  # a DataLoader worker: forked, sleeps, dies with its rank
    while os.getppid() != 1:
        time.sleep(1)
    os._exit(0)
def fork_worker():
    if os.fork() == 0:
        worker()
for k in range(children):
    if k == children - 1 and k > 0:  # forked by another thread: only in that thread's children file
        t = threading.Thread(target=fork_worker); t.start(); t.join()
    else:
        fork_worker()
for _ in range(threads - 2):
    threading.Thread(target=idle.wait, daemon=True).start()
if os.environ.get('GW_BENCH_IDLE') == '1':  # --idle: discovered (torchrun's variables), all asleep
    with open(ready + '.tmp', 'w') as f:
        f.write(str(os.getpid()))
    os.replace(ready + '.tmp', ready)
    idle.wait()
beat = os.environ.get('GW_BENCH_NOHB') != '1'  # --no-heartbeat: judged by /proc and dumps
gpuwatchd.register_rank(job_id='bench', rank=i, world_size=n, local_rank=i, rank_dir=rank_dir,
                        cuda_oom_hook=False, heartbeat=beat)  # + the flight-recorder thread
with open(ready + '.tmp', 'w') as f:
    f.write(str(os.getpid()))
os.replace(ready + '.tmp', ready)
step = 0
work = float(os.environ.get('GW_BENCH_WORK_MS', '0')) / 1e3
while True:
    gpuwatchd.heartbeat(step)
    step += 1
    if not work:
        time.sleep(1)
        continue
    for _ in range(20):  # --work-ms: the main thread works N ms every 50 ms (a training loop's CPU side)
        t = time.perf_counter()
        while time.perf_counter() - t < work:
            pass
        time.sleep(max(0.0, 0.05 - work))
"""


def exited_cpu(path: Path) -> dict[str, list[float]]:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(path.read_text()))
    return {}


def by_name(
    pid: int,
    first: dict[int, tuple[str, int, int]],
    last: dict[int, tuple[str, int, int]],
    exited0: dict[str, list[float]],
    exited1: dict[str, list[float]],
    own: float,
) -> list[tuple[str, float, int, int]]:
    """(thread name, CPU s in the window, threads, wake-ups): threads sampled in /proc every second
    (alive at a sample), plus those that exited (the shim's thread_time and RUSAGE_THREAD totals),
    plus what neither saw."""
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    for tid, (comm, ticks, vol) in last.items():
        name = "main" if tid == pid else comm
        _, t0, v0 = first.get(tid, (comm, 0, 0))
        rows[name][0] += (ticks - t0) / CLK
        rows[name][1] += 1
        rows[name][2] += vol - v0
    for name, row in exited1.items():
        old = exited0.get(name, [0.0, 0, 0])
        if row[1] - old[1]:
            r = rows[f"{name} (exited)"]
            for i in range(3):
                r[i] += row[i] - (old[i] if i < len(old) else 0)
    rows["unaccounted"] = [own - sum(r[0] for r in rows.values()), 0, 0]
    return sorted(((k, r[0], int(r[1]), int(r[2])) for k, r in rows.items()), key=lambda r: -r[1])


def derive_fixture(pids: list[int], out: Path) -> None:
    """The 9-holder H200 recording, its process list widened to ``pids`` (same per-process
    memory, utilisation samples for every second one, device memory summed)."""
    doc = json.loads(FIXTURE.read_text())
    for cycle in doc["cycles"]:
        dev = cycle["devices"][0]
        mem = dev["compute"][0]["usedGpuMemory"]
        ts = dev["process_utilization"][0]["timeStamp"]
        dev["compute"] = [{"pid": p, "usedGpuMemory": mem} for p in pids]
        dev["process_utilization"] = [
            {"memUtil": 0, "pid": p, "smUtil": 1, "timeStamp": ts + k} for k, p in enumerate(pids[::2])
        ]
        dev["memory"]["used"] = min(dev["memory"]["total"], mem * len(pids))
        dev["memory"]["free"] = dev["memory"]["total"] - dev["memory"]["used"]
        cycle.pop("nvidia_smi_compute_apps", None)
        cycle.pop("proc", None)
    doc["note"] = f"derived by bench/cycle_profile.py from {FIXTURE.name}: {len(pids)} processes"
    out.write_text(json.dumps(doc))


def overlay_replay(repo: Path, dest: Path) -> Path:
    """A copy of ``repo``'s package with this checkout's NVML replay (sources/nvml_fixture.py):
    the replay is test equipment, and an old one whose Xid wait returned at once would busy-loop
    the Xid watcher and swamp what is measured."""
    shutil.copytree(repo / "gpuwatchd", dest / "gpuwatchd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "gpuwatchd/sources/nvml_fixture.py", dest / "gpuwatchd/sources/nvml_fixture.py")
    return dest


def start_ranks(args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPUWATCHD_RANK_DIR": str(tmp / "ranks")}

    def rank_env(i: int) -> dict[str, str]:
        if not args.idle:
            return env
        return {
            **env,
            "TORCHELASTIC_RUN_ID": "bench",
            "RANK": str(i),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": str(args.ranks),
        }

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                str(i),
                str(args.ranks),
                str(tmp / "ranks"),
                str(args.threads),
                str(args.children),
                str(args.fds),
                str(tmp / f"r{i}.pid"),
            ],
            env=rank_env(i),
            stdin=subprocess.DEVNULL,
        )
        for i in range(args.ranks)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp / f"r{i}.pid").exists() for i in range(args.ranks)):
        assert time.monotonic() < deadline, "ranks did not start"
        assert all(p.poll() is None for p in procs), "a rank died"
        time.sleep(0.2)
    return procs, [int((tmp / f"r{i}.pid").read_text()) for i in range(args.ranks)]


def pyspy_runs(pids: dict[str, int]) -> str:
    """The py-spy runs of each daemon, from bench/pyspy_counting.sh's log (``PYSPY_LOG``; the
    daemons' gil.pyspy_path is that script through ``--pyspy``), by kind (dump / record)."""
    log = os.environ.get("PYSPY_LOG", "/tmp/pyspy_calls.log")  # the script's default: the
    # daemon runs py-spy in a clean environment
    if not log or not Path(log).exists():
        return ""
    counts: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in pids}
    for line in Path(log).read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[2].startswith("rc="):
            for k, pid in pids.items():
                if parts[1] == str(pid):
                    counts[k][parts[3]] += 1
    return "; py-spy runs: " + ", ".join(f"{k} {dict(c) or 0}" for k, c in counts.items())


def rank_dir_without_heartbeats(tmp: Path) -> Path:
    """A copy of the rank directory with no heartbeat in any entry (``--nohb-beside``): the same
    processes, judged by /proc and dumps, asleep a second at a time between their beats."""
    out = tmp / "ranks-nohb"
    out.mkdir()
    for f in sorted((tmp / "ranks").glob("*.json")):
        doc = json.loads(f.read_text())
        for r in doc["ranks"]:
            r.pop("heartbeat", None)
        (out / f.name).write_text(json.dumps(doc))
    return out


def start_daemon(name: str, repo: str, args: argparse.Namespace, tmp: Path, fixture: Path,
                 logs: contextlib.ExitStack, rank_dir: Path | None = None,
                 ) -> tuple[subprocess.Popen[bytes], str]:  # fmt: skip
    port = free_port()
    cfg = tmp / f"{name}.yaml"
    pyspy = args.pyspy or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cfg.write_text(
        f"rank_dir: {rank_dir or tmp / 'ranks'}\nstate_dir: {tmp / name}\ninterval_seconds: "
        f"{args.interval}\nweb:\n  listen_address: '127.0.0.1:{port}'\nnvml:\n  fixture: "
        f"{fixture}\ngil:\n  pyspy_path: {pyspy}\n{args.config_extra}\n"
    )
    env = {**os.environ, "PYTHONPATH": repo, "GW_THREAD_CPU_FILE": str(tmp / f"{name}.threads.json")}
    p = subprocess.Popen(
        [sys.executable, str(SHIM), "run", "--config.file", str(cfg)],
        env=env,
        cwd=repo,
        stdout=subprocess.DEVNULL,
        stderr=logs.enter_context((tmp / f"{name}.log").open("wb")),
    )
    return p, f"http://127.0.0.1:{port}/metrics"


def ranks_up(body: bytes) -> int:
    return sum(
        1 for line in body.decode().splitlines() if line.startswith("gpuwatch_rank_up{") and line.endswith(" 1.0")
    )


def cycles_seen(body: bytes) -> float:
    for line in body.decode().splitlines():
        if line.startswith("gpuwatch_last_cycle_timestamp_seconds "):
            return float(line.split()[1])
    return 0.0


def window(
    args: argparse.Namespace, daemons: dict[str, tuple[subprocess.Popen[bytes], str]], seconds: float
) -> dict[str, dict[str, Any]]:
    pids = {k: p.pid for k, (p, _) in daemons.items()}
    t0s = {k: task_ticks(pid) for k, pid in pids.items()}
    files = {k: Path(os.environ.get("GW_BENCH_TMP", "")) / f"{k}.threads.json" for k in pids}
    ex0 = {k: exited_cpu(files[k]) for k in pids}
    seen: dict[str, dict[int, tuple[str, int]]] = {k: dict(v) for k, v in t0s.items()}
    own0 = {k: cpu_seconds(pid, children=False) for k, pid in pids.items()}
    all0 = {k: cpu_seconds(pid, children=True) for k, pid in pids.items()}
    ts0 = {k: cycles_seen(get(u, 20)) for k, (_, u) in daemons.items()}
    t0 = time.monotonic()
    scrapes = 0
    while time.monotonic() - t0 < seconds:
        for _, u in daemons.values():
            get(u, 20)
        scrapes += 1
        while (left := t0 + scrapes * args.interval - time.monotonic()) > 0:
            time.sleep(min(1.0, left))  # sample every thread each second: short ones show too
            for k, pid in pids.items():
                seen[k].update(task_ticks(pid))
    wall = time.monotonic() - t0
    res: dict[str, dict[str, Any]] = {}
    for k, pid in pids.items():
        own, tot = cpu_seconds(pid, children=False) - own0[k], cpu_seconds(pid, children=True) - all0[k]
        body = get(daemons[k][1], 20)
        cycles = max(1.0, round((cycles_seen(body) - ts0[k]) / args.interval))
        t1 = task_ticks(pid)
        seen[k].update(t1)
        table = by_name(pid, t0s[k], seen[k], ex0[k], exited_cpu(files[k]), own)
        threads = sorted(((t1[t][1] - t0s[k].get(t, ("", 0))[1]) / CLK, t, t1[t][0]) for t in t1)
        res[k] = {
            "wall_s": wall,
            "cpu_percent_own": 100 * own / wall,
            "cpu_percent_with_children": 100 * tot / wall,
            "cycles": cycles,
            "scrapes": scrapes,
            "cpu_ms_per_cycle": 1e3 * own / cycles,
            "rss_mib": rss_kib(pid) / 1024,
            "ranks_up": ranks_up(body),
            "exposition_bytes": len(body),
            "threads_cpu_s": [(round(c, 2), "main" if t == pid else n) for c, t, n in threads[::-1][:5]],
            "by_name": table,
        }
    for k, (p, u) in daemons.items():  # scrape cost: a burst, after the window
        c0 = cpu_seconds(p.pid, children=False)
        for _ in range(args.burst):
            get(u, 20)
        res[k]["cpu_ms_per_scrape_burst"] = 1e3 * (cpu_seconds(p.pid, children=False) - c0) / args.burst
    return res


PHASES = (
    ("scrape", ("Listener", "workers.py", "handler.py", "encode_text")),
    ("gil sampler", ("gil.py",)),
    ("kernel log", ("kernel_log", "kmsg.py", "kernel_events")),
    ("cycle", ("Daemon.cycle", "isolation.py")),
)
IDLE = (
    "wait (threading.py",
    "select (selectors.py",
    "sleep",
    "_wait_for_tstate_lock",
    "poll (",
    "epoll",
    "get (queue.py",
    "accept (",
    "_worker (concurrent",
    "nvmlEventSetWait",
)  # the replay sleeps there as the driver blocks


def fold(raw: Path, top: int) -> None:
    phase: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[str] = collections.Counter()
    self_c: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        parts = stack.split(";")
        frames = [f for f in parts if "(" in f and not f.startswith("thread (")]
        if not frames or any(w in frames[-1] for w in IDLE):
            continue
        c = int(count)
        total += c
        by_thread[next((f for f in frames if "threading.py" not in f), "?")] += c
        joined = ";".join(frames)
        phase[next((name for name, keys in PHASES if any(k in joined for k in keys)), "other")] += c
        self_c[frames[-1]] += c
        for f in {f for f in frames if "gpuwatchd/" in f or "prometheus_client" in f}:
            incl[f] += c
    print(f"  py-spy on the daemon: {total} active samples", flush=True)
    for name, c in phase.most_common():
        print(f"    phase {name:12s} {100 * c / max(total, 1):5.1f} %")
    print("  by thread (its outermost frame outside threading.py):")
    for f, c in by_thread.most_common(8):
        print(f"    {100 * c / max(total, 1):5.1f} % {f}")
    print("  self (leaf frames):")
    for f, c in self_c.most_common(top):
        print(f"    {100 * c / max(total, 1):5.1f} % {f}")
    print("  inclusive (our frames):")
    for f, c in incl.most_common(top + 10):
        print(f"    {100 * c / max(total, 1):5.1f} % {f}")


def phases(cfg_path: Path, repo: str, cycles: int, interval: float) -> None:
    """The cycle's CPU by part, in-process in a child interpreter running ``repo``'s code: the same
    config (its web server on a free port), ``cycles`` cycles paced at ``interval``; each part timed
    with time.thread_time() in the thread it runs in (collectors run in threads of their own)."""
    code = PHASES_CODE.format(cfg=str(cfg_path), cycles=cycles, interval=interval, instrument=INSTRUMENT)
    env = {**os.environ, "PYTHONPATH": repo}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, check=False)


# Times each part of a daemon's cycle in the thread it runs in (``acc``: part -> CPU seconds);
# ``instrument(core, d)`` wraps the parts of ``d`` (a ``core.Daemon``). Plain text, no format
# fields: PHASES_CODE here and bench/cycle_fast.py's child both run it.
INSTRUMENT = r"""
import collections, time
acc = collections.Counter()
def timed(name, fn):
    def w(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.thread_time() - t0
    return w
def instrument(core, d):
    core.build_state = timed("join (build_state + findings)", core.build_state)
    d.rank_collector.fn = timed("rank files + discovery + guard", d.rank_collector.fn)
    d.proc_collector.fn = timed("procfs (ranks + descendants)", d.proc_collector.fn)
    d._write_state = timed("state.json", d._write_state)
    for sub in d.subsystems:
        # the cycle's hooks of either checkout: before_join (before issue 26), track / observe
        for hook in ("before_join", "track", "observe", "after_join"):
            if hasattr(sub, hook):
                setattr(sub, hook, timed(f"{sub.name}.{hook}", getattr(sub, hook)))
        col = getattr(sub, "collector", None)
        if col is not None:
            col.fn = timed(sub.name + " collector thread", col.fn)
"""

PHASES_CODE = r"""
import collections, dataclasses, time
import gpuwatchd.daemon.core as core
try:
    from gpuwatchd.config.schema import load_config
except ImportError:  # a checkout from before config/ (a7db82e)
    from gpuwatchd.config import load_config
cfg = load_config({cfg!r})
cfg = dataclasses.replace(cfg, web=dataclasses.replace(cfg.web, listen_address="127.0.0.1:0"),
                          state_dir=cfg.state_dir + "-phases")
exec({instrument!r})
d = core.Daemon(cfg)
d.start()
instrument(core, d)
for _ in range(2):
    d.cycle()
acc.clear()
import os
prof = None
if os.environ.get("GW_PHASES_CPROFILE"):  # the measured cycles' main thread under cProfile too
    import cProfile
    prof = cProfile.Profile()
t0 = time.thread_time()
for _ in range({cycles}):
    c0 = time.monotonic()
    if prof:
        prof.enable()
    d.cycle()
    if prof:
        prof.disable()
    time.sleep(max(0.0, {interval} - (time.monotonic() - c0)))
main = time.thread_time() - t0
d.shutdown()
if prof:
    import pstats
    pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ["GW_PHASES_CPROFILE"]))
n = {cycles}
print(f"  in-process cycle parts, CPU ms per cycle over {{n}} cycles (main thread {{1e3 * main / n:.1f}}"
      " ms; collector threads on top):")
for name, v in acc.most_common():
    print(f"    {{1e3 * v / n:6.2f}} ms  {{name}}")
"""


def cprofile(cfg_path: Path, repo: str, cycles: int, top: int) -> None:
    """``cycles`` back-to-back cycles, each followed by one scrape's render, in-process in a child
    interpreter running ``repo``'s code, under cProfile: the functions by own time, and the time
    the cyclic garbage collector took (gc.callbacks)."""
    code = CPROFILE_CODE.format(cfg=str(cfg_path), cycles=cycles, top=top)
    env = {**os.environ, "PYTHONPATH": repo}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, check=False)


CPROFILE_CODE = r"""
import collections, cProfile, dataclasses, gc, io, os, pstats, sys, time
SORT = os.environ.get("GW_CPROFILE_SORT", "tottime")
import gpuwatchd.daemon.core as core
try:
    from gpuwatchd.config.schema import load_config
except ImportError:  # a checkout from before config/ (a7db82e)
    from gpuwatchd.config import load_config
cfg = load_config({cfg!r})
cfg = dataclasses.replace(cfg, web=dataclasses.replace(cfg.web, listen_address="127.0.0.1:0"),
                          state_dir=cfg.state_dir + "-cprofile")
d = core.Daemon(cfg)
d.start()
for _ in range(3):
    d.cycle(); d.registry.encode_text()
gc_t = [0.0, 0, 0.0]
def on_gc(phase, info):
    if phase == "start":
        gc_t[2] = time.perf_counter()
    else:
        gc_t[0] += time.perf_counter() - gc_t[2]; gc_t[1] += 1
gc.callbacks.append(on_gc)
pr = cProfile.Profile()
# Before 3.12 a profiler sees the thread that enabled it only: the collectors' threads get one of
# their own. From 3.12 on (sys.monitoring) one profiler sees every thread, and only one may run.
threaded = cProfile.Profile() if sys.version_info < (3, 12) else None
def in_thread(fn):
    def w():
        threaded.enable()
        try:
            return fn()
        finally:
            threaded.disable()
    return w
for col in [d.rank_collector, d.proc_collector] + [getattr(s, "collector", None) for s in d.subsystems]:
    if col is not None and threaded is not None:
        col.fn = in_thread(col.fn)
t0, w0 = time.thread_time(), time.perf_counter()
render = 0.0
for _ in range({cycles}):
    pr.enable(); d.cycle(); r0 = time.thread_time(); d.registry.encode_text()
    render += time.thread_time() - r0; pr.disable()
n = {cycles}
print(f"  {{n}} cycles + renders back to back: main thread {{1e3 * (time.thread_time() - t0) / n:.1f}} ms"
      f" per cycle under cProfile (render {{1e3 * render / n:.1f}} ms); gc {{gc_t[1] / n:.1f}} collections, "
      f"{{1e3 * gc_t[0] / n:.2f}} ms per cycle")
d.shutdown()
fams = collections.Counter()
for line in d.registry.encode_text().decode().splitlines():
    if not line.startswith("#"):
        fams[line.split("{{")[0].split(" ")[0]] += 1
print(f"  exposition: {{sum(fams.values())}} samples; by family: {{fams.most_common()}}")
out = io.StringIO()
stats = pstats.Stats(pr, stream=out)
if threaded is not None:
    stats.add(threaded)
stats.sort_stats(SORT).print_stats({top})
print(out.getvalue())
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=48)
    ap.add_argument("--children", type=int, default=3)
    ap.add_argument("--fds", type=int, default=300)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--burst", type=int, default=20, help="back-to-back scrapes after the window")
    ap.add_argument("--main-repo", default="", help="checkout whose daemon runs beside as 'before'")
    ap.add_argument("--pyspy", default="")
    ap.add_argument("--config-extra", default="", help="YAML appended to both daemons' config")
    ap.add_argument("--profile", action="store_true", help="then py-spy record the first daemon")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--no-heartbeat",
        action="store_true",
        help="ranks register without a heartbeat (stall detection from /proc and dumps)",
    )
    ap.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="each rank's main thread works N ms every 50 ms instead of sleeping (nvml_poll.py's "
        "--work-ms: heartbeat-less ranks that work are looked at, never dumped)",
    )
    ap.add_argument(
        "--nohb-beside",
        action="store_true",
        help="a daemon of each checkout beside, reading the same ranks without their "
        "heartbeats (asleep a second at a time between beats: the sleeping holders)",
    )
    ap.add_argument(
        "--idle",
        action="store_true",
        help="ranks found by discovery (torchrun's variables, no rank file), every "
        "thread blocked: an idle holder or a hang (no heartbeat, no flight recorder)",
    )
    ap.add_argument(
        "--phases", type=int, default=0, help="then time this many cycles of each checkout in-process, by part"
    )
    ap.add_argument(
        "--cprofile", type=int, default=0, help="then cProfile this many back-to-back cycles + renders in-process"
    )
    args = ap.parse_args()
    if args.no_heartbeat:
        os.environ["GW_BENCH_NOHB"] = "1"
    if args.idle:
        os.environ["GW_BENCH_IDLE"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="gwcpu-bench-"))
    os.environ["GW_BENCH_TMP"] = str(tmp)
    os.environ["GW_BENCH_WORK_MS"] = str(args.work_ms)
    logs = contextlib.ExitStack()
    ranks: list[subprocess.Popen[bytes]] = []
    daemons: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        t0 = time.monotonic()
        ranks, pids = start_ranks(args, tmp)
        nthreads = [len(os.listdir(f"/proc/{p}/task")) for p in pids]
        print(
            f"{args.ranks} ranks up in {time.monotonic() - t0:.0f} s: threads {min(nthreads)}-"
            f"{max(nthreads)} each, {args.children} forked workers each, {args.fds}+ fds; "
            f"interval {args.interval} s, scraped every {args.interval} s, {args.seconds:.0f} s "
            f"window; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        fixture = tmp / "nvml.json"
        derive_fixture(pids, fixture)
        daemons["gpuwatchd"] = start_daemon("gpuwatchd", str(REPO), args, tmp, fixture, logs)
        nohb = rank_dir_without_heartbeats(tmp) if args.nohb_beside else None
        if nohb:
            daemons["gpuwatchd-nohb"] = start_daemon("gpuwatchd-nohb", str(REPO), args, tmp, fixture, logs, nohb)
        if args.main_repo:
            before = overlay_replay(Path(args.main_repo), tmp / "before")
            daemons["gpuwatchd-before"] = start_daemon("gpuwatchd-before", str(before), args, tmp, fixture, logs)
            if nohb:
                daemons["gpuwatchd-before-nohb"] = start_daemon(
                    "gpuwatchd-before-nohb", str(before), args, tmp, fixture, logs, nohb
                )
        deadline = time.monotonic() + 60
        for name, (_, u) in daemons.items():
            up = None
            while True:
                with contextlib.suppress(OSError):
                    up = ranks_up(get(u, 20))
                    if up == args.ranks:
                        break
                log_file = tmp / f"{name}.log"
                assert time.monotonic() < deadline, (
                    f"{name} did not see every rank: {up} up; "
                    f"its log: {log_file.read_text()[-1500:] if log_file.exists() else '?'}"
                )
                time.sleep(0.5)
        time.sleep(args.warmup)
        res = window(args, daemons, args.seconds)
        for k, r in res.items():
            print(
                f"  {k:17s} CPU {r['cpu_percent_own']:.3f} % own, {r['cpu_percent_with_children']:.3f}"
                f" % with py-spy children; {r['cpu_ms_per_cycle']:.1f} ms CPU per cycle (scrape "
                f"included, {r['cycles']:.0f} cycles); {r['cpu_ms_per_scrape_burst']:.2f} ms per "
                f"back-to-back scrape; RSS {r['rss_mib']:.0f} MiB; ranks up {r['ranks_up']}; "
                f"{r['exposition_bytes']} B",
                flush=True,
            )
            print(f"  {'':17s} busiest threads (CPU s, comm): {r['threads_cpu_s']}", flush=True)
            print(f"  {'':17s} CPU by thread name over the window ({r['wall_s']:.0f} s):", flush=True)
            print(
                f"  {'':19s}{'thread':32s} {'CPU s':>7s}   {'% core':>6s}  {'threads':>7s} {'wake-ups/s':>10s}",
                flush=True,
            )
            for name, c, n, w in r["by_name"]:
                print(
                    f"  {'':19s}{name:32s} {c:7.3f} s {100 * c / r['wall_s']:6.3f} %  {n or '':>7} "
                    f"{w / r['wall_s']:10.2f}",
                    flush=True,
                )
        for hb, no in (("gpuwatchd", "gpuwatchd-nohb"), ("gpuwatchd-before", "gpuwatchd-before-nohb")):
            if no in res:
                runs = pyspy_runs({k: daemons[k][0].pid for k in (hb, no)})
                print(
                    f"  {no} / {hb}: own {res[no]['cpu_percent_own'] / res[hb]['cpu_percent_own']:.2f}, "
                    f"with children {res[no]['cpu_percent_with_children'] / res[hb]['cpu_percent_with_children']:.2f}"
                    f"{runs}",
                    flush=True,
                )
        if "gpuwatchd-before" in res:
            a, b = res["gpuwatchd"], res["gpuwatchd-before"]
            print(
                f"  after/before: own {a['cpu_percent_own'] / b['cpu_percent_own']:.2f}, with "
                f"children {a['cpu_percent_with_children'] / b['cpu_percent_with_children']:.2f}",
                flush=True,
            )
        names = (
            [n for n in ("gpuwatchd", "gpuwatchd-nohb", "gpuwatchd-before", "gpuwatchd-before-nohb") if n in daemons]
            if args.phases
            else []
        )
        for name in names:
            print(f"  {name}:", flush=True)
            phases(
                tmp / f"{name}.yaml",
                str(REPO) if not name.startswith("gpuwatchd-before") else str(tmp / "before"),
                args.phases,
                args.interval,
            )
        if args.cprofile:
            cprofile(tmp / "gpuwatchd.yaml", str(REPO), args.cprofile, args.top)
        if args.profile:
            pyspy = args.pyspy or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            raw = tmp / "profile.txt"
            subprocess.run(
                [
                    pyspy,
                    "record",
                    "--nonblocking",
                    "--threads",
                    "-r",
                    "200",
                    "-d",
                    str(int(args.seconds)),
                    "--format",
                    "raw",
                    "-o",
                    str(raw),
                    "-p",
                    str(daemons["gpuwatchd"][0].pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
            if raw.exists():
                fold(raw, args.top)
    finally:
        for p, _ in daemons.values():
            p.send_signal(signal.SIGTERM)
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        for p in [*(d for d, _ in daemons.values()), *ranks]:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        logs.close()
        for log in sorted(tmp.glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {log.name} (tail)\n{text[-1500:]}")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
