"""``gpuwatchd doctor PID [--json]``: everything known about one process, in one screen.

Replaces the seeds' ad-hoc diagnosis (``ps``, ``cat /proc/PID/status``, ``ls /proc/PID/fd | wc``,
``ulimit -n``, ``nvidia-smi``, ``py-spy dump``, ``tr '\\0' '\\n' < /proc/PID/environ | grep NCCL``):
process state, each thread's state / wchan / CPU, fds against the limit, GPU memory (from the
daemon's latest state when it runs), the Python stack of every thread with the GIL owner marked
(``py-spy dump --nonblocking``: never stops the process), NCCL environment checks, fork-after-CUDA
checks, and the active findings for the process (the daemon's, plus the local checks run now).

Privilege: as py-spy and /proc (root or CAP_SYS_PTRACE for other users' processes). Environment
values never leave this command except the decisive ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from gpuwatchd.cli.common import EXIT_USAGE, CliError, load_state, resolve_config
from gpuwatchd.config.schema import Config
from gpuwatchd.daemon.fork_evidence import fork_evidence
from gpuwatchd.daemon.proc_view import ProcView
from gpuwatchd.escape import printable_tree
from gpuwatchd.findings import FindingContext, fd_exhaustion, fork_after_cuda, nccl_env
from gpuwatchd.join.hang import analyze, wait_tids
from gpuwatchd.join.rank_workers import worker_view
from gpuwatchd.model import RankEntry, RankState
from gpuwatchd.model.parts import GpuOutput, Tracked
from gpuwatchd.model.threads import ThreadInfo, ThreadStack
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources import containers, devfds, taskwait
from gpuwatchd.sources.pidns import pid_text
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import PySpyError
from gpuwatchd.sources.threads import process_state, read_threads
from gpuwatchd.units import fmt_bytes

STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible (disk / driver)",
    "Z": "zombie",
    "T": "stopped (SIGSTOP or job control)",
    "t": "stopped by a tracer",
    "I": "idle kernel thread",
    "X": "dead",
}
NCCL_VARS = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_BUFFER_SIZE",
    "NCCL_DEBUG",
    *nccl_env.RENAMED,
)
ASYNC_LEVELS = {
    "0": "0: no error handling: a failed or timed-out collective hangs this rank forever",
    "1": "1: tear down (abort the communicator and the process): a hang becomes an error",
    "2": "2: clean up only",
    "3": "3: skip clean-up (tear down without ncclCommAbort)",
}


def _rank_of(state: Mapping[str, Any], pid: int) -> Mapping[str, Any] | None:
    for r in state.get("ranks", []):
        if r.get("pid") == pid or pid in (r.get("tree") or []):
            return dict(r)
    return None


def nccl_checks(env: Mapping[str, str]) -> list[dict[str, str]]:
    """One line per relevant variable: set or not, and what it means (no other values)."""
    out = []
    level = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if level is None:
        out.append(
            {
                "variable": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "verdict": "not set: PyTorch default (3; torchrun sets 1 in its workers)",
            }
        )
    else:
        out.append(
            {
                "variable": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "verdict": ASYNC_LEVELS.get(level.strip(), "set to an unknown level"),
            }
        )
    for old, new in nccl_env.RENAMED.items():
        if old in env:
            out.append({"variable": old, "verdict": f"legacy name, ignored by PyTorch >= 2.2: use {new}"})
    for name in NCCL_VARS:
        if name in env and name not in nccl_env.RENAMED and name != "TORCH_NCCL_ASYNC_ERROR_HANDLING":
            out.append({"variable": name, "verdict": "set"})
    return out


def collect(
    pid: int,
    cfg: Config,
    *,
    paths: HostPaths | None = None,
    spy: PySpy | None = None,
    state: Mapping[str, Any] | None = None,
    state_origin: str = "",
    nvml: Any = None,
) -> dict[str, Any]:
    """The report as plain JSON-able data; ``state`` is the daemon's latest state (or empty).
    ``nvml``: a pynvml-like module for a direct reading when the state has no GPU data (tests pass
    a recorded replay; default: the real library, or ``nvml.fixture`` when configured)."""
    paths = paths or HostPaths(procfs=cfg.procfs)
    procfs = ProcfsReader(paths)
    # the daemon's process view (daemon/proc_view.py), for this one tree: what the join and the
    # rules see of a rank, the same reader and the same NCCL flags
    view = ProcView(procfs).read((pid,))
    info = view.processes.get(pid)
    if info is None:
        return {"pid": pid, "error": f"no process {pid}"}
    state = state or {}
    clk = os.sysconf("SC_CLK_TCK")
    nspid = procfs.nspid(pid) or (pid,)
    report: dict[str, Any] = {
        "pid": pid,
        "ns_pid": nspid[-1] if len(nspid) > 1 else None,
        "container": containers.identity(procfs.cgroup(pid)),
        "comm": info.comm,
        "user": info.user,
        "ppid": info.ppid,
        "state": info.state,
        "state_meaning": STATES.get(info.state, "?"),
        "started": info.start_time,
        "cpu_seconds": info.cpu_seconds,
        "rss_bytes": info.rss_bytes,
        "fds": {
            "open": info.open_fds,
            "soft_limit": info.max_fds_soft,
            "hard_limit": info.max_fds_hard,
            "ratio": (
                round(info.open_fds / info.max_fds_soft, 3) if info.open_fds is not None and info.max_fds_soft else None
            ),
        },
        "state_origin": state_origin,
    }
    # Python stacks (non-blocking) joined to the kernel's view of each thread
    spy = spy or PySpy.from_config(cfg.gil.pyspy_path, paths=paths)
    stacks: dict[int, ThreadStack] = {}
    python: dict[str, Any] = {}
    before = (
        time.monotonic(),
        read_threads(paths, pid, detail=False),
        {c: taskwait.context_switches(paths, c) for c in procfs.children(pid)},
    )
    dumped: tuple[ThreadStack, ...] = ()
    try:
        dumped = spy.dump(pid)
        stacks = {s.tid: s for s in dumped if s.tid is not None}
        owner = next((s for s in dumped if s.owns_gil), None)
        python = {
            "gil_owner": ({"tid": owner.tid, "name": owner.name} if owner else None),
            "threads": [
                {
                    "tid": s.tid,
                    "name": s.name,
                    "owns_gil": s.owns_gil,
                    "active": s.active,
                    "frames": [str(f) for f in s.frames],
                }
                for s in dumped
            ],
        }
    except PySpyError as e:
        python = {"error": str(e)}
    report["python"] = python
    time.sleep(max(0.0, HANG_WINDOW - (time.monotonic() - before[0])))
    threads = read_threads(paths, pid)
    report["hang"] = hang_report(paths, pid, dumped, before, threads, clk) if dumped else None
    report["threads"] = [
        {
            "tid": t.tid,
            "comm": t.comm,
            "state": t.state,
            "wchan": t.wchan,
            "cpu_seconds": round(t.cpu_ticks / clk, 2),
            "voluntary_switches": t.voluntary_switches,
            "involuntary_switches": t.involuntary_switches,
            "python_thread": stacks[t.tid].name if t.tid in stacks else None,
            "owns_gil": bool(t.tid in stacks and stacks[t.tid].owns_gil),
        }
        for t in threads
    ]
    # rank and GPU memory from the daemon's state
    rank = _rank_of(state, pid)
    report["rank"] = (
        {
            "job_id": rank["job_id"],
            "rank": rank["rank"],
            "stalled": rank.get("stalled", False),
            "progress_timestamp": rank.get("progress_timestamp"),
        }
        if rank
        else None
    )
    report["gil"] = None
    if rank:
        counters = state.get("counters", {})
        labels = [rank["job_id"], str(rank["rank"])]
        n = {
            name: next((c["value"] for c in counters.get(name, []) if c["labels"] == labels), 0.0)
            for name in ("rank_gil_samples", "rank_gil_held_samples")
        }
        if n["rank_gil_samples"]:
            report["gil"] = {
                "samples": n["rank_gil_samples"],
                "held_samples": n["rank_gil_held_samples"],
                "held_ratio": round(n["rank_gil_held_samples"] / n["rank_gil_samples"], 3),
            }
    if state.get("gpus"):
        report["gpu_memory"] = [
            {"gpu": g["gpu_index"], "uuid": g["uuid"], "used_memory_bytes": g["used_memory_bytes"]}
            for g in state.get("gpu_processes", [])
            if g.get("pid") == pid
        ]
        report["gpu_memory_source"] = "daemon state"
    else:
        report["gpu_memory"], report["gpu_memory_source"] = _gpu_memory_now(pid, cfg, nvml)
    # NCCL environment and fork checks
    env = procfs.environ(pid, NCCL_VARS)  # the values, for the report's verdicts only
    report["nccl"] = nccl_checks(env)
    children = procfs.children(pid)
    # the fork evidence of the daemon's NVML part (daemon/fork_evidence.py) over this tree, with
    # NVML's process list unknown (every process that can show a fork after CUDA)
    reader = devfds.EvidenceReader(paths)
    tree = RankEntry("-", -1, pid)
    evidence = fork_evidence(reader, (tree,), view.processes, view.descendants, None)
    me = evidence.get(pid) or reader.read(pid, info.open_fds)  # a process without children too
    kids = [evidence[c] for c in children if c in evidence]
    forked = fork_after_cuda.forked_children(me, kids) if me is not None else []
    report["fork"] = {
        "holds_cuda_context": bool(me and me.holds_cuda_device),
        "children": children,
        "forked_after_cuda": [k.pid for k in forked],
    }
    # findings: the daemon's active ones for this process or its rank, and the local checks now
    found: list[dict[str, Any]] = []
    for f in state.get("findings", []):
        if f.get("pid") == str(pid) or (
            rank and f.get("job_id") == rank["job_id"] and f.get("rank") == str(rank["rank"])
        ):
            found.append(
                {"kind": f["kind"], "severity": f["severity"], "explanation": f["explanation"], "from": "daemon"}
            )
    pseudo = RankState(
        job_id=rank["job_id"] if rank else "-",
        rank=int(rank["rank"]) if rank else -1,
        pid=pid,
        local_rank=None,
        world_size=None,
        alive=True,
        process=info,
        tree=(pid, *children),
    )
    ctx = FindingContext(
        now=time.time(),
        config=cfg,
        ranks=(pseudo,),
        processes=view.processes,
        env_flags={pid: view.env_flags[pid]} if pid in view.env_flags else {pid: nccl_env.env_flags(env)},
        parts=Tracked(gpu=GpuOutput(fork_evidence={**evidence, pid: me} if me is not None else evidence)),
    )
    kinds = {f["kind"] for f in found}
    for rule in (fd_exhaustion.find, nccl_env.find, fork_after_cuda.find):
        for f in rule(ctx):
            if f.kind not in kinds:
                found.append({"kind": f.kind, "severity": f.severity, "explanation": f.explanation, "from": "doctor"})
    report["findings"] = found
    return report


HANG_WINDOW = 0.5  # seconds between the two looks that give each thread's CPU share


def hang_report(
    paths: HostPaths,
    pid: int,
    dumped: tuple[ThreadStack, ...],
    before: tuple[float, tuple[ThreadInfo, ...], Mapping[int, int | None]],
    threads: tuple[ThreadInfo, ...],
    clk: int,
) -> dict[str, Any]:
    """Every Python thread folded, with the hang patterns (gpuwatchd/join/hang.py) over HANG_WINDOW."""
    t0, first, switches = before
    elapsed = max(time.monotonic() - t0, 1e-3)
    prev = {t.tid: t.cpu_ticks for t in first}
    shares = {t.tid: (t.cpu_ticks - prev[t.tid]) / clk / elapsed for t in threads if t.tid in prev}
    waits = taskwait.read_waits(paths, pid, wait_tids(dumped, threads))
    states = {c: process_state(paths, c) or "X" for c in switches}
    live = {c: (st, taskwait.context_switches(paths, c)) for c, st in states.items()}
    known = {c: n for c, n in switches.items() if n is not None}
    workers = worker_view(switches, live, known) if switches else None
    a = analyze(dumped, threads, shares, waits, workers)
    return {"patterns": [{"kind": p.kind, "text": p.text} for p in a.patterns], "threads": [g.text() for g in a.groups]}


def _gpu_memory_now(pid: int, cfg: Config, nvml: Any) -> tuple[list[dict[str, Any]] | None, str]:
    """Read NVML once, in a worker thread with the configured time-out (a wedged driver must not
    hang the command)."""
    from gpuwatchd.isolation import NotPresent
    from gpuwatchd.sources.nvml import NvmlReadError, NvmlSource
    from gpuwatchd.sources.nvml_fixture import RecordedNvml

    if not cfg.nvml.enabled and nvml is None:
        return None, "nvml disabled in the config"
    if nvml is None and cfg.nvml.fixture:
        nvml = RecordedNvml.from_file(cfg.nvml.fixture)
    result: list[Any] = []

    def read() -> None:
        try:
            result.append(NvmlSource(pynvml=nvml).read())
        except NotPresent as e:
            result.append(f"no NVIDIA driver ({e})")
        except (NvmlReadError, OSError) as e:
            result.append(f"NVML failed: {e}")

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(cfg.nvml.timeout_seconds)
    if not result:
        return None, f"NVML did not answer within {cfg.nvml.timeout_seconds:g}s"
    if isinstance(result[0], str):
        return None, result[0]
    _, processes = result[0]
    rows = [
        {"gpu": p.gpu_index, "uuid": p.uuid, "used_memory_bytes": p.used_memory_bytes}
        for p in processes
        if p.pid == pid
    ]
    return rows, "NVML now"


def render(r: Mapping[str, Any]) -> str:
    if "error" in r:
        return f"gpuwatchd doctor: {r['error']}"
    who = "P" + pid_text(r["pid"], r.get("ns_pid"))[1:].replace("id", "ID", 1)  # "PID 48213 (1 in ...)"
    lines = [
        f"{who}{', ' + r['container'] if r.get('container') else ''} ({r['comm']}) user {r['user']} "
        f"ppid {r['ppid']}: "
        f"{r['state']} {r['state_meaning']}, {r['cpu_seconds']:.1f} CPU-s, RSS {fmt_bytes(r['rss_bytes'])}",
    ]
    if r.get("rank"):
        rk = r["rank"]
        lines.append(f"rank {rk['rank']} of job {rk['job_id']}" + (" (STALLED)" if rk["stalled"] else ""))
    f = r["fds"]
    ratio = f" ({f['ratio']:.0%})" if f["ratio"] is not None else ""
    lines.append(
        f"fds: {f['open'] if f['open'] is not None else '?'} open of soft limit "
        f"{f['soft_limit'] or '?'}{ratio}, hard {f['hard_limit'] or '?'}"
    )
    if r.get("gil"):
        g = r["gil"]
        lines.append(
            f"GIL held {g['held_ratio']:.0%} of {g['samples']:.0f} sampled ticks "
            "since the daemon started (py-spy record --gil --nonblocking)"
        )
    gm = r["gpu_memory"]
    src = r.get("gpu_memory_source", "")
    if gm is None:
        lines.append(f"GPU memory: unknown ({src})")
    elif not gm:
        lines.append(f"GPU memory: none held ({src})")
    else:
        lines.append(
            "GPU memory: " + ", ".join(f"GPU {g['gpu']} {fmt_bytes(g['used_memory_bytes'])}" for g in gm) + f" ({src})"
        )
    lines.append(f"\nTHREADS ({len(r['threads'])})")
    lines.append(f"  {'TID':>7} {'ST':<2} {'WCHAN':<22} {'CPU s':>8}  PYTHON")
    for t in r["threads"]:
        py = (t["python_thread"] or "-") + (" [GIL]" if t["owns_gil"] else "")
        lines.append(f"  {t['tid']:>7} {t['state']:<2} {(t['wchan'] or '-')[:22]:<22} {t['cpu_seconds']:>8.2f}  {py}")
    if r.get("hang"):
        lines.append("\nPYTHON THREADS (folded; CPU over 0.5 s)")
        lines.extend(f"  {t}" for t in r["hang"]["threads"])
        for p in r["hang"]["patterns"]:
            lines.append(f"  => {p['text']}")
    py = r["python"]
    lines.append("\nPYTHON STACKS (py-spy dump --nonblocking)")
    if "error" in py:
        lines.append(f"  unavailable: {py['error']}")
    else:
        owner = py["gil_owner"]
        lines.append(
            "  GIL owner: " + (f"{owner['name']} (tid {owner['tid']})" if owner else "none at the moment of the dump")
        )
        for t in py["threads"]:
            flags = "gil" if t["owns_gil"] else ("active" if t["active"] else "idle")
            lines.append(f'  Thread {t["tid"]} ({flags}): "{t["name"]}"')
            lines.extend(f"      {fr}" for fr in t["frames"][:20])
    lines.append("\nNCCL ENVIRONMENT")
    lines.extend(f"  {c['variable']}: {c['verdict']}" for c in r["nccl"])
    fk = r["fork"]
    lines.append("\nFORK")
    lines.append(
        f"  CUDA context: {'yes' if fk['holds_cuda_context'] else 'no'}; "
        f"children: {len(fk['children'])}; forked after CUDA: "
        f"{', '.join(map(str, fk['forked_after_cuda'])) or 'none'}"
    )
    lines.append("\nFINDINGS")
    if not r["findings"]:
        lines.append("  none")
    for fd in r["findings"]:
        lines.append(f"  [{fd['severity']}] {fd['kind']}: {fd['explanation']}")
    if r.get("state_origin"):
        lines.append(f"\n# daemon data: {r['state_origin']}")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:

    cfg = resolve_config(args)
    state, origin = load_state(cfg)
    report = collect(args.pid, cfg, state=state, state_origin=origin)
    if "error" in report:  # no such process (in the configured procfs)
        raise CliError(str(report["error"]), EXIT_USAGE)
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
    else:
        print(render(printable_tree(report)))  # a rank's strings never reach the terminal raw
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="everything known about one process: state, threads, fds, "
        "GPU memory, Python stack with the GIL owner, NCCL/fork checks, findings",
    )
    p.add_argument("--config.file", dest="config_file", default=None, help="YAML config")
    p.add_argument("pid", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
