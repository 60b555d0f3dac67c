"""Pins of runtime dependencies that carry a security fix: the lowest version pyproject.toml admits
must have it, and the installed one must behave as fixed.

h11 before 0.16 (CVE-2025-43859) took any two bytes as the CRLF ending a chunk, so a chunked
body on a keep-alive connection could be framed as a second request behind a proxy that reads it
otherwise (request smuggling). With 0.14 the daemon answered the advisory's payload twice; 0.16
refuses it: 400, then close.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from gpuwatchd.exporter.families import GaugeMetricFamily, Registry
from gpuwatchd.web import server as web

REPO = Path(__file__).resolve().parent.parent
FIXED = {"h11": (0, 16)}  # the first release with the fix, per advisory

# The advisory's (GHSA-vqfr-h8mv-ghfj) payload: chunk "AAAAA" ended by "XX" instead of CRLF, so
# that "2\r\n45\r\n0\r\n\r\n" and the next request are framed differently by the two parsers.
SMUGGLE = (
    b"GET /one HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nAAAAAXX2\r\n45\r\n0\r\n\r\n"
    b"GET /two HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
)


def _lowest_admitted(name: str) -> tuple[int, ...]:
    # the dependencies array's line (tomllib is Python 3.11+)
    m = re.search(rf'^\s*"{name}\s*>=\s*([0-9.]+)', (REPO / "pyproject.toml").read_text(), re.M)
    assert m, f"pyproject.toml: no lower bound for {name}"
    return tuple(int(p) for p in m.group(1).split("."))


@pytest.mark.parametrize("name", sorted(FIXED))
def test_the_lowest_admitted_version_has_the_fix(name: str) -> None:
    assert _lowest_admitted(name) >= FIXED[name]
    installed = tuple(int(p) for p in re.findall(r"\d+", version(name))[:2])
    assert installed >= FIXED[name], version(name)


class _One:
    def collect(self) -> list:
        return [GaugeMetricFamily("gpuwatch_up", "Up.", value=1.0)]


@pytest.fixture()
def server() -> Iterator[web.WebServer]:
    reg = Registry()
    reg.register(_One())
    ws = web.serve(reg, "127.0.0.1:0", None, web.Limits(request_timeout=0.5))
    yield ws
    ws.close()


def test_the_chunk_ending_payload_is_refused_not_answered_twice(server: web.WebServer) -> None:
    with socket.create_connection(server.address, timeout=3) as s:
        s.sendall(SMUGGLE)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    statuses = re.findall(rb"^HTTP/1\.1 (\d{3})", got, re.M)
    assert statuses == [b"400"], got[:400]
