"""py-spy's output, parsed: ``record --format raw`` (GIL samples), ``dump --json`` (every thread's
stack), and its failures classified into stable reasons. Pure: bytes in, values out, every input
bounded by ``OUTPUT_CAP_BYTES``.
"""

from __future__ import annotations

import collections
import json
import logging
import re
from dataclasses import dataclass

from gpuwatchd.model import GilReading
from gpuwatchd.model.threads import Frame, ThreadStack

log = logging.getLogger(__name__)

COLLECTOR = "pyspy"
# A raw record of 5 s at 50 Hz is a few KiB; a dump of 200 threads about 1 MiB.
OUTPUT_CAP_BYTES = 4 << 20

# Reasons (PySpyError.reason): short, stable, safe for logs and the collector error string.
ABSENT = "absent"
PERMISSION_DENIED = "permission_denied"
TIMEOUT = "timeout"
TARGET_GONE = "target_gone"
NOT_PYTHON = "not_python"
OUTPUT_TOO_LARGE = "output_too_large"
BUSY = "busy"
FAILED = "failed"

_SAMPLES_RE = re.compile(rb"Samples: (\d+) Errors: (\d+)")
_THREAD_RE = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)(?:: ?(.*))?$")
_LINE_RE = re.compile(r"^(.*) \(([^()]*?)(?::(\d+))?\)$")


class PySpyError(Exception):
    """A py-spy run that gave no usable result. ``reason`` is one of the constants above."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

    @property
    def collector_down(self) -> bool:
        """True when the collector as a whole cannot work (not just this one target)."""
        return self.reason in (ABSENT, PERMISSION_DENIED, TIMEOUT, FAILED)


@dataclass(frozen=True)
class GilSample:
    """One ``record --gil`` run: ``held`` GIL-holding ticks out of ``ticks`` counted ticks."""

    pid: int
    ticks: int  # rate*duration - 1 - errors: the ticks that were really looked at
    held: int  # py-spy's "Samples": with --gil at most one trace per tick
    errors: int
    top_functions: tuple[tuple[str, int], ...]  # leaf function (no line) -> GIL-held ticks
    by_thread: tuple[tuple[int, str, int], ...]  # (host tid or 0 if unknown, thread name, ticks)
    wall_seconds: float
    pyspy_cpu_seconds: float  # user+sys of the py-spy process (rusage)
    timestamp: float

    @property
    def ratio(self) -> float:
        return self.held / self.ticks if self.ticks > 0 else 0.0

    def reading(self) -> GilReading:
        return GilReading(
            pid=self.pid,
            samples=self.ticks,
            held=min(self.held, self.ticks),
            top_functions=self.top_functions,
            timestamp=self.timestamp,
        )


@dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    wall_seconds: float
    cpu_seconds: float
    timed_out: bool


def parse_frame(text: str) -> Frame:
    """``burn (cpu4.py:11)`` -> Frame; anything else is kept whole as the name."""
    m = _LINE_RE.match(text)
    if not m:
        return Frame(text, "", None)
    return Frame(m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None)


def parse_record_summary(output: bytes) -> tuple[int, int]:
    """py-spy's closing line ``Samples: N Errors: E`` -> (N, E); ValueError when absent."""
    matches = _SAMPLES_RE.findall(output)
    if not matches:
        raise ValueError("no 'Samples: N Errors: E' line in py-spy output")
    samples, errors = matches[-1]
    return int(samples), int(errors)


def parse_record_raw(
    text: str, tid_map: dict[int, int] | None = None, top: int = 5
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[int, str, int], ...]]:
    """A ``--format raw --threads`` file -> (top leaf functions, ticks per thread).

    Each line is ``thread (TID): name;root frame;...;leaf frame COUNT``. Malformed lines are
    skipped: the file comes from another program and must never crash the daemon.
    """
    leaf: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[tuple[int, str]] = collections.Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        parts = stack.split(";")
        m = _THREAD_RE.match(parts[0])
        if m:
            raw_tid = int(m.group(1), 0)
            tid = (tid_map or {}).get(raw_tid, raw_tid)
            threads[(tid, m.group(2) or "")] += count
            parts = parts[1:]
        if parts:
            leaf[parse_frame(parts[-1]).where] += count
    return (
        tuple(leaf.most_common(top)),
        tuple((tid, name, n) for (tid, name), n in threads.most_common()),
    )


def parse_dump_json(text: str, tid_map: dict[int, int] | None = None) -> tuple[ThreadStack, ...]:
    """``py-spy dump --json`` -> threads; ValueError for anything that is not the expected shape."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy dump --json: expected a list of threads")
    out = []
    for t in data:
        if not isinstance(t, dict):
            raise ValueError("py-spy dump --json: thread entry is not an object")
        frames = []
        for f in t.get("frames") or ():
            if not isinstance(f, dict):
                continue
            line = f.get("line")
            frames.append(
                Frame(
                    name=str(f.get("name", "?")),
                    filename=str(f.get("short_filename") or f.get("filename") or ""),
                    line=line if isinstance(line, int) else None,
                )
            )
        ns_tid = t.get("os_thread_id")
        ns_tid = ns_tid if isinstance(ns_tid, int) else None
        tid = (tid_map or {}).get(ns_tid, ns_tid) if ns_tid is not None else None
        out.append(
            ThreadStack(
                tid=tid,
                ns_tid=ns_tid,
                name=str(t.get("thread_name") or ""),
                active=bool(t.get("active")),
                owns_gil=bool(t.get("owns_gil")),
                frames=tuple(frames),
            )
        )
    return tuple(out)


def classify_failure(stderr: bytes, target_alive: bool) -> tuple[str, str]:
    """(reason, detail) for a py-spy run that failed; detail is py-spy's own first error line."""
    text = stderr.decode("utf-8", "replace")
    first = next(
        (ln.strip() for ln in text.splitlines() if ln.strip().startswith(("Error", "Permission"))),
        text.strip().splitlines()[0] if text.strip() else "",
    )[:200]
    if not target_alive:
        return TARGET_GONE, first or "target exited"
    lowered = text.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return PERMISSION_DENIED, first
    if "python version" in lowered or "python interpreter" in lowered:
        return NOT_PYTHON, first
    return FAILED, first
