"""What the benches share: /proc readers (CPU seconds, memory), loopback HTTP, percentiles.

One definition each, so that two benches quoting "CPU" or "RSS" measure the same thing: CPU is
utime+stime from ``/proc/PID/stat`` in seconds, memory is kB as ``/proc/PID/status`` prints it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str, tid: int | str | None = None) -> list[str]:
    """The fields of ``/proc/PID/stat`` (or of thread ``tid``'s) after the command name: index 0
    is the state, 11 and 12 utime and stime, 13 and 14 the reaped children's, 19 the start time."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int | str, *, children: bool, tid: int | str | None = None) -> float:
    """utime+stime of ``pid`` (or of its thread ``tid``); with ``children``, plus its reaped
    children's (py-spy runs the daemon waited for)."""
    fields = stat_fields(pid, tid)
    return sum(int(fields[i]) for i in ((11, 12, 13, 14) if children else (11, 12))) / CLK


def task_ticks(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (comm, utime+stime ticks, voluntary context switches: its wake-ups from sleep) of
    each thread of ``pid`` alive now. Under bench/thread_names.py a thread's comm is its Python
    name."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            f = raw.rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            vol = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
            out[int(tid)] = (raw[raw.find("(") + 1 : raw.rfind(")")], int(f[11]) + int(f[12]), vol)
    return out


def self_cpu() -> float:
    """This process's own CPU seconds (all threads, not its children)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_status(pid: int | str, keys: Iterable[str] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    """``keys`` of ``/proc/PID/status`` as integers: the memory lines in kB, ``Threads`` a count.
    A key the kernel does not print is absent."""
    want = set(keys)
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in want:
            out[key] = int(value.split()[0])
    return out


def rss_kib(pid: int | str) -> int:
    """VmRSS of ``pid`` in kB (0 for a process that has no memory left, a zombie)."""
    return proc_status(pid, ("VmRSS",)).get("VmRSS", 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def scrape(url: str) -> tuple[float, int]:
    """(seconds, bytes) of one GET."""
    t0 = time.perf_counter()
    body = get(url)
    return time.perf_counter() - t0, len(body)


def wait_http(url: str, timeout: float = 60, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers; raises once ``timeout`` passes or ``proc`` (the server) exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            get(url)
            return
        except OSError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise
            time.sleep(0.2)


def pct(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: the sample nearest rank ``q * (n - 1)``."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]
