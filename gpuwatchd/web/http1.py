"""HTTP/1.x request heads and response heads: the part of ``http.server.BaseHTTPRequestHandler``
that ``web/handler.py`` uses, with its behaviour, without importing ``http.server``.

``http.server`` imports ``http.client``, which imports ssl (libssl, libcrypto) and the email
parser: about 5 MiB of the daemon's resident memory for a server that speaks plain HTTP unless
TLS is configured (bench/rss.py). ``RequestHandler`` parses one buffered head the way
BaseHTTPRequestHandler does (request line and version checks, 400/414/431/501/505 answers, the
``Connection`` and ``Expect: 100-continue`` headers) and reads the headers the way
``http.client.parse_headers`` and the email parser's compat32 policy do: at most
``MAX_LINE`` bytes a line and ``MAX_HEADER_LINES`` lines, folded continuation lines joined, and
the first line that is not a header ends them. tests/test_web*.py exercise it over sockets.
Cost: one pass over the head (at most ``Limits.max_head_bytes``).
"""

from __future__ import annotations

import io
import time
from http import HTTPStatus
from typing import Any

MAX_LINE = 65536  # http.client._MAXLINE
MAX_HEADER_LINES = 100  # http.client._MAXHEADERS
RESPONSES = {s.value: (s.phrase, s.description) for s in HTTPStatus}
# The same reason phrases on every interpreter: 3.13 renamed these (RFC 9110), 3.10-3.12 say
# these, and an answer should not change with the Python the daemon runs on.
for _code, _phrase in ((413, "Request Entity Too Large"), (414, "Request-URI Too Long"),
                       (416, "Requested Range Not Satisfiable"), (422, "Unprocessable Entity")):
    RESPONSES[_code] = (_phrase, RESPONSES[_code][1])
ERROR_PAGE = """<!DOCTYPE HTML>
<html lang="en">
    <head>
        <meta charset="utf-8">
        <title>Error response</title>
    </head>
    <body>
        <h1>Error response</h1>
        <p>Error code: %(code)d</p>
        <p>Message: %(message)s.</p>
        <p>Error code explanation: %(code)s - %(explain)s.</p>
    </body>
</html>
"""
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
# A header line's name: printable ASCII but ':' (the email parser's headerRE), then ':'.
_NAME_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {":"}


def escape_html(s: str, quote: bool = True) -> str:
    """``html.escape`` (the html package's import builds a 2,000-entry entity table)."""
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace('"', "&quot;").replace("'", "&#x27;") if quote else s


class HeadError(Exception):
    def __init__(self, what: str, explain: str) -> None:
        super().__init__(what)
        self.what = what
        self.explain = explain  # http.client's exception text, the error page's explanation


class Headers:
    """The request's header lines: ``get`` is case-insensitive and returns the first."""

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items

    def get(self, name: str, default: str | None = None) -> Any:
        lname = name.lower()
        return next((v for k, v in self._items if k.lower() == lname), default)

    def __len__(self) -> int:
        return len(self._items)


def read_headers(rfile: io.BytesIO) -> Headers:
    """``http.client.parse_headers``: raises HeadError (a line too long, too many lines)."""
    lines: list[str] = []
    while True:
        raw = rfile.readline(MAX_LINE + 1)
        if len(raw) > MAX_LINE:
            raise HeadError("Line too long", f"got more than {MAX_LINE} bytes when reading header line")
        lines.append(raw.decode("iso-8859-1"))
        if len(lines) > MAX_HEADER_LINES:  # the empty line that ends them counts, as there
            raise HeadError("Too many headers", f"got more than {MAX_HEADER_LINES} headers")
        if raw in (b"\r\n", b"\n", b""):
            lines.pop()
            break
    items: list[tuple[str, list[str]]] = []
    for line in lines:
        if line[:1] in (" ", "\t"):
            if items:
                items[-1][1].append(line)  # a folded continuation line
            continue
        name, colon, _ = line.partition(":")
        if not colon or not set(name) <= _NAME_CHARS:
            break  # not a header: the email parser takes it for the start of the body
        if name:  # (an empty name is a defect the email parser skips)
            items.append((name, [line]))
    out = []
    for name, parts in items:
        value = parts[0].split(":", 1)[1].lstrip(" \t") + "".join(parts[1:])
        out.append((name, value.rstrip("\r\n")))
    return Headers(out)


def http_date(t: float | None = None) -> str:
    """``email.utils.formatdate(t, usegmt=True)``."""
    g = time.gmtime(t)
    return (f"{_DAYS[g.tm_wday]}, {g.tm_mday:02d} {_MONTHS[g.tm_mon - 1]} {g.tm_year:04d} "
            f"{g.tm_hour:02d}:{g.tm_min:02d}:{g.tm_sec:02d} GMT")


class RequestHandler:
    """Subclasses set ``rfile`` and ``wfile`` in ``setup`` and define ``do_GET`` etc."""

    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"
    server_version = "gpuwatchd"
    error_content_type = "text/html;charset=utf-8"
    rfile: io.BytesIO
    wfile: Any
    raw_requestline: bytes

    def __init__(self, request: Any, client_address: tuple[str, int], server: Any) -> None:
        self.request = request
        self.client_address = client_address
        self.server = server
        self.command = ""
        self.path = ""
        self.requestline = ""
        self.request_version = self.default_request_version
        self.close_connection = True
        self.headers = Headers([])
        self._head: list[bytes] = []
        self.setup()
        try:
            self.handle()
        finally:
            self.finish()

    def setup(self) -> None: ...

    def handle(self) -> None:
        self.handle_one_request()

    def finish(self) -> None: ...

    def handle_one_request(self) -> None:
        self.raw_requestline = self.rfile.readline(MAX_LINE + 1)
        if len(self.raw_requestline) > MAX_LINE:
            self.requestline = self.request_version = self.command = ""
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            return
        if not self.raw_requestline:
            self.close_connection = True
            return
        if not self.parse_request():
            return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            return
        method()

    def parse_request(self) -> bool:
        """BaseHTTPRequestHandler.parse_request; False when an error has been answered."""
        self.command = ""
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            try:
                if not version.startswith("HTTP/"):
                    raise ValueError
                base = version.split("/", 1)[1]
                parts = base.split(".")
                if len(parts) != 2 or not all(p.isdigit() and len(p) <= 10 for p in parts):
                    raise ValueError
                number = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})")
                return False
            if number >= (1, 1):
                self.close_connection = False
            if number >= (2, 0):
                self.send_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                                f"Invalid HTTP version ({base})")
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad HTTP/0.9 request type ({command!r})")
                return False
        self.command, self.path = command, path
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        try:
            self.headers = read_headers(self.rfile)
        except HeadError as e:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, e.what, e.explain)
            return False
        conntype = (self.headers.get("Connection") or "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive":
            self.close_connection = False
        expect = (self.headers.get("Expect") or "").lower()
        if expect == "100-continue" and self.request_version >= "HTTP/1.1":
            self.send_response_only(HTTPStatus.CONTINUE)
            self.end_headers()
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        short, long = RESPONSES.get(code, ("???", "???"))
        message = short if message is None else message
        explain = long if explain is None else explain
        self.log_error("code %d, message %s", code, message)
        self.send_response(code, message)
        self.send_header("Connection", "close")
        body = b""
        if code >= 200 and code not in (204, 205, 304):
            body = (ERROR_PAGE % {"code": int(code), "message": escape_html(message, quote=False),
                                  "explain": escape_html(explain, quote=False)}).encode("utf-8", "replace")
            self.send_header("Content-Type", self.error_content_type)
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def send_response(self, code: int, message: str | None = None) -> None:
        self.log_message('"%s" %s %s', self.requestline, str(int(code)), "-")
        self.send_response_only(code, message)
        self.send_header("Server", self.server_version)
        self.send_header("Date", http_date())

    def send_response_only(self, code: int, message: str | None = None) -> None:
        if message is None:
            message = RESPONSES.get(code, ("",))[0]
        self._head.append(f"{self.protocol_version} {int(code)} {message}\r\n".encode("latin-1"))

    def send_header(self, keyword: str, value: str) -> None:
        self._head.append(f"{keyword}: {value}\r\n".encode("latin-1"))
        if keyword.lower() == "connection":
            if value.lower() == "close":
                self.close_connection = True
            elif value.lower() == "keep-alive":
                self.close_connection = False

    def end_headers(self) -> None:
        self._head.append(b"\r\n")
        self.wfile.write(b"".join(self._head))
        self._head = []

    def log_message(self, format: str, *args: Any) -> None: ...

    def log_error(self, format: str, *args: Any) -> None:
        self.log_message(format, *args)
