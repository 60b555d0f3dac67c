"""``gpuwatchd check``: pre-flight for launch scripts and Slurm prologs.

    gpuwatchd check [--gpus 0,1|GPU-uuid,...] [--json] [--kill] [--grace S]

Lists every process that holds memory on the selected GPUs but belongs to no live rank registered
in ``rank_dir`` (a rank PID or one of its descendants). A rank file counts only under the daemon's
first trust rule (``join/rank_claims.py``: root's files, or a user's file naming that user's own
process). Which uid owns a job (rule 2) is not applied: it decides what the daemon watches, and
for ``check`` it could only make a user's registered rank an offender (docs/security.md).
Exit 0: clean. Exit 1: a table of the offending processes (PID, user, command name, memory, age,
why it is stale). Exit 2: error (no driver, NVML hung, unknown GPU, bad config).

``--kill`` never signals a process whose owner's rank files were not all read (more files, ranks
or bytes than the per-owner caps, ``sources/rankfiles.py``): it may be a registered rank that was not seen. It
sends SIGTERM to each other offender, SIGKILL to those still alive after ``--grace`` seconds,
then re-reads NVML until the memory is really released (the driver frees it only after the process
is fully gone) and exits 0 only then; otherwise 1, naming what still holds memory.

Shell equivalent: ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv``, ``ps -o
pid,ppid,user,etime,comm -p PID``, ``kill PID; sleep 10; kill -9 PID``, ``nvidia-smi`` again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.cli.common import EXIT_FOUND, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, resolve_config
from gpuwatchd.escape import printable
from gpuwatchd.join import rank_claims
from gpuwatchd.join.orphans import RankTrees, offenders, trees_from_entries
from gpuwatchd.model import GpuDevice, GpuProcess, Orphan, ProcessInfo
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.nvml import NvmlNotPresent, NvmlReader, NvmlReadError, select_devices
from gpuwatchd.units import fmt_age

EXIT_CLEAN, EXIT_OFFENDERS = EXIT_OK, EXIT_FOUND


class CheckError(Exception):
    """Anything that makes the answer unknowable: exit 3 when NVML cannot be read (absent, hung,
    failing), 2 when what the user asked for does not exist (``--gpus 9``)."""

    def __init__(self, message: str, code: int = EXIT_UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


def read_with_timeout(source: NvmlReader, timeout: float) -> tuple[tuple[GpuDevice, ...], tuple[GpuProcess, ...]]:
    """One NVML reading in a worker thread: a hung driver call cannot hang the prolog."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = source.read()
        except (NvmlNotPresent, NvmlReadError) as exc:
            box["error"] = exc

    t = threading.Thread(target=target, name="check-nvml", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise CheckError(f"NVML did not answer within {timeout:g} s")
    if "error" in box:
        raise CheckError(str(box["error"]))
    value: tuple[tuple[GpuDevice, ...], tuple[GpuProcess, ...]] = box["value"]
    return value


@dataclass
class Inputs:
    """What one check needs; ``gather`` fills it from the host, tests may build it directly."""

    read_nvml: Callable[[], tuple[tuple[GpuDevice, ...], tuple[GpuProcess, ...]]]
    read_processes: Callable[[Sequence[int]], Mapping[int, ProcessInfo]]
    read_trees: Callable[[], RankTrees]
    paths: HostPaths


def default_inputs(cfg: Any, rank_dir: str | None, timeout: float | None) -> Inputs:
    from gpuwatchd.sources.nvml_fixture import open_nvml_source
    from gpuwatchd.sources.pidns import PidNamespaces
    from gpuwatchd.sources.procfs import ProcfsReader
    from gpuwatchd.sources.rankfiles import RankDirMissing, RankFileReader

    paths = HostPaths(procfs=cfg.procfs)
    procfs = ProcfsReader(paths)
    source = open_nvml_source(cfg.nvml.fixture)
    wait = timeout if timeout is not None else cfg.nvml.timeout_seconds

    def trees() -> RankTrees:
        # Rank files only, no environ discovery: a stale rank from an earlier launch still has
        # RANK/TORCHELASTIC_RUN_ID in its environment, which is exactly what check must not trust.
        reader = RankFileReader(rank_dir or cfg.rank_dir)
        try:
            entries, _bad = reader.scan()
        except RankDirMissing:  # no rank directory: no rank registered on this node
            entries = []
        # ranks registered inside containers name their in-container PID: map to host PIDs,
        # which is what NVML reports
        entries, _refused = PidNamespaces(procfs).resolve(entries)
        procs = procfs.read_many(e.pid for e in entries)
        # Trust rule 1: another user's file cannot make a process "registered". Not rule 2 (one
        # owner per job): here it could only turn a user's own registered rank into an offender,
        # and decided anew from start times it let an older process of another user that claims
        # the job have the job's real rank killed. A user can always register their own process
        # (a file of their own job), so ownership adds nothing to what check may trust.
        entries, _refused, _owners = rank_claims.select(entries, procs, one_owner_per_job=False)
        desc = {e.pid: tuple(procfs.descendants(e.pid)) for e in entries if e.pid in procs}
        for kids in desc.values():
            procs = {**procs, **procfs.read_many(kids)}
        trees = trees_from_entries(entries, procs, desc)
        return dataclasses.replace(trees, unread_owners=reader.unread_owners)

    return Inputs(
        read_nvml=lambda: read_with_timeout(source, wait),
        read_processes=lambda pids: procfs.read_many(pids),
        read_trees=trees,
        paths=paths,
    )


def find_offenders(
    inputs: Inputs,
    selectors: Sequence[str],
    trees_seen: list[RankTrees] | None = None,
) -> tuple[tuple[GpuDevice, ...], tuple[Orphan, ...], Mapping[int, ProcessInfo]]:
    """(selected GPUs, offenders, their processes); ``trees_seen`` gets the rank trees used."""
    devices, procs = inputs.read_nvml()
    try:
        chosen = select_devices(devices, selectors)
    except ValueError as exc:
        raise CheckError(str(exc), EXIT_USAGE) from exc
    uuids = {d.uuid for d in chosen}
    mine = [p for p in procs if p.uuid in uuids]
    trees = inputs.read_trees()
    if trees_seen is not None:
        trees_seen.append(trees)
    processes = inputs.read_processes(sorted({p.pid for p in mine}))
    return chosen, offenders(mine, processes, trees), processes


def _alive(paths: HostPaths, pid: int, start_ticks: int | None) -> bool:
    try:
        with open(paths.proc(pid, "stat"), "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    fields = raw[raw.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or fields[19] == str(start_ticks)


def terminate(
    targets: Mapping[int, int | None],
    paths: HostPaths,
    grace: float,
    kill: Callable[[int, int], None] = os.kill,
) -> dict[int, str]:
    """SIGTERM, wait ``grace``, SIGKILL. ``targets``: pid -> start ticks (PID-reuse guard).
    Returns pid -> outcome ("terminated", "killed", "gone", or the error)."""
    outcome: dict[int, str] = {}
    pending: dict[int, int | None] = {}
    for pid, ticks in targets.items():
        if pid <= 1 or pid == os.getpid():
            outcome[pid] = "refused (init or this process)"
            continue
        if not _alive(paths, pid, ticks):
            outcome[pid] = "gone"
            continue
        try:
            kill(pid, signal.SIGTERM)
            pending[pid] = ticks
        except ProcessLookupError:
            outcome[pid] = "gone"
        except PermissionError as exc:
            outcome[pid] = f"cannot signal: {exc.strerror}"
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        for pid in [p for p, t in pending.items() if not _alive(paths, p, t)]:
            outcome[pid] = "terminated"
            del pending[pid]
        if pending:
            time.sleep(0.1)
    for pid, ticks in pending.items():
        if not _alive(paths, pid, ticks):
            outcome[pid] = "terminated"
            continue
        try:
            kill(pid, signal.SIGKILL)
            outcome[pid] = "killed"
        except ProcessLookupError:
            outcome[pid] = "terminated"
        except PermissionError as exc:
            outcome[pid] = f"cannot signal: {exc.strerror}"
    return outcome


def _gib(n: int | None) -> str:
    return "N/A" if n is None else f"{n / (1 << 30):.2f} GiB"


def table(rows: Sequence[Orphan], processes: Mapping[int, ProcessInfo], now: float) -> str:
    head = f"{'GPU':>3}  {'PID':>8}  {'USER':<10} {'COMM':<16} {'MEMORY':>11}  {'AGE':>9}  REASON"
    lines = [head]
    for o in rows:
        p = processes.get(o.pid)
        age = fmt_age(now - p.start_time) if p else "-"
        # comm is the process's own choice (prctl PR_SET_NAME): escaped, as is what it sits beside
        lines.append(
            f"{o.gpu_index:>3}  {o.pid:>8}  {printable((o.user or '?')[:10]):<10} "
            f"{printable((o.comm or '?')[:16]):<16} {_gib(o.used_memory_bytes):>11}  "
            f"{age:>9}  {printable(o.reason)}"
        )
    return "\n".join(lines)


def _jsonable(rows: Sequence[Orphan], processes: Mapping[int, ProcessInfo], now: float) -> list[dict[str, Any]]:
    out = []
    for o in rows:
        p = processes.get(o.pid)
        out.append(
            {
                "gpu": o.gpu_index,
                "uuid": o.uuid,
                "pid": o.pid,
                "user": o.user,
                "comm": o.comm,
                "used_memory_bytes": o.used_memory_bytes,
                "reason": o.reason,
                "age_seconds": None if p is None else round(now - p.start_time, 1),
            }
        )
    return out


def run_check(
    inputs: Inputs,
    selectors: Sequence[str],
    *,
    kill: bool = False,
    grace: float = 10.0,
    verify_seconds: float = 30.0,
    as_json: bool = False,
    out: Any = None,
    clock: Callable[[], float] = time.time,
    signal_fn: Callable[[int, int], None] = os.kill,
) -> int:
    out = out or sys.stdout
    seen: list[RankTrees] = []
    try:
        devices, rows, processes = find_offenders(inputs, selectors, seen)
    except CheckError as exc:
        _emit(
            out,
            as_json,
            {"status": "error", "error": str(exc)},
            f"gpuwatchd check: error: {printable(str(exc))}",
            error=True,
        )
        return exc.code
    now = clock()
    gpus = [{"index": d.index, "uuid": d.uuid, "name": d.name} for d in devices]
    if not rows:
        _emit(
            out,
            as_json,
            {"status": "clean", "gpus": gpus, "offenders": []},
            f"clean: no process outside a live job holds memory on "
            f"{len(devices)} GPU(s) ({', '.join(str(d.index) for d in devices)})",
        )
        return EXIT_CLEAN
    if not kill:
        _emit(
            out,
            as_json,
            {"status": "offenders", "gpus": gpus, "offenders": _jsonable(rows, processes, now)},
            f"{len({o.pid for o in rows})} process(es) outside any live job hold GPU memory:\n"
            + table(rows, processes, now),
        )
        return EXIT_OFFENDERS
    trees = seen[0]
    refused = {
        o.pid: ("refused: the rank files of its user were not all read (it may be a registered rank)")
        for o in rows
        if not trees.may_signal(processes[o.pid].uid if o.pid in processes else None)
    }
    targets = {
        o.pid: (processes[o.pid].start_ticks if o.pid in processes else None) for o in rows if o.pid not in refused
    }
    outcome = {**terminate(targets, inputs.paths, grace, signal_fn), **refused}
    # Verify: the driver releases the memory only once the process is completely gone.
    killed = set(targets)
    deadline = time.monotonic() + verify_seconds
    still: tuple[Orphan, ...] = rows
    error: CheckError | None = None
    while True:
        try:
            devices, remaining, processes = find_offenders(inputs, selectors)
        except CheckError as exc:
            error = exc
            break
        still = tuple(o for o in remaining if o.pid in killed or o.pid in refused)
        if not (still and {o.pid for o in still} - set(refused)) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    now = clock()
    report = {
        "status": "freed" if not still and not error else "not_freed",
        "gpus": gpus,
        "offenders": _jsonable(rows, processes, now),
        "signals": {str(k): v for k, v in sorted(outcome.items())},
        "still_holding": _jsonable(still, processes, now),
    }
    if error:
        report["error"] = str(error)
        _emit(out, as_json, report, f"gpuwatchd check --kill: cannot verify: {printable(str(error))}", error=True)
        return error.code
    if still:
        text = (
            "memory NOT freed; still held by:\n"
            + table(still, processes, now)
            + "\n"
            + "\n".join(f"  pid {p}: {r}" for p, r in sorted(outcome.items()))
        )
        _emit(out, as_json, report, text)
        return EXIT_OFFENDERS
    freed = sum(o.used_memory_bytes or 0 for o in rows)
    text = (
        f"freed {_gib(freed)} on GPU(s) {', '.join(sorted({str(o.gpu_index) for o in rows}))}"
        f": "
        + ", ".join(f"pid {p} {r}" for p, r in sorted(outcome.items()))
        + "; NVML confirms no offender holds memory any more"
    )
    _emit(out, as_json, report, text)
    return EXIT_CLEAN


def _emit(out: Any, as_json: bool, doc: Mapping[str, Any], text: str, error: bool = False) -> None:
    """JSON on ``out`` always (a script parses one document); an error as text on stderr."""
    if as_json:
        json.dump(doc, out, indent=1, sort_keys=True)
        out.write("\n")
    else:
        (sys.stderr if error and out is sys.stdout else out).write(text + "\n")


def cmd_check(args: argparse.Namespace) -> int:

    cfg = resolve_config(args)
    selectors = [s for s in (args.gpus or "").split(",") if s.strip()]
    inputs = default_inputs(cfg, args.rank_dir, args.timeout)
    return run_check(
        inputs, selectors, kill=args.kill, grace=args.grace, verify_seconds=args.verify_seconds, as_json=args.json
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="pre-flight: exit 1 with a table when a GPU holds memory of a "
        "process outside any live job; --kill frees it and verifies",
    )
    p.add_argument("--config.file", dest="config_file", default=None, help="YAML config")
    p.add_argument("--gpus", help="comma-separated GPU indexes or UUIDs (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--kill", action="store_true", help="SIGTERM the offenders, SIGKILL after --grace, verify the memory is free"
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument(
        "--verify-seconds", type=float, default=30.0, help="how long to wait for NVML to show the memory released"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="NVML time-out in seconds (default: nvml.timeout_seconds)"
    )
    p.add_argument("--rank-dir", default=None, help="override rank_dir")
    p.set_defaults(func=cmd_check)
