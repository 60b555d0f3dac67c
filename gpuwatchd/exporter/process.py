"""The daemon's own ``process_*`` metrics, named, typed and described as client_python's
``ProcessCollector`` writes them (every Prometheus client library exports these six), so the
footprint the README and the unit (``MemoryMax=``, ``CPUQuota=``) budget is visible per node.

Reads ``/proc/self/stat`` (CPU, start time, virtual and resident memory), ``/proc/self/limits``
(the soft RLIMIT_NOFILE) and lists ``/proc/self/fd``, like ProcessCollector; once per cycle,
with the rest of the exposition. tests/test_exposition_formats.py compares the bytes with
ProcessCollector on the same process. Privilege: none. Shell equivalent:
``cat /proc/$(pidof -s gpuwatchd)/stat``.
"""

from __future__ import annotations

import os

from gpuwatchd.exporter.families import CounterMetricFamily, GaugeMetricFamily, Metric

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _boot_time(proc: str) -> float:
    with open(os.path.join(proc, "stat"), "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError(f"no btime line in {proc}/stat")


def process_families(pid: str = "self", proc: str = "/proc") -> list[Metric]:
    """The families ProcessCollector(pid=lambda: pid) collects; [] when /proc cannot be read."""
    base = os.path.join(proc, pid)
    out: list[Metric] = []
    try:
        btime = _boot_time(proc)
        with open(os.path.join(base, "stat"), "rb") as f:
            parts = f.read().split(b")")[-1].split()
        out += [
            GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", value=float(parts[20])),
            GaugeMetricFamily(
                "process_resident_memory_bytes", "Resident memory size in bytes.", value=float(parts[21]) * _PAGE
            ),
            GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                value=float(parts[19]) / _TICKS + btime,
            ),
            CounterMetricFamily(
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
                value=float(parts[11]) / _TICKS + float(parts[12]) / _TICKS,
            ),
        ]
    except (OSError, IndexError, ValueError):
        pass
    try:
        max_fds = None
        with open(os.path.join(base, "limits"), "rb") as f:
            for line in f:
                if line.startswith(b"Max open file"):
                    max_fds = float(line.split()[3])
                    break
        open_fds = len(os.listdir(os.path.join(base, "fd")))
        out.append(GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=open_fds))
        if max_fds is not None:
            out.append(GaugeMetricFamily("process_max_fds", "Maximum number of open file descriptors.", value=max_fds))
    except (OSError, IndexError, ValueError):
        pass
    return out
