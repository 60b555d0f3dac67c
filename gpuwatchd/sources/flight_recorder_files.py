"""The flight recorder's files under the rank directory: the daemon's request (``JOB.RANK.frreq``,
written atomically) and the rank's JSON answer (``JOB.RANK.fr``), read under the rank directory's
rules: no symlink (O_NOFOLLOW), a regular file with one link of at most ``MAX_BYTES``, owned by
root or the rank process's uid, JSON bounded in nesting and number size.

Reads: one small file per asked rank per cycle. Writes: one request file per rank of a stalled
job per interval. Privilege: write access to the rank directory (the daemon's tmpfiles entry).
Shell equivalent: ``cat $RANK_DIR/JOB.RANK.fr``. What the answers mean is gpuwatchd/join/flight_recorder.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat as statmod
from collections.abc import Iterable
from typing import Any

from gpuwatchd.rank.flight_recorder import MAX_BYTES

# An answer is refused whole, with the reason, when it is nested deeper than this (torch's own
# trace is 4 levels deep), has a number literal longer than MAX_NUMBER_CHARS (a sequence number
# fits in 19 digits; 1e400, NaN and Infinity are not numbers a label or a gauge can take), or a
# string the labels use that is not printable (a lone surrogate cannot even be encoded).
MAX_NESTING = 16
MAX_NUMBER_CHARS = 32
# A string token matches from its opening quote to its closing one or to the end of the text (an
# unterminated string is invalid JSON, which json.loads then refuses), so the scan never fails at a
# quote and never rescans: linear (256 KB of ``"`` + ``\"`` x N: about 1 ms; a pattern that must
# see the closing quote fails at every quote and rescans to the end, 32 KB took 2.9 s).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_PAIR = re.compile(rb"\[\]|\{\}")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def _nesting_within(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests at most ``limit`` deep, decided without recursion:
    strings removed, brackets kept, then ``limit`` passes that each remove the innermost pairs
    (linear passes in C; a 100,000-deep ``[[[`` costs the same as a flat file)."""
    s = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not s:
            return True
        s = _PAIR.sub(b"", s)
    return not s


def _number(text: str) -> int | float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(text) if any(c in text for c in ".eE") else int(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:MAX_NUMBER_CHARS]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def loads_answer(raw: bytes, max_bytes: int = MAX_BYTES) -> Any:
    """The JSON of an answer, bounded: ValueError naming what was refused (never RecursionError,
    OverflowError or a value no label or gauge can hold). The byte cap comes before any regex."""
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    if not _nesting_within(raw, MAX_NESTING):
        raise ValueError(f"nested deeper than {MAX_NESTING} levels")
    try:
        return json.loads(raw, parse_int=_number, parse_float=_number, parse_constant=_constant)
    except RecursionError:  # not reached after the check above; kept as the bound's backstop
        raise ValueError(f"nested deeper than {MAX_NESTING} levels") from None


def read_response(path: str, allowed_uids: Iterable[int]) -> Any:
    """The JSON of a response file under the rank directory's rules; OSError / ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not statmod.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ValueError("not a regular file with one link")
        if st.st_uid not in set(allowed_uids):
            raise ValueError(f"owned by uid {st.st_uid}, not root or the rank's user")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    return loads_answer(raw)


def write_request(path: str, nonce: str) -> None:
    """Atomically (a private temp file renamed over the name: a planted symlink is replaced,
    never followed)."""
    import tempfile  # here, not at the top: it imports shutil, bz2, lzma

    fd, tmp = tempfile.mkstemp(prefix=".gpuwatchd-frreq-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(nonce + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
