"""One rule for showing strings that come from users' ranks (stack frames, file names, job
errors, comm) to a person: ``printable`` escapes every character a terminal or a log reader would
act on, the way ``systemctl`` and ``ls -b`` do (``\\x1b`` for ESC), so a rank cannot set a window
title, move the cursor, or forge lines in ``gpuwatchd ps``/``doctor``/``events`` or in what the
prolog passes to ``logger``.

Escaped: C0 controls (including TAB, CR, LF), DEL, C1 controls, the other characters Python does
not call printable (format characters such as the bidi overrides U+202E, line and paragraph
separators, lone surrogates from undecodable bytes) and the backslash itself (so that an escape
in the output always means an escape). Pure; cost linear in the string, nothing for the common
all-printable case. No CLI equivalent: ``ls -b`` / ``systemd-escape`` do the same for theirs.
"""

from __future__ import annotations

from typing import Any


def _escape_char(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    if ch == " " or ch.isprintable():
        return ch
    n = ord(ch)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(text: Any) -> str:
    """``text`` (made a str) with every non-printable character and the backslash escaped."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(_escape_char(ch) for ch in s)


def printable_tree(obj: Any) -> Any:
    """``obj`` (decoded JSON: dicts, lists, strings, numbers) with every string ``printable``:
    what the text renderers of ``ps`` and ``doctor`` compose their lines from."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {printable(k) if isinstance(k, str) else k: printable_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [printable_tree(v) for v in obj]
    return obj
