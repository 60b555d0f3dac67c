"""Reading one HTTP/1.1 request off a connection's bytes with h11 (RFC 9110/9112, sans-IO), plus
the refusals h11 leaves to its caller, and writing the answer through the same h11 connection.

The listener (web/listener.py) finds the end of a request head itself, so that a head over
``Limits.max_head_bytes`` is refused with 431 however it arrives (h11's own limit only counts
an *incomplete* head), then ``begin`` gives exactly that head to a fresh ``h11.Connection``:
every ambiguity is refused with a status and the connection closed, never guessed at:

- whatever h11 refuses (a malformed request line or header line, NUL, a bare CR or a control
  byte, a space before the colon, an empty name, ``HTTP/1.10``, ``Content-Length: +5``, two
  different ``Content-Length``, HTTP/1.1 with no Host or with two, an unknown transfer coding
  (501, RFC 9112 §6.1), HTTP/0.9), with its ``error_status_hint``;
- and what h11 accepts but a keep-alive server behind a proxy must not (RFC 9112 §5.2, §6.1,
  §6.3): an obs-fold continuation line, ``Content-Length`` given twice or as a list even with
  equal values (h11 folds those into one), ``Content-Length`` together with
  ``Transfer-Encoding`` (400), an HTTP version other than 1.0 or 1.1 (505), more than
  ``MAX_HEADERS`` header lines (431).

A request body is framed by h11 (Content-Length or chunked) and read and discarded
(``drain``), at most ``MAX_BODY_BYTES`` of it in at most ``MAX_BODY_CHUNKS`` pieces (413 beyond),
so a body is never taken for the next request and costs the loop thread a bounded number of h11
events. One ``h11.Connection`` per request: what follows a request's end is handed back to the
listener's buffer (``h11.Connection.trailing_data``), which frames the next head the same way.
Keep-alive is h11's decision (HTTP/1.0 and ``Connection: close`` close, and a request whose
body was not read closes). Cost: one pass of h11's regexes over a head (at most 32 KiB), one
``h11.Connection`` (a few hundred bytes) per request. Privilege: none. Shell equivalent:
``printf 'GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' | nc 127.0.0.1 9958``.
"""

from __future__ import annotations

import re
import time
from http import HTTPStatus

import h11

MAX_BODY_BYTES = 65536  # of a request body read and discarded; more is 413 and close
# Pieces of a body h11 frames (a chunk of a chunked body, or what one read brought of a
# Content-Length body): each costs an event on the listener's loop thread, so a body sent as
# one-byte chunks is 413 and close after this many (a client never needs a body to scrape;
# the bodies h11 agreement is tested on have one or two).
MAX_BODY_CHUNKS = 16
MAX_HEADERS = 64  # header lines of a request; more is 431 and close
_FOLD = re.compile(rb"\n[ \t]")  # a header line that continues the previous one (obs-fold)
# Content-Length lines as sent: h11 folds equal duplicates and "5, 5" lists into one value.
_LENGTHS = re.compile(rb"\ncontent-length:[ \t]*([^\r\n]*?)[ \t]*\r?$", re.I | re.M)
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


class Refused(Exception):
    """The request cannot be answered as sent: answer ``status`` and close."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


def begin(head: bytes) -> tuple[h11.Connection, h11.Request]:
    """Parse one complete head (request line to the empty line); raises Refused."""
    if _FOLD.search(head):
        raise Refused(400, "obsolete line folding")
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=len(head) + 1)
    parser.receive_data(head)
    try:
        event = parser.next_event()
    except h11.RemoteProtocolError as e:
        raise Refused(e.error_status_hint, str(e)) from None
    if not isinstance(event, h11.Request):  # cannot happen on a complete head
        raise Refused(400, "no request line")
    names = [name for name, _ in event.headers]
    if len(names) > MAX_HEADERS:
        raise Refused(431, f"more than {MAX_HEADERS} header lines")
    lengths = _LENGTHS.findall(head)
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        raise Refused(400, "Content-Length given more than once")
    if b"content-length" in names and b"transfer-encoding" in names:
        raise Refused(400, "Content-Length together with Transfer-Encoding")
    if event.http_version not in (b"1.0", b"1.1"):
        raise Refused(505, f"HTTP/{event.http_version.decode()} is not served")
    return parser, event


def drain(
    parser: h11.Connection,
    buf: bytearray,
    seen: int,
    pieces: int = 0,
) -> tuple[bool, int, int]:
    """Read the request's body out of ``buf`` (consumed) and discard it: (whether the request has
    ended, body bytes seen so far, body pieces framed so far). Bytes past its end are put back
    into ``buf``. Raises Refused (a malformed chunk, a body over MAX_BODY_BYTES or in more than
    MAX_BODY_CHUNKS pieces)."""
    fed = False
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError as e:
            raise Refused(e.error_status_hint, str(e)) from None
        if event is h11.NEED_DATA:
            if fed or not buf:
                return False, seen, pieces
            parser.receive_data(bytes(buf))
            buf.clear()
            fed = True
            continue
        if isinstance(event, h11.Data):
            seen += len(event.data)
            pieces += 1
            if seen > MAX_BODY_BYTES:
                raise Refused(413, f"request body over {MAX_BODY_BYTES} bytes")
            if pieces > MAX_BODY_CHUNKS:
                raise Refused(413, f"request body in more than {MAX_BODY_CHUNKS} pieces")
            continue
        if isinstance(event, h11.EndOfMessage):
            if fed:
                buf += parser.trailing_data[0]
            return True, seen, pieces
        raise Refused(400, f"unexpected {type(event).__name__}")


def http_date(t: float | None = None) -> str:
    """``email.utils.formatdate(t, usegmt=True)`` (the email package is not loaded for this)."""
    g = time.gmtime(t)
    return (
        f"{_DAYS[g.tm_wday]}, {g.tm_mday:02d} {_MONTHS[g.tm_mon - 1]} {g.tm_year:04d} "
        f"{g.tm_hour:02d}:{g.tm_min:02d}:{g.tm_sec:02d} GMT"
    )


def refusal(status: int) -> bytes:
    """The whole answer to a refused request (the connection closes after it)."""
    reason = REASONS.get(status, b"Error")
    body = reason + b"\n"
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )


def respond(
    parser: h11.Connection, head_only: bool, status: int, headers: list[tuple[str, str]], body: bytes, out: list[bytes]
) -> bool:
    """Write the response into ``out`` through ``parser`` (h11 writes the status line, checks the
    headers and adds ``Connection: close`` where the request asked for it); the body is passed
    through, not copied. True when the connection may serve another request."""
    sent: list[tuple[str, str]] = [
        ("Server", "gpuwatchd"),
        ("Date", http_date()),
        ("Content-Length", str(len(body))),
        *headers,
    ]
    pieces = parser.send_with_data_passthrough(
        h11.Response(status_code=status, headers=sent, reason=REASONS.get(status, b""))
    )
    out.extend(pieces or ())
    if body and not head_only:
        out.extend(parser.send_with_data_passthrough(h11.Data(data=body)) or ())
    out.extend(parser.send_with_data_passthrough(h11.EndOfMessage()) or ())
    return parser.our_state is h11.DONE and parser.their_state is h11.DONE
