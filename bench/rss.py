#!/usr/bin/env python3
"""Resident memory of the daemon (issue 14): RSS at start and after N cycles with M real ranks,
anonymous vs file-backed, side by side with another checkout ("before") and nvitop-exporter.

    python3 -m bench.rss [--ranks 32] [--threads 24] [--cycles 30] [--interval 1]
        [--main-repo /work/main] [--nvitop-python PATH] [--nvml-fixture FILE | --nvml-fixture '']

1. Starts ``--ranks`` Python processes with ``--threads`` sleeping threads each (a torch rank
   has dozens), registered with ``gpuwatchd register`` as the ranks of job ``bench`` in a rank
   directory without heartbeats (so stall detection looks at their threads, as on the device in
   bench/nvml_poll.py).
2. Starts, side by side and at once, ``gpuwatchd run`` of this checkout (and of ``--main-repo``)
   in two configurations: ``no-gil`` (every feature but GIL sampling, kernel log off: the
   configuration bench/nvml_poll.py compares with nvitop-exporter) and ``defaults`` (shipped
   defaults: GIL sampling, kernel log, discovery). NVML is the recorded replay
   ``--nvml-fixture`` (no GPU needed; ``''`` for the real driver on a GPU node). Each is scraped
   over loopback every interval.
3. Prints VmRSS, RssAnon, RssFile (/proc/PID/status), the peak (VmHWM) and the thread count when
   /metrics first answers ("start") and after ``--cycles`` intervals ("after"), then the shared
   libraries mapped, and the footprint of importing what ``gpuwatchd run`` imports (and, given
   ``--nvitop-python``, of running nvitop-exporter, or of importing it where it cannot start
   without NVML). VmRSS is what bench/nvml_poll.py reports on the device.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.benchlib import REPO, proc_status, wait_http

FIXTURE = REPO / "tests/fixtures/nvml/h200_bench_9procs.json"
RANK = """import os, sys, threading, time
ev = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=ev.wait, daemon=True).start()
print(os.getpid(), flush=True)
while True:
    time.sleep(1)
"""
# What `gpuwatchd run` imports before it starts the daemon (the CLI, then the daemon's core).
RUN_IMPORTS = "import gpuwatchd.cli, gpuwatchd.daemon.core"
LIBS = (
    "libssl",
    "libcrypto",
    "libsystemd",
    "libudev",
    "libnvidia-ml",
    "_yaml",
    "libyaml",
    "_bcrypt",
    "_ssl",
    "_hashlib",
    "_decimal",
    "_ctypes",
    "libffi",
    "libz",
    "liblzma",
    "libbz2",
    "libpython",
)


def status(pid: int) -> dict[str, int]:
    return proc_status(pid, ("VmRSS", "RssAnon", "RssFile", "VmHWM", "Threads"))  # kB, a count


def libraries(pid: int) -> dict[str, int]:
    """Resident kB of each mapped file whose name holds one of LIBS."""
    out: dict[str, int] = {}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            name = parts[5].rsplit("/", 1)[-1] if len(parts) > 5 else ""
        elif line.startswith("Rss:") and any(k in name for k in LIBS):
            out[name] = out.get(name, 0) + int(line.split()[1])
    return out


def mib(kb: int) -> str:
    return f"{kb / 1024:5.1f}"


def row(name: str, when: str, s: dict[str, int]) -> str:
    return (
        f"  {name:26s} {when:6s} VmRSS {mib(s['VmRSS'])} MiB  anon {mib(s['RssAnon'])}  file "
        f"{mib(s['RssFile'])}  peak {mib(s['VmHWM'])}  threads {s['Threads']}"
    )


def footprint(python: str, code: str, env: dict[str, str], cwd: str) -> dict[str, int]:
    """RSS of a fresh interpreter that ran ``code`` and waits."""
    p = subprocess.Popen(
        [python, "-c", f"{code}\nimport sys\nprint(flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    try:
        assert p.stdout is not None
        p.stdout.readline()
        return status(p.pid)
    finally:
        p.kill()
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=24, help="sleeping threads per rank process")
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--main-repo", default="", help="checkout whose daemon runs as 'before'")
    ap.add_argument("--nvml-fixture", default=str(FIXTURE), help="'' for the real NVML")
    ap.add_argument("--nvitop-python", default="", help="an interpreter with nvitop-exporter")
    ap.add_argument("--variants", default="no-gil,defaults")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gwrss-bench-"))
    (tmp / "ranks").mkdir()  # `gpuwatchd register` refuses a rank directory that does not exist
    nvml = f"nvml:\n  fixture: {args.nvml_fixture}\n" if args.nvml_fixture else ""
    configs = {"no-gil": "kernel_log: 'off'\ngil:\n  enabled: false\n" + nvml, "defaults": nvml}
    checkouts = [("", str(REPO))] + ([("before ", args.main_repo)] if args.main_repo else [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def env_for(repo: str) -> dict[str, str]:
        return {**env, "PYTHONPATH": f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"}

    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.ranks} ranks x "
        f"{args.threads} threads, interval {args.interval:g} s, {args.cycles} cycles, NVML "
        f"{'replay of ' + Path(args.nvml_fixture).name if args.nvml_fixture else 'driver'}",
        flush=True,
    )
    ranks: list[subprocess.Popen[bytes]] = []
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    logs = contextlib.ExitStack()
    try:
        for _ in range(args.ranks):
            ranks.append(subprocess.Popen([sys.executable, "-c", RANK, str(args.threads)], stdout=subprocess.PIPE))
        for i, r in enumerate(ranks):
            assert r.stdout is not None
            pid = int(r.stdout.readline())
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpuwatchd",
                    "register",
                    "--job-id",
                    "bench",
                    "--rank",
                    str(i),
                    "--pid",
                    str(pid),
                    "--world-size",
                    str(args.ranks),
                    "--rank-dir",
                    str(tmp / "ranks"),
                ],
                check=True,
                env=env_for(str(REPO)),
                cwd=str(REPO),
                capture_output=True,
            )
        urls: dict[str, str] = {}
        port = 19960
        for label, repo in checkouts:
            for variant in args.variants.split(","):
                name = f"{label}{variant}"
                port += 1
                cfg = tmp / f"{name.replace(' ', '-')}.yaml"
                cfg.write_text(
                    f"rank_dir: {tmp / 'ranks'}\nstate_dir: {tmp / cfg.stem}\n"
                    f"interval_seconds: {args.interval}\nweb:\n  listen_address: "
                    f"'127.0.0.1:{port}'\n{configs[variant]}"
                )
                daemons[name] = subprocess.Popen(
                    [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)],
                    env=env_for(repo),
                    cwd=repo,
                    stdout=subprocess.DEVNULL,
                    stderr=logs.enter_context((tmp / f"{cfg.stem}.log").open("wb")),
                )
                urls[name] = f"http://127.0.0.1:{port}/metrics"
        start = {}
        for name, url in urls.items():
            wait_http(url, 90, daemons[name])
            start[name] = status(daemons[name].pid)
        t0 = time.monotonic()
        peak = {name: 0 for name in daemons}
        while time.monotonic() - t0 < args.cycles * args.interval:
            for name, url in urls.items():
                with urllib.request.urlopen(url, timeout=10) as r:
                    r.read()
                peak[name] = max(peak[name], status(daemons[name].pid)["VmRSS"])
            time.sleep(args.interval)
        after = {name: status(p.pid) for name, p in daemons.items()}
        libs = {name: libraries(p.pid) for name, p in daemons.items()}
        for name in daemons:
            print(row(name, "start", start[name]))
            print(row(name, "after", after[name]) + f"  (max VmRSS seen {mib(peak[name])})")
        print("shared libraries mapped (resident kB):")
        for name, found in libs.items():
            print(f"  {name:26s} " + (", ".join(f"{k} {v}" for k, v in sorted(found.items())) or "-"))
        print(f"import footprint of `gpuwatchd run` ({RUN_IMPORTS}):")
        for label, repo in checkouts:
            s = footprint(sys.executable, RUN_IMPORTS, env_for(repo), repo)
            print(row(f"{label}gpuwatchd".strip(), "import", s))
        print(row("python -c pass", "import", footprint(sys.executable, "pass", env, str(tmp))))
        if args.nvitop_python:
            nv = subprocess.Popen(
                [
                    args.nvitop_python,
                    "-m",
                    "nvitop_exporter",
                    "--bind-address",
                    "127.0.0.1",
                    "--port",
                    str(port + 1),
                    "--interval",
                    str(args.interval),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                wait_http(f"http://127.0.0.1:{port + 1}/metrics", 30, nv)
                time.sleep(args.cycles * args.interval)
                print(row("nvitop-exporter", "after", status(nv.pid)))
            except OSError:
                nv.wait(10)
                why = (nv.stderr.read().decode(errors="replace").strip().splitlines() or ["?"] if nv.stderr else ["?"])[
                    0
                ]
                print(f"  nvitop-exporter exited {nv.returncode} ({why[:70]}); its import alone:")
                s = footprint(args.nvitop_python, "import nvitop_exporter.cli", env, str(tmp))
                print(row("nvitop-exporter", "import", s))
            finally:
                if nv.poll() is None:
                    nv.send_signal(signal.SIGTERM)
                    nv.wait(10)
    finally:
        for p in [*daemons.values(), *ranks]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*daemons.values(), *ranks]:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
