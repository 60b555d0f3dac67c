"""``gpuwatchd web-config hash`` answers every password it cannot hash with a sentence and exit
status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bcrypt

REPO = Path(__file__).resolve().parent.parent


def _hash(stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "web-config", "hash", "--cost", "4"],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )


def test_a_password_that_is_not_utf8_is_refused_without_a_traceback() -> None:
    out = _hash(b"p\xff\xfeq\n")
    assert out.returncode == 2 and b"Traceback" not in out.stderr, out.stderr
    assert b"not UTF-8" in out.stderr


def test_a_utf8_password_is_hashed_as_its_utf8_bytes() -> None:
    out = _hash("pässwörd\n".encode())
    assert out.returncode == 0, out.stderr
    assert bcrypt.checkpw("pässwörd".encode(), out.stdout.strip())
