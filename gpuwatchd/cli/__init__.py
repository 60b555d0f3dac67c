"""Command line: argv -> subcommands. The only module that exits.

Exit codes: 0 fine, 1 found a problem, 2 usage or configuration error, 3 an input that cannot be
read or reached (``cli/common.py``, docs/cli.md); every error is one line on stderr.
Subcommands that live in their own modules (events, doctor, check, job, web-config) add themselves
through a ``register(subparsers)`` function in that module (see ``COMMAND_MODULES``); what they
share (``--config.file``, the resolved config, the daemon's state) is in ``cli/common.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from gpuwatchd import __version__
from gpuwatchd.cli import check, doctor, events, job, web_config
from gpuwatchd.cli.common import (
    DEFAULT_CONFIG,
    EXIT_MEANINGS,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    checked_file,
    load_state,
    resolve_config,
)
from gpuwatchd.cli.common import config_arg as _config_arg
from gpuwatchd.config.schema import ConfigError, load_config
from gpuwatchd.escape import printable, printable_tree
from gpuwatchd.logs import FORMATS, LEVELS
from gpuwatchd.units import fmt_bytes

# The commands that live in their own modules, in the order --help lists them. An explicit table:
# a command whose module fails to import fails `gpuwatchd` loudly instead of vanishing from --help.
COMMAND_MODULES = (events, doctor, check, job, web_config)


def cmd_run(args: argparse.Namespace) -> int:
    from gpuwatchd import logs
    from gpuwatchd.daemon import allocator
    from gpuwatchd.daemon.core import Daemon
    from gpuwatchd.web.server import ListenError

    allocator.limit_arenas()  # before the daemon's threads: this process is the daemon

    cfg = resolve_config(args)
    logs.configure(args.log_level or cfg.log_level, args.log_format)
    path = args.config_file or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    # this process is the daemon and nothing else: every child it has is a py-spy run
    daemon = Daemon(
        cfg,
        config_path=path,
        listen_override=args.listen_address,
        web_config_override=args.web_config_file,
        reap_strays=True,
    )
    try:
        daemon.run()
    except ListenError as e:  # two exporters on one port: the first mistake of a new install
        raise CliError(f"{e}; choose another with --web.listen-address or web.listen_address", EXIT_USAGE) from None
    return daemon.exit_status


def cmd_config_check(args: argparse.Namespace) -> int:
    """What a reload (SIGHUP) would accept: the unit's ExecReload= runs this before signalling."""
    args.file = checked_file(args.file, args.config_file, "--config.file", DEFAULT_CONFIG)
    cfg = load_config(args.file)
    if cfg.web.config_file:
        from gpuwatchd.web.web_config import WebConfigError, load_web_config

        try:  # the daemon refuses a reload whose web-config file is bad: so does the check
            load_web_config(cfg.web.config_file)
        except WebConfigError as e:
            raise ConfigError([f"web.config_file: {p}" for p in e.problems], args.file) from None
    print(
        f"{args.file}: OK (interval {cfg.interval_seconds:g}s, listen {cfg.web.listen_address}, "
        f"rank_dir {cfg.rank_dir})"
    )
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    from gpuwatchd.rank.api import build_document, pid_namespace, read_start_ticks
    from gpuwatchd.rank.rankfile import RankFileError, rank_file_name, write_rank_file

    cfg = resolve_config(args)
    rank_dir = args.rank_dir or cfg.rank_dir
    # A typo must not become a silent misconfiguration: the daemon watches the configured
    # directory only (tmpfiles.d makes it at boot), and a rank file for a dead PID is never read.
    if not os.path.isdir(rank_dir):
        raise CliError(
            f"rank directory {rank_dir} does not exist (the daemon watches "
            f"{cfg.rank_dir}; systemd-tmpfiles --create makes it)",
            EXIT_USAGE,
        )
    try:
        # /proc/PID's owner is the process's effective uid: what the daemon compares the file's
        # owner with (join/rank_claims.py, rule 1)
        proc_uid = os.stat(f"/proc/{args.pid}").st_uid
    except FileNotFoundError:
        raise CliError(f"no process {args.pid}", EXIT_USAGE) from None
    me = os.geteuid()
    if me != 0 and proc_uid != me:
        raise CliError(
            f"process {args.pid} is uid {proc_uid}'s, not yours (uid {me}): the daemon "
            "reads a rank file only when root or the process's own user wrote it; "
            "register it as that user or as root (docs/cli.md)",
            EXIT_USAGE,
        )
    gpus = [g for g in (args.gpus or "").split(",") if g]
    hb = args.heartbeat
    doc = build_document(
        args.job_id,
        args.rank,
        args.pid,
        local_rank=args.local_rank,
        world_size=args.world_size,
        gpus=gpus,
        heartbeat=hb,
        start_ticks=read_start_ticks(args.pid),
        pid_ns=pid_namespace(),
    )
    try:
        path = write_rank_file(rank_dir, doc, rank_file_name(args.job_id, args.rank))
    except RankFileError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except OSError as e:
        raise CliError(f"cannot write in {rank_dir}: {e.strerror or e}", EXIT_UNAVAILABLE) from None
    print(path)
    return 0


def cmd_unregister(args: argparse.Namespace) -> int:
    from gpuwatchd.rank.api import unregister_rank
    from gpuwatchd.rank.rankfile import rank_file_name

    cfg = resolve_config(args)
    rank_dir = args.rank_dir or cfg.rank_dir
    if not os.path.isdir(rank_dir):
        raise CliError(f"rank directory {rank_dir} does not exist (the daemon watches {cfg.rank_dir})", EXIT_USAGE)
    removed = unregister_rank(args.job_id, args.rank, rank_dir)
    path = os.path.join(rank_dir, rank_file_name(args.job_id, args.rank))
    try:
        left = os.lstat(path)
    except FileNotFoundError:
        left = None
    if not removed and left is not None:  # the sticky directory: another user's file (EPERM)
        raise CliError(
            f"cannot remove {path}: it is uid {left.st_uid}'s (only its owner or root removes it)", EXIT_UNAVAILABLE
        )
    if not removed:
        print(
            f"gpuwatchd unregister: no rank file for job {args.job_id}"
            + (f" rank {args.rank}" if args.rank is not None else ""),
            file=sys.stderr,
        )
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from gpuwatchd.sources.pidns import pid_text

    cfg = resolve_config(args)
    state, origin = load_state(cfg)
    if args.json:
        json.dump({"origin": origin, **state}, sys.stdout, indent=1)
        print()
        return 0
    # every string of a rank (job ids, comm, findings' stack frames) escaped for the terminal
    state, origin = printable_tree(state), printable(origin)
    gpu_mem: dict[tuple[str, str], float] = {}
    for p in state.get("gpu_processes", []):
        if p.get("job_id") and p.get("used_memory_bytes") is not None:
            k = (p["job_id"], p["rank"])
            gpu_mem[k] = gpu_mem.get(k, 0) + p["used_memory_bytes"]
    gil: dict[tuple[str, str], tuple[float, float]] = {}
    counters = state.get("counters", {})
    for s in counters.get("rank_gil_samples", []):
        gil[(s["labels"][0], s["labels"][1])] = (s["value"], 0.0)
    for s in counters.get("rank_gil_held_samples", []):
        key = (s["labels"][0], s["labels"][1])
        if key in gil:
            gil[key] = (gil[key][0], s["value"])
    memcg: dict[tuple[str, str], str] = {}  # host memory: working set / limit of the rank's cgroup
    for m in state.get("rank_memory") or []:
        ws, limit = m.get("working_set_bytes"), m.get("limit_bytes")
        if isinstance(ws, int) and isinstance(limit, int) and limit > 0:
            memcg[(m["job_id"], str(m["rank"]))] = f"{ws / limit:.0%} of {fmt_bytes(limit)}"
    by_rank: dict[tuple[str, str], list[str]] = {}
    for f in state.get("findings", []):
        by_rank.setdefault((f["job_id"], f["rank"]), []).append(f["kind"])
    print(f"# {origin}")
    hdr = (
        f"{'JOB':<20} {'RANK':>4} {'PID':>7} {'ST':<2} {'CPU s':>8} {'RSS':>9} {'MEMCG':>15} "
        f"{'FDS':>11} {'GPU MEM':>9} {'GIL':>5}  FINDINGS"
    )
    print(hdr)
    for r in state.get("ranks", []):
        p = r.get("process") or {}
        key = (r["job_id"], str(r["rank"]))
        fds = f"{p.get('open_fds', '-')}/{p.get('max_fds_soft') or '-'}" if p else "-"
        g = gil.get(key)
        gil_s = f"{g[1] / g[0]:.0%}" if g and g[0] else "-"
        st = "--" if not r["alive"] else ("ST" if r.get("stalled") else p.get("state", "?"))
        cpu = f"{p['cpu_seconds']:.1f}" if p else "-"
        print(
            f"{r['job_id'][:20]:<20} {r['rank']:>4} {r['pid']:>7} {st:<2} {cpu:>8} "
            f"{fmt_bytes(p.get('rss_bytes'), '-') if p else '-':>9} {memcg.get(key, '-'):>15} {fds:>11} "
            f"{fmt_bytes(gpu_mem.get(key), '-'):>9} {gil_s:>5}  {','.join(by_rank.get(key, [])) or '-'}"
        )
        if r.get("ns_pid") is not None or r.get("container"):  # a rank in a container
            print(f"{'':<26}{pid_text(r['pid'], r.get('ns_pid'))}{', ' + r['container'] if r.get('container') else ''}")
    for gpu in state.get("gpus", []):
        util = gpu.get("utilization_ratio")
        print(
            f"GPU {gpu['index']} {gpu['name']} {fmt_bytes(gpu.get('memory_used_bytes'))}/"
            f"{fmt_bytes(gpu.get('memory_total_bytes'))} util "
            f"{'-' if util is None else format(util, '.0%')}"
        )
        # GPU memory held outside every rank's process tree (stale processes: gpuwatchd check)
        stale = {(o["pid"], o["uuid"]): o["reason"] for o in state.get("orphans", [])}
        for p in state.get("gpu_processes", []):
            if p.get("uuid") == gpu.get("uuid") and not p.get("job_id"):
                why = stale.get((p["pid"], p["uuid"]), "not in any rank")
                print(
                    f"  pid {p['pid']:>7} {p.get('comm') or '?':<15} {p.get('user') or '?':<10} "
                    f"{fmt_bytes(p.get('used_memory_bytes')):>8}  {why}"
                )
    node_findings = list(state.get("findings", []))
    if node_findings:
        print("\nFINDINGS")
        for f in node_findings:
            print(f"  [{f['severity']}] {f['kind']}: {f['explanation']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwatchd",
        description="Per-node monitoring of GPU training ranks.",
        epilog="Exit codes, in every command: "
        + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_MEANINGS)
        + ". Errors are one line on stderr.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon")
    _config_arg(p)
    p.add_argument(
        "--web.listen-address",
        dest="listen_address",
        default=None,
        help="HOST:PORT for /metrics (overrides web.listen_address)",
    )
    p.add_argument(
        "--web.config.file",
        dest="web_config_file",
        default=None,
        help="exporter web-config file: TLS, basic auth (overrides web.config_file)",
    )
    p.add_argument(
        "--log.level",
        dest="log_level",
        choices=LEVELS,
        default=None,
        help="only log records at this level or above (overrides log_level; default info)",
    )
    p.add_argument(
        "--log.format",
        dest="log_format",
        choices=FORMATS,
        default="text",
        help="text (default), logfmt or json (one record a line, for Loki or Elasticsearch)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    pc = csub.add_parser("check", help="validate a config file (exit 2 naming every bad key)")
    pc.add_argument("file", nargs="?", help=f"the config file (or --config.file; default {DEFAULT_CONFIG})")
    pc.add_argument("--config.file", dest="config_file", default=None, help="the config file, as `run` takes it")
    pc.set_defaults(func=cmd_config_check)

    p = sub.add_parser("register", help="write a rank file for a process (launch scripts, Slurm)")
    _config_arg(p)
    p.add_argument("--job-id", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--local-rank", type=int)
    p.add_argument("--world-size", type=int)
    p.add_argument("--gpus", help="comma-separated GPU indexes or UUIDs")
    p.add_argument("--heartbeat", help="absolute path whose mtime is the rank's last progress")
    p.add_argument("--rank-dir", help="override rank_dir")
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("unregister", help="remove a rank file")
    _config_arg(p)
    p.add_argument("--job-id", required=True)
    p.add_argument("--rank", type=int)
    p.add_argument("--rank-dir")
    p.set_defaults(func=cmd_unregister)

    p = sub.add_parser("ps", help="ranks, state, CPU, RSS, fds, GPU memory, GIL, findings")
    _config_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ps)

    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except CliError as e:
        print(f"{parser.prog} {args.command}: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:
        return 0
    except OSError as e:
        if args.command == "run":  # the daemon's own failure keeps its traceback
            raise
        # What no command handles itself (a file it cannot read): one line, not a traceback.
        where = f"{e.filename}: " if e.filename else ""
        print(f"{parser.prog} {args.command}: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return rc


if __name__ == "__main__":
    sys.exit(main())
