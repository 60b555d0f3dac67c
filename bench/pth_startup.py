"""Start-up cost of the wheel's ``gpuwatchd-heartbeat.pth`` (docs/rankfile.md: "nothing until
torch.optim is imported"): ``python -c pass`` in a venv laid out as the wheel installs gpuwatchd
(the package and the .pth file at the top of site-packages), with GPUWATCHD_HEARTBEAT unset and
set to 1, interleaved, N runs each (as hyperfine would: a warm-up, then wall time per run).

    python -m bench.pth_startup [--runs 200] [--repo CHECKOUT] [--out FILE]

Prints the median, p10 and p90 of each (wall time, and the child's user+system CPU time, which a
loaded machine disturbs less), the difference of the medians, and the modules the variable adds
to ``sys.modules``. ``--repo``: measure another checkout's package (the code before a change).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchlib import REPO


def venv_like_the_wheel(tmp: Path, repo: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    (site,) = (tmp / "venv/lib").glob("python3*/site-packages")
    shutil.copytree(repo / "gpuwatchd", site / "gpuwatchd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo / "gpuwatchd/rank/gpuwatchd-heartbeat.pth", site)
    python = tmp / "venv/bin/python"
    subprocess.run([str(python), "-m", "compileall", "-q", str(site / "gpuwatchd")], check=True)
    return python


def once(python: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``python -c pass``."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--repo", type=Path, default=REPO)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        python = venv_like_the_wheel(Path(d), args.repo)
        off = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        on = dict(off, GPUWATCHD_HEARTBEAT="1")
        for env in (off, on):  # warm-up: page cache, .pyc
            for _ in range(5):
                once(python, env)
        t_off: list[tuple[float, float]] = []
        t_on: list[tuple[float, float]] = []
        for _ in range(args.runs):
            t_off.append(once(python, off))
            t_on.append(once(python, on))
        probe = "import sys; print(' '.join(sorted(sys.modules)))"
        mods = [
            set(
                subprocess.run(
                    [str(python), "-c", probe], env=env, capture_output=True, text=True, check=True
                ).stdout.split()
            )
            for env in (off, on)
        ]
    lines = [
        f"python -c pass, {args.runs} runs each, interleaved; {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs; package from {args.repo}"
    ]
    for i, what in ((0, "wall"), (1, "cpu")):
        for name, runs in (("GPUWATCHD_HEARTBEAT unset", t_off), ("GPUWATCHD_HEARTBEAT=1", t_on)):
            ts = [r[i] for r in runs]
            q = statistics.quantiles(ts, n=10)
            lines.append(
                f"{what:4s} {name:26s} median {statistics.median(ts) * 1e3:6.2f} ms  "
                f"p10 {q[0] * 1e3:6.2f}  p90 {q[-1] * 1e3:6.2f}"
            )
        diff = statistics.median([r[i] for r in t_on]) - statistics.median([r[i] for r in t_off])
        lines.append(f"{what:4s} difference of the medians: {diff * 1e3:+.2f} ms")
    lines.append(f"modules added by GPUWATCHD_HEARTBEAT=1: {' '.join(sorted(mods[1] - mods[0]))}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
