"""Measurement shim for bench/cycle_profile.py: runs ``python -m gpuwatchd`` with every thread named.

Python before 3.14 leaves every thread's comm as the process's, so /proc/PID/task/TID/stat cannot
say which thread is which. This wrapper (bench only; the daemon is unchanged) wraps the public
``threading.Thread.run`` so that each thread (1) sets its comm to its Python name (prctl
PR_SET_NAME, 15 bytes) and (2) on exit adds its ``time.thread_time()`` to a per-name total that is
written, at most once a second, as JSON to ``$GW_THREAD_CPU_FILE``: threads that live a few
milliseconds (one per collector run) are missed by any /proc sampling, this is where they show.
Cost: one prctl per thread start, one dict update per thread exit.

    GW_THREAD_CPU_FILE=/tmp/x.json python bench/thread_names.py run --config.file ...
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import runpy
import sys
import threading
import time

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)
_out = os.environ.get("GW_THREAD_CPU_FILE", "")
_exited: dict[str, list[float]] = {}  # name -> [cpu seconds, threads, voluntary switches]
_lock = threading.Lock()
_last_write = [0.0]
_run = threading.Thread.run


def _family(name: str) -> str:
    return name.rstrip("0123456789_-") or name  # gil-sample_3 -> gil-sample


def run(self: threading.Thread) -> None:
    _libc.prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
    try:
        _run(self)
    finally:
        cpu = time.thread_time()
        wakes = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        with _lock:
            row = _exited.setdefault(_family(self.name), [0.0, 0, 0])
            row[0] += cpu
            row[1] += 1
            row[2] += wakes
            now = time.monotonic()
            if _out and now - _last_write[0] >= 1.0:
                _last_write[0] = now
                tmp = f"{_out}.tmp"
                with open(tmp, "w") as f:
                    json.dump(_exited, f)
                os.replace(tmp, _out)


threading.Thread.run = run  # type: ignore[method-assign]
sys.argv[0] = "gpuwatchd"
runpy.run_module("gpuwatchd", run_name="__main__", alter_sys=True)
