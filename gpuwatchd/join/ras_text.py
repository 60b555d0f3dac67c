"""NCCL RAS ``STATUS`` as NCCL 2.24-2.27 print it (text: ``SET FORMAT json`` came with 2.28), read
for what it says about the job's largest communicator: the ranks and processes missing (dead or
unresponsive) and the ranks with an asynchronous error.

The layout is ``rasClientRunInit`` and ``rasClientRunComms`` of NVIDIA/nccl src/ras/client_support.cc
(two dialects: 2.24-2.25 and 2.26-2.27; tests/fixtures/nccl_ras/README.md says which line comes
from where). Read here, line by line, within a section:

- ``NCCL version 2.27.7+cuda12.9 compiled with CUDA 12.9``: the version;
- the summary table's first row (``Group`` 0, the largest communicators): their size;
- ``INCOMPLETE`` (the job's): ``  Process P on node H managing GPU(s) D``, unresponsive processes;
- ``DEAD``: the same lines, processes considered dead;
- ``#0-0 (hash) INCOMPLETE`` (the first of the largest group): ``  Rank R -- GPU G managed by
  process P on node H`` (2.26-2.27) or ``  The missing ranks: 2,3`` (2.24-2.25), unresponsive ranks;
- ``#0-0 (hash) ERROR`` after ``  Asynchronous error(s) on N rank(s)``: ``  Rank R reported E -- GPU
  G managed by process P on node H``, or ``  N ranks reported E`` and then ``  Rank R -- GPU ...``.

NCCL names ranks only when they are few (``rasCountIsOutlier``: one always, a handful otherwise),
and prints operation counts only when they disagree, so a text answer says neither progress nor
who is behind: it names the missing and the failed. Unknown lines are skipped; at most
``MAX_LINES`` lines and ``MAX_NAMED`` ranks of each kind are read. Pure.
"""

from __future__ import annotations

import re

from gpuwatchd.model.nccl_ras import RasRank

MAX_LINES = 20000
MAX_NAMED = 1024
# ncclErrorToString (src/ras/client_support.cc) -> ncclResult_t
ERRORS = {
    "Unhandled CUDA error": 1,
    "System error": 2,
    "Internal error": 3,
    "Invalid argument": 4,
    "Invalid usage": 5,
    "Remote process error": 6,
    "NCCL operation in progress": 7,
    "Unexpected error": 99,
}
_VERSION = re.compile(r"NCCL version ([0-9][0-9A-Za-z.+_-]{0,40}) ")
_ROW = re.compile(r"\s*0\s+\d+\s+\d+\s+[\d-]+\s+(\d+)\s+\d+\s+\S+\s+\S+")
_COMM = re.compile(r"#(\d+)-(\d+) \([0-9a-f]{16}\) (INCOMPLETE|ERROR|MISMATCH)")
_PROCESS = re.compile(r"  Process (\d+) on node (\S+) managing GPUs? (.+)")
_RANK = re.compile(
    r"  Rank (\d+)(?: reported (.+?))? -- GPU (\S+)(?: \(NVML \d+\))? managed by process (\d+) "
    r"on node (\S+)"
)
_RANK_UNKNOWN = re.compile(r"  Rank (\d+)(?: reported (.+?))? -- \[process information not found\]")
_MISSING_LIST = re.compile(r"  The missing ranks?: ([\d,]{1,20000})")
_REPORTED = re.compile(r"  \d+ ranks reported (.+)")
_ASYNC = re.compile(r"  Asynchronous errors? on \d+ ranks?")
_INIT = re.compile(r"  Initialization errors? on \d+ ranks?")


def _int(text: str) -> int:
    return int(text) if len(text) < 19 else -1


def parse_text(text: str) -> tuple[str, int, tuple[RasRank, ...], tuple[RasRank, ...]]:
    """(NCCL version, size of the largest communicator, ranks with an asynchronous error, missing
    ranks) from a text ``STATUS``; ValueError when it is not one (no ``NCCL version`` line)."""
    lines = text.splitlines()[:MAX_LINES]
    m = _VERSION.match(lines[0]) if lines else None
    if m is None:
        raise ValueError("not an NCCL RAS status (no NCCL version line)")
    version, size = m[1], 0
    missing: dict[tuple[int, str, int], RasRank] = {}
    errors: dict[int, RasRank] = {}
    section, error, table = "", "", False
    for line in lines[1:]:
        if not line.strip():
            continue
        if line.startswith("Group ") and "Comms" in line:
            table = True
            continue
        if table:
            row = _ROW.match(line)
            if row and not size:
                size = _int(row[1])
            table = line.startswith(" ")  # the header's second line and the rows are indented
            if table or row:
                continue
        if not line.startswith(" "):  # a heading: where the lines below belong
            comm = _COMM.fullmatch(line)
            section = (
                f"comm_{comm[3]}" if comm and comm[1] == "0" and comm[2] == "0" else "other" if comm else line.strip()
            )
            error = ""
            continue
        if section in ("INCOMPLETE", "DEAD") and len(missing) < MAX_NAMED:
            p = _PROCESS.fullmatch(line)
            if p:
                why = "dead" if section == "DEAD" else "unresponsive"
                key = (-1, p[2][:64], _int(p[1]))
                missing.setdefault(key, RasRank(-1, p[2][:64], _int(p[1]), missing=why))
        elif section == "comm_INCOMPLETE" and len(missing) < MAX_NAMED:
            r = _RANK.fullmatch(line) or _RANK_UNKNOWN.fullmatch(line)
            listed = _MISSING_LIST.fullmatch(line)
            if r is not None and r.re is _RANK:
                _add_missing(missing, RasRank(_int(r[1]), r[5][:64], _int(r[4]), _int(r[3]), missing="unresponsive"))
            elif r is not None:
                _add_missing(missing, RasRank(_int(r[1]), "", -1, missing="unresponsive"))
            elif listed:
                for n in listed[1].split(",")[:MAX_NAMED]:
                    if n:
                        _add_missing(missing, RasRank(_int(n), "", -1, missing="unresponsive"))
        elif section == "comm_ERROR":
            if _ASYNC.fullmatch(line):
                error = "async"
            elif _INIT.fullmatch(line):
                error = "init"
            elif error:
                reported = _REPORTED.fullmatch(line)
                if reported:
                    error = "async:" + reported[1] if error.startswith("async") else "init"
                    continue
                r = _RANK.fullmatch(line) or _RANK_UNKNOWN.fullmatch(line)
                if r is None or not error.startswith("async") or len(errors) >= MAX_NAMED:
                    continue
                what = r[2] or error.partition(":")[2]
                code = ERRORS.get(what, 99)
                host, pid, dev = (r[5][:64], _int(r[4]), _int(r[3])) if r.re is _RANK else ("", -1, -1)
                errors.setdefault(_int(r[1]), RasRank(_int(r[1]), host, pid, dev, async_error=code))
    return version, size, tuple(errors.values()), tuple(missing.values())


def _add_missing(missing: dict[tuple[int, str, int], RasRank], r: RasRank) -> None:
    """A rank of the communicator replaces the process line of the same process (it says more)."""
    for key in [k for k in missing if k[0] == -1 and r.pid != -1 and (k[1], k[2]) == (r.host, r.pid)]:
        r = RasRank(r.rank, r.host, r.pid, r.cuda_dev, missing=missing.pop(key).missing)
    missing.setdefault((r.rank, r.host, r.pid), r)
