"""PyTorch's own flight-recorder dump on request, for ranks that set the variables in their
environment (no ``register_rank()`` needed): a write to the rank's FIFO makes ProcessGroupNCCL
dump its flight recorder, and training goes on.

torch (``ProcessGroupNCCL.hpp``, ``struct DumpPipe``): with ``TORCH_FR_DEBUG_INFO_PIPE_FILE``
(formerly ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``) set and a trace buffer (``TORCH_FR_BUFFER_SIZE``,
formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``, > 0) each
rank makes the FIFO ``<stem><global rank>.pipe`` and polls it; on any byte it writes the dump to
``<prefix><global rank>`` (``TORCH_FR_DUMP_TEMP_FILE``, formerly ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``,
default ``/tmp/nccl_trace_rank_``) as a pickle of plain containers.

Paths are the rank's own, resolved in its mount namespace (``/proc/PID/root``). The FIFO is
written only when it is a FIFO owned by the rank's uid: opened O_PATH|O_NOFOLLOW, checked with
fstat, then reopened through ``/proc/self/fd`` O_WRONLY|O_NONBLOCK (the same inode, never a device
or a file swapped in between). The dump is read under the same rules (a regular file of one
link owned by the rank's uid, at most ``MAX_DUMP_BYTES``) and unpickled with no class at all
(``find_class`` refuses every global); of it only the scalar fields the flight recorder's parser
reads are taken (a pickle's memo can make a small file a huge tree, which is never walked).
Shell equivalent: ``echo > ${TORCH_NCCL_DEBUG_INFO_PIPE_FILE}0.pipe``, then ``torchfrtrace``.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat as statmod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.model.collectives import MAX_ENTRIES_READ, MAX_GROUPS

PIPE_VARS = (
    "TORCH_FR_DEBUG_INFO_PIPE_FILE",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"
MAX_DUMP_BYTES = 16 << 20  # 2,000 entries with their stack frames: a few MB
# what gpuwatchd/join/flight_recorder.py parse_response reads of an entry and of a group's status
ENTRY_FIELDS = ("collective_seq_id", "pg_id", "state", "profiling_name", "is_p2p")
STATUS_FIELDS = ("last_completed_collective", "last_started_collective", "last_enqueued_collective")
MAX_PATH = 1024


@dataclass(frozen=True)
class PipeSettings:
    pipe: str  # the FIFO, as the rank names it
    dump: str  # where the rank writes the dump


def settings(env: Mapping[str, str], rank: int) -> PipeSettings | None:
    """The rank's FIFO and dump paths, or None when its environment does not turn the pipe on."""
    stem = env.get("TORCH_FR_DEBUG_INFO_PIPE_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "")
    size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")).strip()
    if not stem or not size.isascii() or not size.isdigit() or int(size[:9]) <= 0:
        return None
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or DEFAULT_DUMP_PREFIX
    pipe, dump = f"{stem}{rank}.pipe", f"{prefix}{rank}"
    if not pipe.startswith("/") or not dump.startswith("/") or max(len(pipe), len(dump)) > MAX_PATH:
        return None  # relative to the rank's working directory: not followed
    return PipeSettings(pipe, dump)


def in_root(root: str, path: str) -> str:
    """``path`` of the rank's mount namespace, seen through its ``/proc/PID/root``."""
    return root.rstrip("/") + "/" + path.lstrip("/")


def trigger(path: str, uid: int) -> None:
    """One byte into the FIFO at ``path`` if it is a FIFO owned by ``uid``; ValueError / OSError
    otherwise (ENXIO: nobody reads it, the rank has no dump thread)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not statmod.S_ISFIFO(st.st_mode):
            raise ValueError("not a FIFO")
        if st.st_uid != uid:
            raise ValueError(f"owned by uid {st.st_uid}, not the rank's")
        wfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(fd)
    try:
        st2 = os.fstat(wfd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino) or not statmod.S_ISFIFO(st2.st_mode):
            raise ValueError("changed while opened")
        os.write(wfd, b"1")
    finally:
        os.close(wfd)


def dump_mtime(path: str, uid: int) -> float | None:
    """The dump file's mtime when it is the rank's regular file, else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_mtime if statmod.S_ISREG(st.st_mode) and st.st_uid == uid else None


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused a global {module[:40]}.{name[:40]}")


def read_dump(path: str, uid: int) -> Any:
    """The rank's dump, unpickled with no class and walked within bounds; ValueError / OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not statmod.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ValueError("not a regular file with one link")
        if st.st_uid != uid:
            raise ValueError(f"owned by uid {st.st_uid}, not the rank's")
        chunks, size = [], 0
        while size <= MAX_DUMP_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_DUMP_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > MAX_DUMP_BYTES:
        raise ValueError(f"larger than {MAX_DUMP_BYTES} bytes")
    try:
        raw = _NoClasses(io.BytesIO(b"".join(chunks))).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        MemoryError,
        OverflowError,
    ) as exc:
        raise ValueError(f"not a plain pickle: {str(exc)[:80]}") from None
    return plain(raw)


def _scalar(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        if v.bit_length() > 63:
            raise ValueError("an integer out of range")
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("a number out of range")
        return v
    return None  # containers, bytes and the like: nothing the parser reads


def plain(obj: Any) -> dict[str, Any]:
    """Of a dump, only what the flight recorder's parser reads, as JSON values: the scalar
    ``ENTRY_FIELDS`` of the first ``MAX_ENTRIES_READ`` entries and the scalar ``STATUS_FIELDS`` of
    ``MAX_GROUPS`` groups of ``pg_status``. Nothing else is walked: a pickle's memo can make an 8 KB
    file a tree of 10**12 values, which a full walk would visit."""
    if not isinstance(obj, dict):
        raise ValueError("the dump is not a dict")
    out: dict[str, Any] = {}
    entries = obj.get("entries")
    if isinstance(entries, (list, tuple)):
        out["entries"] = [
            {k: _scalar(e[k]) for k in ENTRY_FIELDS if k in e}
            for e in entries[:MAX_ENTRIES_READ]
            if isinstance(e, dict)
        ]
    status = obj.get("pg_status")
    if isinstance(status, dict):
        out["pg_status"] = {
            str(pg)[:64]: {k: _scalar(st[k]) for k in STATUS_FIELDS if k in st}
            for pg, st in list(status.items())[:MAX_GROUPS]
            if isinstance(st, dict)
        }
    return out
