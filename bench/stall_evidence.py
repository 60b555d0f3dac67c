"""Which evidence, read from outside a process, tells a hung rank from a healthy one that burns
CPU at one line (issue 22)? Measured on real processes, one shape at a time.

Shapes (``--shapes``; the GPU ones need torch and a GPU):

- ``hash_loop``  healthy: ``hashlib.sha256`` of a 64 MiB buffer in a loop (releases the GIL);
- ``c_spin``     hung: one C call that never returns (ctypes calls a ``jmp .`` in an executable
  page; ctypes releases the GIL);
- ``regex``      hung: a catastrophic regex backtrack (holds the GIL, never returns in practice);
- ``py_spin``    hung: ``while not flag: pass`` (pure Python, holds the GIL);
- ``block``      hung: a lock acquired twice (0 % CPU);
- ``item_loop``  healthy, GPU: a matmul loop synced with ``.item()`` every step;
- ``sync_loop``  healthy, GPU: the same synced with ``torch.cuda.synchronize()``;
- ``gpu_spin``   hung, GPU: one kernel that never ends (``torch.cuda._sleep``) while the rank
  waits in ``torch.cuda.synchronize()``;
- ``gpu_spin_item`` hung, GPU: the same behind ``.item()``.

For each shape, over ``--window`` seconds: the busiest thread's CPU share, its voluntary and
non-voluntary context switches, minor faults, run slices (schedstat), read/write syscalls
(/proc/TID/io), wchan; a burst of ``--burst`` ``py-spy dump``s (how many distinct (line, GIL)
pairs the main thread shows); with NVML, per reading (every 0.2 s) the GPU's utilisation, the
memory controller's, power, SM clock and the process's own SM/memory utilisation.

Run: ``python -m bench.stall_evidence [--shapes ...] [--window 6] [--pyspy PATH]``.
Cost: one process per shape at a time; prints one table. Privilege: ptrace of own children.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any

PROGRAMS = {
    "hash_loop": """
        import hashlib
        buf = bytes(64 << 20)
        print("ready", flush=True)
        while True:
            hashlib.sha256(buf).digest()
    """,
    "c_spin": """
        import ctypes, mmap
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(b"\\xeb\\xfe")  # jmp .
        addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
        spin = ctypes.CFUNCTYPE(None)(addr)
        print("ready", flush=True)
        spin()
    """,
    "regex": """
        import re
        print("ready", flush=True)
        re.match(r"(a+)+$", "a" * 64 + "b")
    """,
    "py_spin": """
        flag = False
        print("ready", flush=True)
        while not flag:
            pass
    """,
    "block": """
        import threading
        lock = threading.Lock()
        lock.acquire()
        print("ready", flush=True)
        lock.acquire()
    """,
    "item_loop": """
        import torch
        a = torch.randn(8192, 8192, device="cuda")
        print("ready", flush=True)
        while True:
            (a @ a).sum().item()
    """,
    "sync_loop": """
        import torch
        a = torch.randn(8192, 8192, device="cuda")
        print("ready", flush=True)
        while True:
            b = a @ a
            torch.cuda.synchronize()
    """,
    "gpu_spin": """
        import torch
        torch.cuda.init(); torch.zeros(1, device="cuda")
        torch.cuda._sleep(1 << 62)
        print("ready", flush=True)
        torch.cuda.synchronize()
    """,
    "gpu_spin_item": """
        import torch
        x = torch.zeros(1, device="cuda")
        torch.cuda._sleep(1 << 62)
        print("ready", flush=True)
        (x + 1).item()
    """,
}


def _rd(path: str) -> str:
    with open(path) as f:
        return f.read()


def _task_counters(pid: int) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    base = f"/proc/{pid}/task"
    for t in os.listdir(base):
        d: dict[str, Any] = {}
        try:
            raw = _rd(f"{base}/{t}/stat")
            f = raw[raw.rfind(")") + 2 :].split()
            d["state"], d["minflt"], d["majflt"] = f[0], int(f[7]), int(f[9])
            d["ticks"] = int(f[11]) + int(f[12])
            for line in _rd(f"{base}/{t}/status").splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    d["vcsw"] = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    d["nvcsw"] = int(line.split()[1])
            d["run_ns"], _, d["slices"] = (int(x) for x in _rd(f"{base}/{t}/schedstat").split())
            io = dict(line.split(": ") for line in _rd(f"{base}/{t}/io").splitlines())
            d["syscr"], d["syscw"] = int(io["syscr"]), int(io["syscw"])
            d["wchan"] = _rd(f"{base}/{t}/wchan").strip()
        except (OSError, ValueError, KeyError):
            continue
        out[int(t)] = d
    return out


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _gpu_reading(nv: Any, pid: int, since_us: int) -> dict[str, Any]:
    h = nv.nvmlDeviceGetHandleByIndex(0)
    u = nv.nvmlDeviceGetUtilizationRates(h)
    r: dict[str, Any] = {"util": u.gpu, "mem_util": u.memory}
    try:
        r["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000
    except nv.NVMLError:
        r["power_w"] = None
    try:
        r["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
    except nv.NVMLError:
        r["sm_mhz"] = None
    try:
        samples = [s for s in nv.nvmlDeviceGetProcessUtilization(h, since_us) if s.pid == pid]
        r["proc_sm"] = max((s.smUtil for s in samples), default=None)
        r["proc_mem"] = max((s.memUtil for s in samples), default=None)
    except nv.NVMLError:
        r["proc_sm"] = r["proc_mem"] = None
    return r


def _burst(pyspy: str | None, pid: int, n: int) -> tuple[int, int, float]:
    """(distinct (line, gil) pairs of the main thread, dumps that worked, seconds spent)."""
    if not pyspy:
        return 0, 0, 0.0
    seen, ok = set(), 0
    t0 = time.monotonic()
    for _ in range(n):
        r = subprocess.run(
            [pyspy, "dump", "--json", "--nonblocking", "-p", str(pid)], capture_output=True, text=True, timeout=10
        )
        if r.returncode != 0:
            continue
        try:
            threads = json.loads(r.stdout)
        except ValueError:
            continue
        ok += 1
        for th in threads:
            if th.get("thread_name") == "MainThread" or len(threads) == 1:
                top = th["frames"][0] if th["frames"] else {}
                seen.add((top.get("line"), th.get("owns_gil")))
        time.sleep(0.05)
    return len(seen), ok, time.monotonic() - t0


def measure(shape: str, window: float, burst: int, pyspy: str | None, nv: Any) -> dict[str, Any]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PROGRAMS[shape])], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        p.stdout.readline()
        time.sleep(1.0)
        a = _task_counters(p.pid)
        t0 = time.monotonic()
        gpu: list[dict[str, Any]] = []
        since = int(time.time() * 1e6)
        while time.monotonic() - t0 < window:
            if nv is not None:
                gpu.append(_gpu_reading(nv, p.pid, since))
                since = int(time.time() * 1e6)
            time.sleep(0.2)
        b = _task_counters(p.pid)
        elapsed = time.monotonic() - t0
        distinct, ok, spent = _burst(pyspy, p.pid, burst)
        tck = os.sysconf("SC_CLK_TCK")
        busiest = max(b, key=lambda t: b[t]["ticks"] - a.get(t, b[t])["ticks"])
        x, y = a.get(busiest, b[busiest]), b[busiest]
        row: dict[str, Any] = {
            "shape": shape,
            "threads": len(b),
            "cpu": (y["ticks"] - x["ticks"]) / tck / elapsed,
            "vcsw/s": (y["vcsw"] - x["vcsw"]) / elapsed,
            "nvcsw/s": (y["nvcsw"] - x["nvcsw"]) / elapsed,
            "minflt/s": (y["minflt"] - x["minflt"]) / elapsed,
            "slices/s": (y["slices"] - x["slices"]) / elapsed,
            "syscalls/s": ((y["syscr"] + y["syscw"]) - (x["syscr"] + x["syscw"])) / elapsed,
            "wchan": y["wchan"] or "-",
            "state": y["state"],
            "all_vcsw/s": sum(b[t].get("vcsw", 0) - a.get(t, b[t]).get("vcsw", 0) for t in b) / elapsed,
            "burst": f"{distinct} of {ok} dumps ({spent:.2f} s)",
        }
        if gpu:

            def rng(k: str) -> str:
                vals = [g[k] for g in gpu if g.get(k) is not None]
                return f"{min(vals):g}-{max(vals):g}" if vals else "n/a"

            row.update({k: rng(k) for k in ("util", "mem_util", "power_w", "sm_mhz", "proc_sm", "proc_mem")})
        return row
    finally:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="hash_loop,c_spin,regex,py_spin,block")
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--burst", type=int, default=10)
    ap.add_argument("--pyspy", default=shutil.which("py-spy"))
    args = ap.parse_args()
    nv = _nvml()
    rows = [measure(s, args.window, args.burst, args.pyspy, nv) for s in args.shapes.split(",")]
    keys = list(rows[0])
    for r in rows:
        keys += [k for k in r if k not in keys]
    print(
        f"# stall_evidence: window {args.window} s, burst {args.burst} dumps, py-spy {args.pyspy}, "
        f"NVML {'yes' if nv else 'no'}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    for r in rows:
        print(
            "  "
            + ", ".join(f"{k} {r[k]:.3g}" if isinstance(r.get(k), float) else f"{k} {r.get(k)}" for k in keys if k in r)
        )


if __name__ == "__main__":
    main()
