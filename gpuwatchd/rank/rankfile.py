"""The rank file, schema v1 (DESIGN §3, docs/rankfile.md, ``rank/rankfile.schema.json``):
what a rank writes (``write_rank_file``, used by ``gpuwatchd.register_rank()`` and ``gpuwatchd
register``) and what the daemon accepts (``parse_rank_document``, used by sources/rankfiles.py),
in one module so that writer and reader cannot drift apart. Also which launcher variables name a
rank (``claim_from_env``: torchrun, Slurm, Open MPI), read by the rank from its own environment and
by the daemon from /proc/PID/environ.

Runs inside the training process: imports only the standard library and ``gpuwatchd.model``.
Costs: parsing is bounded by the limits below; writing is one temp file and a rename (no fsync: a
rank file names a process, which a crash of the node ends too), in a directory checked by
rank/rankdir.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from gpuwatchd.model import RankEntry
from gpuwatchd.rank import rankdir

INIT_PID_NS = 0xEFFFFFFC  # PROC_PID_INIT_INO: the inode of the host's (initial) PID namespace
SCHEMA_VERSION = 1
MAX_FILE_BYTES = 256 * 1024
MAX_DEPTH = 8
MAX_RANKS_PER_FILE = 4096
MAX_FILES = 4096
# Of the MAX_FILES read per cycle, one non-root owner gets at most this many (and a fair share
# when several owners together have more): one user's junk never crowds out another's files.
MAX_FILES_PER_OWNER = 1024
# Series budget: every accepted rank becomes about a dozen series on /metrics, so the ranks one
# job (and one rank-file owner) may claim on one node are capped; the excess is refused with a
# bad_rank_file finding instead of flooding Prometheus. A node runs at most a few dozen ranks.
MAX_RANKS_PER_JOB = 256
MAX_RANKS_PER_OWNER = 1024
# Memory budget (bench/rank_caps_rss.py): each accepted rank costs the daemon about
# 25 MB per 1,000 after a minute (series, GIL and stall state), so 4096 ranks (120 MB and growing)
# did not fit the unit's MemoryMax=256M beside two py-spy runs of up to 64 MiB. At most this many
# ranks are watched on a node, shared max-min fairly between owners (root is one of them).
MAX_RANKS_PER_NODE = 1024
# Anchored with \Z (``$`` also matches before a final newline: "llm-7\n" passed) and ASCII
# (``\d`` would take any Unicode digit): the schema's ECMA-262 patterns mean exactly this.
JOB_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}\Z", re.ASCII)
GPU_RE = re.compile(r"^(?:[0-9]{1,3}|(?:GPU|MIG)-[A-Za-z0-9-]{1,80})\Z", re.ASCII)
TOP_KEYS = {"version", "job_id", "world_size", "ranks"}
RANK_KEYS = {"rank", "local_rank", "pid", "gpus", "heartbeat", "start_ticks", "pid_ns"}


class RankFileError(ValueError):
    pass


# No JSON number a valid rank file needs is longer than this (PIDs, ranks, start ticks < 2**62):
# longer literals are refused before int() sees them (CPython refuses > 4300 digits with a plain
# ValueError; below that a 4000-digit int still costs quadratic time to convert).
MAX_NUMBER_CHARS = 24


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise RankFileError(f"a number of {len(text)} digits (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise RankFileError(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return float(text)  # 1e400 -> inf: refused later, no field takes a float


def _parse_constant(name: str) -> Any:
    raise RankFileError(f"{name} is not a number JSON allows")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RankFileError(f"key {key!r:.40} appears twice in one object")
        out[key] = value
    return out


def loads_strict(text: str) -> Any:
    """``json.loads`` for untrusted rank files: NaN/Infinity, over-long numbers and duplicate keys
    raise RankFileError; bad JSON raises JSONDecodeError; deep nesting RecursionError."""
    return json.loads(
        text,
        parse_int=_parse_int,
        parse_float=_parse_float,
        parse_constant=_parse_constant,
        object_pairs_hook=_no_duplicate_keys,
    )


def bad_name(name: str) -> bool:
    """Names that cannot be shown or logged as they are (not UTF-8, control characters)."""
    return not name.isprintable()  # surrogate escapes of non-UTF-8 bytes are not printable


def _depth(obj: Any, limit: int = MAX_DEPTH, level: int = 1) -> int:
    if level > limit:
        raise RankFileError(f"nested deeper than {limit} levels")
    if isinstance(obj, dict):
        return max([level, *(_depth(v, limit, level + 1) for v in obj.values())])
    if isinstance(obj, list):
        return max([level, *(_depth(v, limit, level + 1) for v in obj)])
    return level


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RankFileError(f"{what} must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def parse_rank_document(doc: Any, path: str = "", owner_uid: int | None = None) -> list[RankEntry]:
    """Validate one schema-v1 document; raises RankFileError naming the first problem."""
    _depth(doc)
    if not isinstance(doc, dict):
        raise RankFileError("top level must be a JSON object")
    unknown = set(doc) - TOP_KEYS
    if unknown:
        raise RankFileError(f"unknown key(s) {sorted(unknown)!r:.80}")
    if isinstance(doc.get("version"), bool) or doc.get("version") != SCHEMA_VERSION:  # True == 1
        raise RankFileError(f"version must be {SCHEMA_VERSION}, got {doc.get('version')!r:.20}")
    job_id = doc.get("job_id")
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise RankFileError("job_id must be 1-128 characters of [A-Za-z0-9._:@-]")
    world_size = doc.get("world_size")
    if world_size is not None:
        world_size = _int(world_size, "world_size", 1, 1 << 20)
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise RankFileError("ranks must be a non-empty list")
    if len(ranks) > MAX_RANKS_PER_FILE:
        raise RankFileError(f"more than {MAX_RANKS_PER_FILE} ranks")
    out: list[RankEntry] = []
    seen: set[int] = set()
    for i, r in enumerate(ranks):
        where = f"ranks[{i}]"
        if not isinstance(r, dict):
            raise RankFileError(f"{where} must be an object")
        unknown = set(r) - RANK_KEYS
        if unknown:
            raise RankFileError(f"{where}: unknown key(s) {sorted(unknown)!r:.80}")
        rank = _int(r.get("rank"), f"{where}.rank", 0, (world_size or (1 << 20)) - 1)
        if rank in seen:
            raise RankFileError(f"{where}: rank {rank} listed twice")
        seen.add(rank)
        pid = _int(r.get("pid"), f"{where}.pid", 1, 1 << 22)
        local_rank = r.get("local_rank")
        if local_rank is not None:
            local_rank = _int(local_rank, f"{where}.local_rank", 0, 1 << 16)
        gpus_raw = r.get("gpus", [])
        if not isinstance(gpus_raw, list) or len(gpus_raw) > 64:
            raise RankFileError(f"{where}.gpus must be a list of at most 64 GPUs")
        gpus: list[str] = []
        for g in gpus_raw:
            gs = str(g) if isinstance(g, int) and not isinstance(g, bool) else g
            if not isinstance(gs, str) or not GPU_RE.match(gs):
                raise RankFileError(f"{where}.gpus: {g!r:.40} is neither an index nor a GPU UUID")
            gpus.append(gs)
        heartbeat = r.get("heartbeat")
        if heartbeat is not None and (
            not isinstance(heartbeat, str)
            or not os.path.isabs(heartbeat)
            or len(heartbeat) > 4096
            or not heartbeat.isprintable()
        ):
            raise RankFileError(f"{where}.heartbeat must be an absolute path of printable characters")
        start_ticks = r.get("start_ticks")
        if start_ticks is not None:
            start_ticks = _int(start_ticks, f"{where}.start_ticks", 0, 1 << 62)
        pid_ns = r.get("pid_ns")
        if pid_ns is not None:
            pid_ns = _int(pid_ns, f"{where}.pid_ns", 1, (1 << 32) - 1)
        out.append(
            RankEntry(
                job_id=job_id,
                rank=rank,
                pid=pid,
                local_rank=local_rank,
                world_size=world_size,
                gpus=tuple(gpus),
                heartbeat=heartbeat,
                start_ticks=start_ticks,
                source="rankfile",
                path=path,
                owner_uid=owner_uid,
                pid_ns=pid_ns,
            )
        )
    return out


def rank_file_name(job_id: str, rank: int | None = None) -> str:
    return f"{job_id}.json" if rank is None else f"{job_id}.{rank}.json"


def write_rank_file(rank_dir: str, doc: Mapping[str, Any], name: str) -> str:
    """Validate ``doc`` and write it atomically (temp file in the same directory, then rename)
    under ``name``, or, when another user holds that name in the shared directory, under
    ``JOB.RANK.<token>.json`` (rank/rankdir.py); returns the path written. OSError (an
    ``UnsafeRankDir`` among them) when the directory is not safe or the write fails."""
    parse_rank_document(json.loads(json.dumps(doc)))
    if "/" in name or name.startswith(".") or not name.endswith(".json"):
        raise RankFileError(f"bad rank file name {name!r}")
    data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    dir_fd = rankdir.open_dir(rank_dir)
    try:
        used = rankdir.write_new(dir_fd, name, name[: -len(".json")], ".json", data)
    finally:
        os.close(dir_fd)
    return os.path.join(rank_dir, used)


DISCOVERY_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_MCA_ess_base_jobid",
    "PMIX_NAMESPACE",
)


_ASCII_NUMBER = re.compile(r"[0-9]{1,8}\Z")


def _maybe_int(s: str | None) -> int | None:
    """A launcher's number: 1-8 ASCII digits, ASCII blanks around them allowed (``str.isdigit``
    is true for "²", which ``int`` refuses; ``int`` and ``str.strip`` take "٣", "１", NBSP), else
    None."""
    if s is None:
        return None
    s = s.strip(" \t\r\n")
    return int(s) if _ASCII_NUMBER.match(s) else None


def _safe_job_id(s: str) -> str | None:
    s = re.sub(r"[^A-Za-z0-9._:@-]", "_", s.strip())[:128]
    return s or None


def claim_from_env(env: Mapping[str, str], launchers: Iterable[str]) -> tuple[str, int, int | None, int | None] | None:
    """(job_id, rank, local_rank, world_size) that a launcher's variables say, or None.

    torchrun wins over Slurm (``srun torchrun`` gives every worker both; SLURM_PROCID is then the
    agent's task, RANK the worker's), Slurm over Open MPI.
    """
    enabled = set(launchers)
    slurm_job = env.get("SLURM_JOB_ID")
    if "torchrun" in enabled and "TORCHELASTIC_RUN_ID" in env and _maybe_int(env.get("RANK")) is not None:
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        job = run_id if run_id and run_id != "none" else (slurm_job or "torchrun")
        job_id = _safe_job_id(job)
        rank = _maybe_int(env.get("RANK"))
        if job_id and rank is not None:
            return job_id, rank, _maybe_int(env.get("LOCAL_RANK")), _maybe_int(env.get("WORLD_SIZE"))
    if "slurm" in enabled and slurm_job and _maybe_int(env.get("SLURM_PROCID")) is not None:
        step = env.get("SLURM_STEP_ID")
        job_id = _safe_job_id(f"{slurm_job}.{step}" if step else slurm_job)
        rank = _maybe_int(env.get("SLURM_PROCID"))
        if job_id and rank is not None:
            return (job_id, rank, _maybe_int(env.get("SLURM_LOCALID")), _maybe_int(env.get("SLURM_NTASKS")))
    if "openmpi" in enabled and _maybe_int(env.get("OMPI_COMM_WORLD_RANK")) is not None:
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or "openmpi"
        job_id = _safe_job_id(job)
        rank = _maybe_int(env.get("OMPI_COMM_WORLD_RANK"))
        if job_id and rank is not None:
            return (
                job_id,
                rank,
                _maybe_int(env.get("OMPI_COMM_WORLD_LOCAL_RANK")),
                _maybe_int(env.get("OMPI_COMM_WORLD_SIZE")),
            )
    return None
