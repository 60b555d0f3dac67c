"""web/http1.py against http.server.BaseHTTPRequestHandler, which it replaces in the daemon (it
pulled in ssl and the email parser): the same bytes for the same request heads, odd and hostile
ones included (only Date is masked; http.server's ``Server: gpuwatchd `` ends in a space)."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.web.http1 import RequestHandler, escape_html

HEADS = [
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"GET /metrics HTTP/1.1\nHost: bare-lf\n\n",
    b"HEAD /metrics HTTP/1.1\r\n\r\n",
    b"GET /metrics\r\n\r\n",  # HTTP/0.9 form
    b"POST /metrics\r\n\r\n",
    b"GET / HTTP/2.0\r\n\r\n",
    b"GET / HTTP/1.1.1\r\n\r\n",
    b"GET / HTTP/01.1\r\n\r\n",
    b"GET / HTTP/1.99999999999\r\n\r\n",
    b"GET / FTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1 extra\r\n\r\n",
    b"BREW /pot HTTP/1.1\r\n\r\n",
    b"GET //evil.example/x HTTP/1.1\r\n\r\n",
    b"\r\n",
    b"GET / HTTP/1.1\r\nX-Folded: one\r\n two\r\n\tthree\r\nAccept: a\r\n\r\n",
    b"GET / HTTP/1.1\r\n continuation-first: x\r\nAccept: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nNo colon here\r\nAccept: after-garbage\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Name: x\r\nAccept: after\r\n\r\n",
    b"GET / HTTP/1.1\r\n: empty name\r\nAccept: a\r\n\r\n",
    b"GET / HTTP/1.1\r\naccept: lower\r\nACCEPT: upper\r\n\r\n",
    b"GET / HTTP/1.1\r\nAccept:   \t spaced \t \r\n\r\n",
    b"GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
    b"GET / HTTP/1.0\r\nExpect: 100-continue\r\n\r\n",
    b"GET / HTTP/1.1\r\nAccept: caf\xe9\r\n\r\n",
    b"GET /<script>&'\" HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(100)) + b"\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n",
    b"GET / HTTP/1.1\r\nLong: " + b"x" * 70000 + b"\r\n\r\n",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
]


# Heads whose answer from http.server of that version differs from 3.11's: on 3.10 its error page
# formats the status with str() of an IntEnum, "Error code explanation: HTTPStatus.BAD_REQUEST"
# (3.11 changed IntEnum's str() to the number); gpuwatchd's http1 writes the number on every version.
# On 3.13 http.server says "414 URI Too Long" (RFC 9110's phrase); http1 keeps "Request-URI Too Long".
KNOWN_DIFFERENCES: dict[tuple[int, int], set[int]] = {
    (3, 10): {7, 8, 9, 11, 12, 13, 14, 28, 29, 30, 31},
    (3, 13): {31},
}


class _Out(io.BytesIO):
    pass


def _answer(self: Any) -> None:
    body = "|".join(f"{k}={self.headers.get(k)!r}" for k in
                    ("Accept", "X-Folded", "Host", "Connection", "accept", "Missing"))
    body += f"|n={len(self.headers)}|path={self.path}|close={self.close_connection}"
    data = body.encode("utf-8", "backslashreplace")
    self.send_response(200)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    if self.command != "HEAD":
        self.wfile.write(data)


class Stdlib(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"
    server_version = "gpuwatchd"
    sys_version = ""

    def __init__(self, head: bytes) -> None:
        self.head = head
        super().__init__(None, ("127.0.0.1", 0), None)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.rfile = io.BytesIO(self.head)
        self.wfile = _Out()

    def handle(self) -> None:
        self.handle_one_request()

    def finish(self) -> None:
        pass

    def log_message(self, format: str, *args: Any) -> None:
        pass

    do_GET = do_HEAD = _answer


class Ours(RequestHandler):
    def __init__(self, head: bytes) -> None:
        self.head = head
        super().__init__(None, ("127.0.0.1", 0), None)

    def setup(self) -> None:
        self.rfile = io.BytesIO(self.head)
        self.wfile = _Out()

    do_GET = do_HEAD = _answer


def _norm(raw: bytes) -> bytes:
    raw = re.sub(rb"Date: [^\r]*\r\n", b"Date: -\r\n", raw)
    return raw.replace(b"Server: gpuwatchd \r\n", b"Server: gpuwatchd\r\n")


# http.server of Python 3.11.7, recorded (UPDATE_GOLDEN=1 on 3.11 rewrites it): the daemon answers
# alike on every interpreter it runs on, and http.server itself differs between versions (3.10
# accepts some versions and header lines that 3.11 refuses), so the recording is the reference.
GOLDEN = Path(__file__).parent / "fixtures" / "http1_answers_py311.json"


def _stdlib_answers() -> list[list[Any]]:
    return [[_norm(t.wfile.getvalue()).decode("latin-1"), t.close_connection]
            for t in (Stdlib(h) for h in HEADS)]


def _golden() -> list[list[Any]]:
    if os.environ.get("UPDATE_GOLDEN") and sys.version_info[:2] == (3, 11):
        GOLDEN.write_text(json.dumps(_stdlib_answers(), indent=1) + "\n")
    return list(json.loads(GOLDEN.read_text()))


@pytest.mark.parametrize("i", range(len(HEADS)))
def test_same_answer_as_http_server_of_3_11(i: int) -> None:
    ours = Ours(HEADS[i])
    answer, close = _golden()[i]
    assert _norm(ours.wfile.getvalue()).decode("latin-1") == answer
    assert ours.close_connection == close


def test_the_recording_is_what_http_server_answers_on_3_11_and_where_others_differ() -> None:
    """On 3.11 the live http.server gives the recording; on another version its answers differ
    exactly where that version's http.server is known to (so a drift of the recording shows)."""
    live = _stdlib_answers()
    differ = {i for i, (a, b) in enumerate(zip(live, _golden(), strict=True)) if a != b}
    assert differ == KNOWN_DIFFERENCES.get(sys.version_info[:2], set()), sorted(differ)


def test_escape_html_is_html_escape() -> None:
    import html

    for s in ("<a href='x'>&amp;\"</a>", "", "plain"):
        assert escape_html(s) == html.escape(s)
        assert escape_html(s, quote=False) == html.escape(s, quote=False)
