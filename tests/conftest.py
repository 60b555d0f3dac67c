"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test starts; each is killed (continued first, if a test stopped it) and
    reaped afterwards, whatever the test's outcome."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait(timeout=10)
