"""The step a rank wrote with ``gpuwatchd.heartbeat(step)``: the content of its heartbeat file.

The heartbeat path was already checked by the rank-file rules (sources/rankfiles.py
``heartbeat_path``); the file is opened again here without following a symlink, must be a regular
file owned by the rank file's owner (or root), and only its first ``MAX_BYTES`` are read: an
integer, or nothing (``heartbeat()`` without a step). Read only when the mtime changed.
Shell equivalent: ``cat /run/gpuwatch/ranks/JOB.RANK.hb``.
"""

from __future__ import annotations

import os
import stat as statmod

MAX_BYTES = 32
MAX_STEP = 1 << 62


def read_step(path: str, owner_uid: int | None, dir_fd: int | None = None) -> int | None:
    """The step in the heartbeat file ``path`` (a name in ``dir_fd`` when given: the directory
    ``HeartbeatRoots`` keeps open in the rank's own root), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not statmod.S_ISREG(st.st_mode):
            return None
        if owner_uid not in (None, 0) and st.st_uid != owner_uid:
            return None
        raw = os.read(fd, MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    if not text.isdigit() or len(text) > 19:
        return None
    step = int(text)
    return step if step <= MAX_STEP else None
