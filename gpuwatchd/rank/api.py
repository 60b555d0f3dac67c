"""Launcher-side API, for training scripts: ``gpuwatchd.register_rank()`` and
``gpuwatchd.heartbeat(step)``.

``register_rank()`` reads the rank layout from the launcher's variables (torchrun, Slurm, Open MPI),
writes this process's rank file atomically into the rank directory and returns its path. It never
raises because monitoring is unavailable: a training job must not die because its monitor is
missing; it logs a warning and returns None instead (``strict=True`` raises).
``heartbeat(step)`` updates the rank's heartbeat file (mtime = last progress); it is a single small
write, cheap enough for every training step.

The heartbeat file is opened once, at registration (rank/rankdir.py: in a directory owned by root
or the rank's uid, never through another user's link or FIFO, under an unguessable name when
another user holds ``JOB.RANK.hb``), and filled to its final size then. Each ``heartbeat(step)``
rewrites those same 21 bytes in place through the kept descriptor (``pwrite``), which needs no
new space and no name: a user who fills the rank directory's file system (``/run``) or plants
files beside it cannot make a heartbeat fail. Where even that write fails, ``futimens`` still
moves the mtime (the daemon's measure of progress), and the failure is logged as a warning once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.rank import rankdir
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


def build_document(
    job_id: str,
    rank: int,
    pid: int,
    *,
    local_rank: int | None = None,
    world_size: int | None = None,
    gpus: Sequence[str] = (),
    heartbeat: str | None = None,
    start_ticks: int | None = None,
    pid_ns: int | None = None,
) -> dict[str, Any]:
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


def register_rank(
    job_id: str | None = None,
    rank: int | None = None,
    *,
    local_rank: int | None = None,
    world_size: int | None = None,
    gpus: Sequence[str] | None = None,
    pid: int | None = None,
    rank_dir: str | None = None,
    heartbeat: bool | str = True,
    cuda_oom_hook: bool = True,
    strict: bool = False,
    flight_recorder: bool = True,
) -> str | None:
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
            raise RankFileError(
                "job_id and rank are not given and no launcher variables "
                "(RANK/TORCHELASTIC_RUN_ID, SLURM_PROCID/SLURM_JOB_ID, "
                "OMPI_COMM_WORLD_RANK) are set"
            )
        if isinstance(heartbeat, str) and not os.path.isabs(heartbeat):
            raise RankFileError(f"heartbeat must be an absolute path, got {heartbeat!r}")
        hb = (
            heartbeat
            if isinstance(heartbeat, str)
            else os.path.join(rank_dir, f"{job_id}.{rank}.hb")
            if heartbeat
            else None
        )
        # The heartbeat path is published in the rank file only at the first heartbeat() call: a
        # script that never calls heartbeat() is judged by its stacks, not seen as "stalled".
        doc = build_document(
            job_id,
            rank,
            pid,
            local_rank=local_rank,
            world_size=world_size,
            gpus=list(gpus) if gpus is not None else _visible_gpus(env, local_rank),
            start_ticks=read_start_ticks(pid),
            pid_ns=pid_namespace(),
        )
        path = write_rank_file(rank_dir, doc, rank_file_name(job_id, rank))
    except (RankFileError, OSError) as e:
        if strict:
            raise
        log.warning("gpuwatchd: could not register rank: %s", e)
        return None
    hb_file = None
    if hb is not None:
        try:
            hb_file = _HeartbeatFile.open(hb)
        except OSError as e:  # judged by its stacks instead: the path is never published
            if strict:
                raise
            log.warning("gpuwatchd: no heartbeat for this rank: %s", e)
    _forget()
    _registered.update(
        path=path,
        heartbeat=hb_file,
        job_id=job_id,
        rank=rank,
        doc=doc,
        rank_dir=rank_dir,
        published=False,
        publish_tried=float("-inf"),
    )
    if cuda_oom_hook:
        _install_cuda_oom_hook(rank_dir, job_id, rank)
    if flight_recorder and pid == os.getpid():
        from gpuwatchd.rank import flight_recorder as fr

        fr.start(rank_dir, job_id, rank)
    return path


def _install_cuda_oom_hook(rank_dir: str, job_id: str, rank: int) -> None:
    from gpuwatchd.rank import cuda_oom

    cuda_oom.install_hook(rank_dir=rank_dir, job_id=job_id, rank=rank)


HB_WIDTH = 20  # characters of the step field: 2**62, the largest step the daemon reads, has 19
PUBLISH_RETRY_SECONDS = 5.0  # a rank file that could not be rewritten is tried again this often


class _HeartbeatFile:
    """The rank's heartbeat: a descriptor kept open on its own file (module docstring)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.failing: str | None = None  # why the writes fail, during a failing streak

    @classmethod
    def open(cls, path: str) -> _HeartbeatFile:
        """Open (create) the heartbeat at ``path`` or, when another user holds that name,
        beside it under an unguessable name; filled to its size now, while there is space."""
        directory, name = os.path.split(path)
        stem, suffix = os.path.splitext(name)
        dir_fd = rankdir.open_dir(directory)
        try:
            fd, used = rankdir.open_own(dir_fd, name, stem, suffix)
        finally:
            os.close(dir_fd)
        try:
            os.pwrite(fd, _field(None), 0)
            os.ftruncate(fd, HB_WIDTH + 1)  # a longer file of an earlier run: shorter, no space
            os.fchmod(fd, 0o644)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, os.path.join(directory, used))

    def beat(self, step: int | None) -> None:
        try:
            os.pwrite(self.fd, _field(step), 0)
        except OSError as e:
            why = f"{e.strerror} ({errno.errorcode.get(e.errno or 0, e.errno)})"
            try:
                os.utime(self.fd)  # futimens: the mtime is the progress, and it needs no space
            except OSError as e2:
                why += f"; the mtime could not be set either: {e2.strerror}"
            if self.failing is None:
                log.warning("gpuwatchd: heartbeat writes fail: %s on %s", why, self.path)
            self.failing = why
            return
        if self.failing is not None:
            log.warning("gpuwatchd: heartbeat writes work again on %s", self.path)
            self.failing = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _field(step: int | None) -> bytes:
    text = "" if step is None else str(int(step))
    return (text if len(text) <= HB_WIDTH else "").ljust(HB_WIDTH).encode() + b"\n"


def _forget() -> None:
    hb = _registered.get("heartbeat")
    if isinstance(hb, _HeartbeatFile):
        hb.close()
    _registered.clear()


def heartbeat(step: int | None = None) -> None:
    """Record progress. Cheap: one 21-byte write in place. No-op when the rank is not registered."""
    hb = _registered.get("heartbeat")
    if hb is None:
        return
    hb.beat(step)
    if not _registered["published"]:
        _publish(hb.path)


def _publish(hb_path: str) -> None:
    """Name the heartbeat in the rank file (at the first beat, retried while that fails)."""
    now = time.monotonic()
    if now - _registered["publish_tried"] < PUBLISH_RETRY_SECONDS:
        return
    _registered["publish_tried"] = now
    doc = _registered["doc"]
    doc["ranks"][0]["heartbeat"] = hb_path
    try:
        write_rank_file(_registered["rank_dir"], doc, os.path.basename(_registered["path"]))
    except (OSError, RankFileError) as e:
        doc["ranks"][0].pop("heartbeat", None)
        if not _registered.get("publish_warned"):
            _registered["publish_warned"] = True
            log.warning(
                "gpuwatchd: the heartbeat could not be named in the rank file (tried "
                "again every %g s; judged by its stacks until then): %s",
                PUBLISH_RETRY_SECONDS,
                e,
            )
        return
    _registered["published"] = True


def unregister_rank(job_id: str | None = None, rank: int | None = None, rank_dir: str | None = None) -> bool:
    """Remove the rank file (and heartbeat file). Returns whether a file was removed.

    This process's own registration is removed by the names it used (an unguessable one where
    another user held the usual name); any other by the usual names, ``JOB.RANK.json`` and
    ``JOB.RANK.hb``. A name another user holds in the sticky directory is left (EPERM)."""
    job_id = job_id if job_id is not None else _registered.get("job_id")
    rank = rank if rank is not None else _registered.get("rank")
    if job_id is None:
        return False
    rank_dir = rank_dir or rank_dir_default()
    paths = [os.path.join(rank_dir, rank_file_name(job_id, rank))]
    if rank is not None:  # heartbeat, flight-recorder answer
        paths += [os.path.join(rank_dir, f"{job_id}.{rank}{ext}") for ext in (".hb", ".fr")]
    own = (_registered.get("job_id"), _registered.get("rank")) == (job_id, rank)
    if own:
        hb = _registered.get("heartbeat")
        paths = [_registered["path"], *([hb.path] if isinstance(hb, _HeartbeatFile) else []), *paths[1:]]
        _forget()
    removed = False
    for path in dict.fromkeys(paths):
        try:
            os.unlink(path)
            removed = removed or path.endswith(".json")
        except (FileNotFoundError, PermissionError):
            pass
    return removed
