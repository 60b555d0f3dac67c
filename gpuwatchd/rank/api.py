"""Launcher-side API, for training scripts: ``gpuwatchd.register_rank()`` and
``gpuwatchd.heartbeat(step)``.

``register_rank()`` reads the rank layout from the launcher's variables (torchrun, Slurm, Open MPI),
writes this process's rank file atomically into the rank directory and returns its path. It never
raises because monitoring is unavailable: a training job must not die because its monitor is
missing; it logs a warning and returns None instead (``strict=True`` raises).
``heartbeat(step)`` updates the rank's heartbeat file (mtime = last progress); it is a single small
write, cheap enough for every training step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.rank.rankfile import (
    INIT_PID_NS,
    RankFileError,
    claim_from_env,
    rank_file_name,
    write_rank_file,
)

log = logging.getLogger(__name__)
DEFAULT_RANK_DIR = "/run/gpuwatch/ranks"
_registered: dict[str, Any] = {}


def rank_dir_default() -> str:
    return os.environ.get("GPUWATCH_RANK_DIR", DEFAULT_RANK_DIR)


def _visible_gpus(env: Mapping[str, str], local_rank: int | None) -> list[str]:
    devices = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if devices and local_rank is not None and local_rank < len(devices):
        return [devices[local_rank]]
    if devices and len(devices) == 1:
        return devices
    if local_rank is not None and not devices:
        return [str(local_rank)]
    return []


def build_document(job_id: str, rank: int, pid: int, *, local_rank: int | None = None,
                   world_size: int | None = None, gpus: Sequence[str] = (),
                   heartbeat: str | None = None, start_ticks: int | None = None,
                   pid_ns: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": rank, "pid": pid}
    if pid_ns is not None:
        entry["pid_ns"] = pid_ns
    if local_rank is not None:
        entry["local_rank"] = local_rank
    if gpus:
        entry["gpus"] = list(gpus)
    if heartbeat:
        entry["heartbeat"] = heartbeat
    if start_ticks is not None:
        entry["start_ticks"] = start_ticks
    doc: dict[str, Any] = {"version": 1, "job_id": job_id, "ranks": [entry]}
    if world_size is not None:
        doc["world_size"] = world_size
    return doc


def _proc(pid: int) -> str:
    # /proc/self is this process in any /proc: also where /proc is not the container's own
    return "/proc/self" if pid == os.getpid() else f"/proc/{pid}"


def read_start_ticks(pid: int) -> int | None:
    try:
        with open(f"{_proc(pid)}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
        return int(raw[raw.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_namespace() -> int | None:
    """The inode of the writer's own PID namespace (in which the PIDs it writes are numbered)
    when it is not the host's (a container), else None.

    Written into the rank file as ``pid_ns``, so that the daemon can find the host PID of a rank
    that only knows its in-container PID (docs/rankfile.md). On the host it is left out, and rank
    files stay readable by daemons that predate the field. (A host-side ``gpuwatchd register
    --pid HOSTPID`` of a containerised process therefore writes a host PID, as it should.)"""
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return None if ino == INIT_PID_NS else ino


def register_rank(job_id: str | None = None, rank: int | None = None, *,
                  local_rank: int | None = None, world_size: int | None = None,
                  gpus: Sequence[str] | None = None, pid: int | None = None,
                  rank_dir: str | None = None, heartbeat: bool | str = True,
                  cuda_oom_hook: bool = True, strict: bool = False,
                  flight_recorder: bool = True) -> str | None:
    """Register this process (or ``pid``) as a rank. Missing values come from the environment.

    ``heartbeat``: True for a heartbeat file next to the rank file, an absolute path for one
    elsewhere (e.g. in the container's own /tmp: the daemon reads it through /proc/PID/root),
    False for none. Inside a container (its own PID namespace) the rank file names the PID the
    container sees and the namespace (``pid_ns``); the daemon maps it to the host PID.

    ``flight_recorder``: answer the daemon's flight-recorder dump requests from a small thread
    (gpuwatchd/rank/flight_recorder.py; only for this process, not for another ``pid``)."""
    env = dict(os.environ)
    claim = claim_from_env(env, ("torchrun", "slurm", "openmpi"))
    if claim is not None:
        job_id = job_id if job_id is not None else claim[0]
        rank = rank if rank is not None else claim[1]
        local_rank = local_rank if local_rank is not None else claim[2]
        world_size = world_size if world_size is not None else claim[3]
    rank_dir = rank_dir or rank_dir_default()
    pid = pid or os.getpid()
    try:
        if job_id is None or rank is None:
            raise RankFileError("job_id and rank are not given and no launcher variables "
                                "(RANK/TORCHELASTIC_RUN_ID, SLURM_PROCID/SLURM_JOB_ID, "
                                "OMPI_COMM_WORLD_RANK) are set")
        if isinstance(heartbeat, str) and not os.path.isabs(heartbeat):
            raise RankFileError(f"heartbeat must be an absolute path, got {heartbeat!r}")
        hb = (heartbeat if isinstance(heartbeat, str)
              else os.path.join(rank_dir, f"{job_id}.{rank}.hb") if heartbeat else None)
        # The heartbeat path is published in the rank file only at the first heartbeat() call: a
        # script that never calls heartbeat() is judged by its stacks, not seen as "stalled".
        doc = build_document(job_id, rank, pid, local_rank=local_rank, world_size=world_size,
                             gpus=list(gpus) if gpus is not None else _visible_gpus(env, local_rank),
                             start_ticks=read_start_ticks(pid), pid_ns=pid_namespace())
        path = write_rank_file(rank_dir, doc, rank_file_name(job_id, rank))
    except (RankFileError, OSError) as e:
        if strict:
            raise
        log.warning("gpuwatchd: could not register rank: %s", e)
        return None
    _registered.clear()
    _registered.update(path=path, heartbeat=hb, job_id=job_id, rank=rank, doc=doc,
                       rank_dir=rank_dir, published=False)
    if cuda_oom_hook:
        _install_cuda_oom_hook(rank_dir, job_id, rank)
    if flight_recorder and pid == os.getpid():
        from gpuwatchd.rank import flight_recorder as fr

        fr.start(rank_dir, job_id, rank)
    return path


def _install_cuda_oom_hook(rank_dir: str, job_id: str, rank: int) -> None:
    from gpuwatchd.rank import cuda_oom

    cuda_oom.install_hook(rank_dir=rank_dir, job_id=job_id, rank=rank)


def _touch(path: str, content: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(content + "\n")
    os.replace(tmp, path)


def heartbeat(step: int | None = None) -> None:
    """Record progress. Cheap: one small file write. No-op when the rank is not registered."""
    path = _registered.get("heartbeat")
    if not path:
        return
    try:
        _touch(path, "" if step is None else str(int(step)))
        if not _registered.get("published"):
            doc = _registered["doc"]
            doc["ranks"][0]["heartbeat"] = path
            write_rank_file(_registered["rank_dir"], doc, os.path.basename(_registered["path"]))
            _registered["published"] = True
    except (OSError, RankFileError) as e:
        log.debug("gpuwatchd heartbeat failed: %s", e)


def unregister_rank(job_id: str | None = None, rank: int | None = None,
                    rank_dir: str | None = None) -> bool:
    """Remove the rank file (and heartbeat file). Returns whether a file was removed."""
    job_id = job_id if job_id is not None else _registered.get("job_id")
    rank = rank if rank is not None else _registered.get("rank")
    if job_id is None:
        return False
    rank_dir = rank_dir or rank_dir_default()
    names = [rank_file_name(job_id, rank)] if rank is not None else [rank_file_name(job_id)]
    if rank is not None:
        names += [f"{job_id}.{rank}.hb", f"{job_id}.{rank}.fr"]  # heartbeat, flight-recorder answer
    removed = False
    for name in names:
        try:
            os.unlink(os.path.join(rank_dir, name))
            removed = removed or name.endswith(".json")
        except FileNotFoundError:
            pass
    return removed
