"""How a rank writes into the shared rank directory without another user's files getting in its way.

The rank directory (default ``/run/gpuwatch/ranks``) is mode 1777: every user may create names in
it, and so may create, before a rank does, the name the rank means to write (a file, a directory,
a FIFO, a symbolic link). The rules here make such a name cost the rank nothing:

- the directory is opened once (``O_DIRECTORY | O_NOFOLLOW``) and must be owned by root or by the
  rank's own uid, and not be writable by others without the sticky bit: in a directory that
  another user owns, that user may rename or replace any name, so the rank writes nothing there;
- every name is opened relative to that descriptor, never through a path that could be swapped;
- a new file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK``: it never follows a
  link, never opens (or blocks on) a FIFO, never truncates a file of someone else's;
- a preferred name (``JOB.RANK.json``, ``JOB.RANK.hb``: what ``gpuwatchd register``, the docs and
  shell scripts know) is used when it is free or already the rank's own regular file; when
  another user holds it, the rank takes ``JOB.RANK.<16 hex digits>.SUFFIX`` instead, a name no one
  can guess in advance. The daemon reads every ``*.json`` and the heartbeat path the rank file
  names, so it needs no change to find either.

Runs inside the training process: standard library only. Costs: one ``open`` and ``fstat`` of
the directory per registration; the names themselves as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as statmod

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Failures that no other name in the same directory would avoid: reported, not worked around.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


class UnsafeRankDir(OSError):
    """The directory is not one a rank may write into (the message says why)."""


def open_dir(path: str, create: bool = True) -> int:
    """A descriptor of the directory ``path`` (made, mode 0755, when missing and ``create``),
    verified safe to write into; UnsafeRankDir saying why not, OSError when it cannot be opened."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.makedirs(path, exist_ok=True)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeRankDir(f"rank directory {path} is a symbolic link (refused)") from None
        raise
    try:
        check_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_dir(fd: int, path: str) -> None:
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise UnsafeRankDir(
            f"rank directory {path} is owned by uid {st.st_uid}, not root or this process's uid "
            f"{me}: its owner could replace any file in it (refused)"
        )
    if st.st_mode & statmod.S_IWOTH and not st.st_mode & statmod.S_ISVTX and st.st_uid != me:
        raise UnsafeRankDir(
            f"rank directory {path} is writable by everyone without the sticky "
            f"bit: anyone could replace a file in it (refused)"
        )


def token() -> str:
    return os.urandom(8).hex()


def create_new(dir_fd: int, stem: str, suffix: str, mode: int = 0o644, access: int = os.O_WRONLY) -> tuple[int, str]:
    """(fd, name) of a new empty file ``stem.<token>suffix``, made by this call (O_EXCL)."""
    for _ in range(8):
        name = f"{stem}.{token()}{suffix}"
        try:
            return os.open(name, access | _NEW_FLAGS, mode, dir_fd=dir_fd), name
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free name")  # eight 64-bit collisions: not reached


def own_regular(fd: int) -> bool:
    st = os.fstat(fd)
    return statmod.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1


def open_own(dir_fd: int, name: str, stem: str, suffix: str) -> tuple[int, str]:
    """(fd open for reading and writing, name) of ``name`` when it is free (created now) or this
    uid's own regular file with one link; else of a new ``stem.<token>suffix``. Another user's
    link, FIFO, directory or file at ``name`` is never followed, opened blocking or written."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise
    else:
        if own_regular(fd):
            return fd, name
        os.close(fd)
    return create_new(dir_fd, stem, suffix, access=os.O_RDWR)


def place(dir_fd: int, tmp: str, name: str, stem: str, suffix: str, fallback: bool = True) -> str:
    """Rename the finished ``tmp`` to ``name``, or, when another user holds ``name`` (the sticky
    bit refuses to replace it; it is a directory), to a new ``stem.<token>suffix``. Returns the
    name used. A rename never follows a link at the target: it replaces the link itself. Without
    ``fallback`` a held name is an OSError (EPERM) instead: for a name the daemon looks for and
    no other (a flight-recorder answer), where new names would only pile up."""
    if not fallback:
        if _held(dir_fd, name):
            raise OSError(errno.EPERM, f"{name} is held by another user")
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return name
    if _held(dir_fd, name):
        return _place_new(dir_fd, tmp, stem, suffix)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return name
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise
        return _place_new(dir_fd, tmp, stem, suffix)  # taken between the look and the rename


def _held(dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists and is not this uid's own regular file with one link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise
        return True
    try:
        return not own_regular(fd)
    finally:
        os.close(fd)


def _place_new(dir_fd: int, tmp: str, stem: str, suffix: str) -> str:
    """Rename ``tmp`` to a fresh unguessable name: made empty first with O_EXCL, so that the
    rename replaces this call's own file and nothing else."""
    fd, name = create_new(dir_fd, stem, suffix)
    os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return name


def write_new(dir_fd: int, name: str, stem: str, suffix: str, data: bytes, fallback: bool = True) -> str:
    """Write ``data`` to a private temp file, then ``place`` it under ``name``; the temp file is
    removed on any failure. Returns the name used."""
    fd, tmp = create_new(dir_fd, f".{stem}", ".tmp")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        return place(dir_fd, tmp, name, stem, suffix, fallback)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
