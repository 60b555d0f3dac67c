"""The /metrics server's request parsing (web/request.py, h11 inside web/listener.py) against two
maintained parsers, h11 and httptools (llhttp, Node's parser), over a real loopback socket.

The oracle is the parsers, not a recording: for every head of the corpus (the malformed heads of
shared/research/dependencies-review.md §2.4, RFC 9112's ambiguities and the request-smuggling
shapes) and for hypothesis-generated heads, the server answers 200 and keeps the connection only
if h11 accepts the head, and refuses it (a 4xx/5xx, then close) whenever h11 refuses it or one of
the checks the server adds on top of h11 (``STRICTER``) applies; a head both parsers refuse is
never answered 200. A request body is read and discarded: one request, one answer.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import h11
import httptools
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuwatchd.exporter.families import GaugeMetricFamily, Registry
from gpuwatchd.web import server as web
from gpuwatchd.web.request import MAX_BODY_BYTES

OK = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


class _One:
    def collect(self) -> list:
        return [GaugeMetricFamily("gpuwatch_up", "Up.", value=1.0)]


@pytest.fixture(scope="module")
def server() -> Iterator[web.WebServer]:
    reg = Registry()
    reg.register(_One())
    ws = web.serve(reg, "127.0.0.1:0", None, web.Limits(request_timeout=0.5))
    yield ws
    ws.close()


def _read_response(sock: socket.socket, buf: bytearray, to_head: bool = False) -> tuple[int, bytes] | None:
    """One response off ``sock`` (``buf``: bytes read past the last one); None when it closed.
    ``to_head``: the answer to a HEAD request, whose Content-Length is the GET's and which has no
    body (RFC 9110 9.3.2)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    m = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
    length = int(m.group(1)) if m and not to_head else 0
    while len(buf) < end + length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    body = bytes(buf[end : end + length])
    del buf[: end + length]
    return int(head.split(b" ", 2)[1]), body


def _exchange(ws: web.WebServer, data: bytes, then: bytes = b"") -> tuple[list[int], bool]:
    """Send ``data`` (one write), then ``then`` after the first answer; (statuses, closed)."""
    with socket.create_connection(ws.address, timeout=3) as s:
        s.sendall(data)
        buf = bytearray()
        statuses: list[int] = []
        sent_then = False
        try:
            while True:
                s.settimeout(0.5 if statuses else 3)
                got = _read_response(s, buf, to_head=not statuses and data.startswith(b"HEAD "))
                if got is None:
                    return statuses, True
                statuses.append(got[0])
                if then and not sent_then:
                    s.sendall(then)
                    sent_then = True
        except TimeoutError:
            return statuses, False
        except ConnectionResetError:
            return statuses, True


INCOMPLETE = 0  # h11 waits for more of the request: the server answers nothing, then closes


def h11_verdict(head: bytes) -> int | None:
    """None when h11 accepts the complete request (head and body), INCOMPLETE when it needs more
    bytes, else its status hint."""
    c = h11.Connection(h11.SERVER)
    c.receive_data(head)
    try:
        while True:
            ev = c.next_event()
            if isinstance(ev, h11.EndOfMessage):
                return None
            if ev is h11.NEED_DATA:
                return INCOMPLETE
    except h11.RemoteProtocolError as e:
        return e.error_status_hint


def h11_trailing(head: bytes) -> bytes:
    """What follows the first complete request, as h11 frames it: the next request's bytes."""
    c = h11.Connection(h11.SERVER)
    c.receive_data(head)
    while not isinstance(c.next_event(), h11.EndOfMessage):
        pass
    return c.trailing_data[0]


def httptools_accepts(head: bytes) -> bool:
    done: list[bool] = []

    class P:
        def on_message_complete(self) -> None:
            done.append(True)

    try:
        httptools.HttpRequestParser(P()).feed_data(head)
    except httptools.HttpParserError:
        return False
    return bool(done)


def stricter(head: bytes) -> bool:
    """The refusals web/request.py adds to h11's (RFC 9112 §5.2 obs-fold, §6.3 Content-Length
    twice, as a list or with Transfer-Encoding, a version other than 1.0/1.1, more than 64
    headers): h11 accepts these (it folds equal Content-Length values into one)."""
    if re.search(rb"\n[ \t]", head):
        return True
    raw_lengths = re.findall(rb"\ncontent-length:[ \t]*([^\r\n]*?)[ \t]*\r?$", head, re.I | re.M)
    if len(raw_lengths) > 1 or (raw_lengths and not raw_lengths[0].isdigit()):
        return True
    c = h11.Connection(h11.SERVER)
    c.receive_data(head)
    try:
        ev = c.next_event()
    except h11.RemoteProtocolError:
        return False
    if not isinstance(ev, h11.Request):
        return False
    names = [n for n, _ in ev.headers]
    return (
        len(names) > 64
        or (b"content-length" in names and b"transfer-encoding" in names)
        or ev.http_version not in (b"1.0", b"1.1")
    )


# (head, what the hand-written parser of 63318c5 answered): dependencies-review.md §2.4.
CORPUS = [
    (OK, "200 keep"),
    (b"GET /metrics HTTP/1.1\nHost: x\n\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: one\r\n two\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\nhello", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", "200 keep"),
    (
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "200 keep",
    ),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\nhello", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX\x01A: b\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\n: empty\r\n\r\n", "200 keep"),
    (b"GET  /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "200 keep"),
    (b"GET /metrics http/1.1\r\nHost: x\r\n\r\n", "400 close"),
    (b"GET /metrics HTTP/1.10\r\nHost: x\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", "505 close"),
    (b"GET /metrics\r\n\r\n", "200 close"),
    (b"GET http://x/metrics HTTP/1.1\r\nHost: x\r\n\r\n", "200 keep"),
    (b"G@T /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "501 close"),
    (b"GET /metrics\xe9 HTTP/1.1\r\nHost: x\r\n\r\n", "404 keep"),
    (b"GET /me trics HTTP/1.1\r\nHost: x\r\n\r\n", "400 close"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n", "200 keep"),
    (b"GET /metrics HTTP/1.0\r\n\r\n", "200 close"),
]


@pytest.mark.parametrize(("head", "before"), CORPUS, ids=[repr(h[:60]) for h, _ in CORPUS])
def test_malformed_heads_are_answered_as_h11_reads_them(server: web.WebServer, head: bytes, before: str) -> None:
    statuses, closed = _exchange(server, head, then=OK)
    verdict = h11_verdict(head)
    refused = verdict is not None or stricter(head)
    print(
        f"| {head[:60]!r} | {before} | {statuses[0] if statuses else '-'} "
        f"{'close' if closed else 'keep'} | {'accept' if verdict is None else verdict} | "
        f"{'accept' if httptools_accepts(head) else 'reject'} |"
    )
    if refused:
        assert len(statuses) == 1 and statuses[0] >= 400 and closed, (statuses, closed)
        if verdict is not None and not stricter(head):
            assert statuses[0] == verdict
    else:
        keep = b"HTTP/1.0" not in head.split(b"\n", 1)[0]
        assert statuses[0] == 200
        if keep:  # kept open: the next request on it is answered too
            assert statuses == [200, 200] and not closed
        else:
            assert closed
    if not httptools_accepts(head) and verdict is not None:
        assert statuses[0] != 200


def test_a_get_with_a_body_that_is_a_request_gets_one_answer(server: web.WebServer) -> None:
    """The smuggling shape (CWE-444): the body is read and discarded, never answered."""
    inner = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(inner)
    statuses, closed = _exchange(server, head + inner)
    assert statuses == [200] and not closed
    chunked = b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(inner),
        inner,
    )
    statuses, closed = _exchange(server, chunked)
    assert statuses == [200] and not closed
    # ... and the connection goes on with the next real request.
    assert _exchange(server, head + inner + OK) == ([200, 200], False)


def test_a_body_over_the_bound_is_413_and_close(server: web.WebServer) -> None:
    big = MAX_BODY_BYTES + 1
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big
    assert _exchange(server, head + b"x" * big) == ([413], True)
    chunked = b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (
        big,
        b"x" * big,
    )
    assert _exchange(server, chunked) == ([413], True)


def test_a_head_over_32_kib_in_one_write_is_431(server: web.WebServer) -> None:
    """N14: the limit holds whether the head trickles in or arrives in one write (33-49 KB)."""
    for size in (33_000, 40_000, 49_000):
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * size + b"\r\n\r\n"
        assert _exchange(server, head) == ([431], True)
    just = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 32_000 + b"\r\n\r\n"
    assert _exchange(server, just) == ([200], False)


def test_three_pipelined_requests_then_a_half_close_get_three_answers(server: web.WebServer) -> None:
    """As http.server answers them: the client's FIN after its requests ends the connection only
    once every request that arrived complete is answered."""
    with socket.create_connection(server.address, timeout=3) as s:
        s.sendall(OK * 3)
        s.shutdown(socket.SHUT_WR)
        buf = bytearray()
        statuses = []
        while (got := _read_response(s, buf)) is not None:
            statuses.append(got[0])
    assert statuses == [200, 200, 200]


def test_keep_alive_follows_the_request(server: web.WebServer) -> None:
    assert _exchange(server, OK, then=OK) == ([200, 200], False)
    assert _exchange(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == ([200], True)
    assert _exchange(server, b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n") == (
        [200],
        True,
    )  # h11 speaks no HTTP/1.0 keep-alive: one answer, then close


# --- generated heads ---------------------------------------------------------------------------

_TOKEN = st.sampled_from(
    [
        b"Host",
        b"Content-Length",
        b"Transfer-Encoding",
        b"Connection",
        b"Accept",
        b"X-A",
        b"Host ",
        b" Host",
        b"",
        b"X\x00",
        b"X\x7f",
        b"X@",
    ]
)
_VALUE = st.sampled_from(
    [
        b"x",
        b"0",
        b"5",
        b"+5",
        b"-1",
        b"chunked",
        b"gzip",
        b"close",
        b"keep-alive",
        b"a\x00b",
        b"a\rb",
        b"\xe9",
        b"",
        b" x ",
        b"5, 5",
        b"chunked, chunked",
        b"1x",
    ]
)
_LINE_END = st.sampled_from([b"\r\n", b"\n"])
_REQUEST_LINE = st.sampled_from(
    [
        b"GET /metrics HTTP/1.1",
        b"GET /metrics HTTP/1.0",
        b"HEAD /metrics HTTP/1.1",
        b"GET /metrics HTTP/1.10",
        b"GET /metrics HTTP/2.0",
        b"GET  /metrics HTTP/1.1",
        b"GET /metrics",
        b"get /metrics HTTP/1.1",
        b"GET /m\xe9 HTTP/1.1",
        b"GET http://x/metrics HTTP/1.1",
        b"GET /metrics HTTP/1.1 x",
        b"G@T /metrics HTTP/1.1",
    ]
)


@st.composite
def _heads(draw: st.DrawFn) -> bytes:
    end = draw(_LINE_END)
    lines = [draw(_REQUEST_LINE)]
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(b" folded")  # obs-fold
        else:
            lines.append(draw(_TOKEN) + b":" + draw(st.sampled_from([b" ", b"", b"\t"])) + draw(_VALUE))
    body = draw(st.sampled_from([b"", b"hello", b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n"]))
    return end.join(lines) + end + end + body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_heads())
@example(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # no body after its head (read 3 s for one)
@example(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n0\r\n\r\n")  # the next answer is not its body
def test_generated_heads_agree_with_h11(server: web.WebServer, head: bytes) -> None:
    statuses, closed = _exchange(server, head)
    verdict = h11_verdict(head)
    if verdict == INCOMPLETE and not stricter(head):
        assert statuses == [] and closed, (head, statuses)  # closed at its request_timeout
    elif verdict is not None or stricter(head):
        assert statuses and statuses[0] >= 400 and closed, (head, statuses, closed)
    else:
        # h11 read a complete request and the server added no refusal: it answers it (methods
        # are case-sensitive: only GET and HEAD are served), and a body after it is never taken
        # for a second request.
        served = head.split(b" ", 1)[0] in (b"GET", b"HEAD")
        assert statuses[:1] == [200 if served else 501], (head, statuses)
        # More answers only where h11 too frames bytes after the request (a next request).
        assert len(statuses) == 1 or (served and h11_trailing(head)), (head, statuses)
    if verdict is not None and not httptools_accepts(head):
        assert 200 not in statuses


def test_expect_100_continue_is_answered_without_waiting_for_the_body(server: web.WebServer) -> None:
    no_body = b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n"
    assert _exchange(server, no_body, then=OK) == ([200, 200], False)
    body_unsent = b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    assert _exchange(server, body_unsent) == ([200], True)  # answered; the unread body closes it
