"""Answering one request of the ``/metrics`` server: parsing, auth, rate limit, the exposition.

``_Site`` is what a listener's worker threads answer from (registry, web-config, the bcrypt cache,
the token buckets); ``_Handler`` parses one buffered request (``Conn.head``, at most
``MAX_HEADERS`` headers and ``MAX_QUERY_PARAMETERS`` parameters) and writes its response into
``Conn.out``. No socket I/O here: ``web/listener.py`` moves the bytes, ``web/server.py`` serves.
Cost: a scrape costs what the registry's collectors cost; a bcrypt check (~70 ms at cost 10) is
cached per (user, password) after the first success.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from gpuwatchd.exporter.families import Collector, Metric
from gpuwatchd.exporter.formats import negotiate
from gpuwatchd.isolation import guarded
from gpuwatchd.web.config import (
    ConfigHolder,
    RateLimit,
    WebConfig,
)
from gpuwatchd.web.http1 import RequestHandler, escape_html
from gpuwatchd.web.listener import (
    MAX_REQUEST_LINE,
    Conn,
    Writer,
)

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("gpuwatchd.web.server")  # the log texts keep their logger

MAX_HEADERS = 64
MAX_QUERY_PARAMETERS = 64


class _AuthCache:
    """Remembers (user, password, hash) triples that passed bcrypt, bounded in size."""

    def __init__(self, size: int = 256) -> None:
        self._ok: dict[bytes, None] = {}
        self._size = size
        self._lock = threading.Lock()

    def check(self, users: Mapping[str, bytes], user: str, password: bytes) -> bool:
        # Here, not at the top: only a web-config with basic_auth_users needs them (bcrypt's
        # library; hashlib loads libcrypto).
        import hashlib

        import bcrypt

        hashed = users.get(user)
        if hashed is None:
            # Check against a configured user's hash anyway: an unknown user name costs the same
            # time as a wrong password, so timing does not reveal which users exist.
            with contextlib.suppress(ValueError):
                bcrypt.checkpw(password, next(iter(users.values())))
            return False
        key = hashlib.sha256(user.encode() + b"\0" + password + b"\0" + hashed).digest()
        with self._lock:
            if key in self._ok:
                return True
        try:
            ok = bcrypt.checkpw(password, hashed)
        except ValueError:
            return False
        if ok:
            with self._lock:
                if len(self._ok) >= self._size:
                    self._ok.pop(next(iter(self._ok)))
                self._ok[key] = None
        return ok


class _TokenBucket:
    def __init__(self, rate: RateLimit) -> None:
        self.rate = rate
        self.tokens = float(rate.burst)
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(float(self.rate.burst),
                              self.tokens + (now - self.last) / self.rate.interval_seconds)
            self.last = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return True
            return False


LANDING_PAGE = """<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>gpuwatchd</title></head>
<body>
<h1>gpuwatchd</h1>
<p>Per-node monitor of GPU training jobs: ranks, GPU memory, OOM kills, GIL, stalls.</p>
<ul><li><a href="metrics">Metrics</a></li></ul>
</body>
</html>
"""


class _Handler(RequestHandler):
    """Answers one request whose head the listener has read already (``conn.head``), into
    ``conn.out``, which the listener sends: no socket operation happens here."""

    protocol_version = "HTTP/1.1"
    # Answer garbage with a status line; HTTP/0.9 (no status line, no headers) has no clients.
    default_request_version = "HTTP/1.0"
    server_version = "gpuwatchd"
    sys_version = ""
    server: _Site
    raw_requestline: bytes

    def __init__(self, conn: Conn, site: _Site) -> None:
        self.conn = conn
        super().__init__(conn.sock, (conn.addr, 0), site)

    def setup(self) -> None:
        self.connection = self.conn.sock
        self.rfile = io.BytesIO(self.conn.head)
        self.wfile = Writer(self.conn.out)

    def handle(self) -> None:
        self.handle_one_request()

    def finish(self) -> None:
        """The listener keeps or closes the connection."""

    def parse_request(self) -> bool:
        # Checked after RequestHandler.parse_request: send_error needs the attributes it
        # sets (requestline, command, request_version), else AttributeError, no reply.
        ok = super().parse_request()
        if ok and len(self.raw_requestline) > MAX_REQUEST_LINE:
            self.close_connection = True
            self.send_error(414)
            return False
        if ok and len(self.headers) > MAX_HEADERS:
            self.send_error(431)
            return False
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        # Never at info: request lines come from the network and are not ours to spread.
        log.debug("%s %s", self.client_address[0], format % args)

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.client_address[0], format % args)

    def _send(self, code: int, body: bytes, content_type: str,
              headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in self._active.config.headers.items():
            self.send_header(name, value)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self) -> bool:
        users = self._active.config.basic_auth_users
        if not users:
            return True
        value = self.headers.get("Authorization", "")
        scheme, _, encoded = value.partition(" ")
        if scheme.lower() != "basic" or len(encoded) > 4096:
            return False
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        if not sep:
            return False
        try:
            name = user.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return self.server.auth_cache.check(users, name, password)

    def do_GET(self) -> None:
        self._active = self.server.config.current()
        bucket = self.server.bucket_for(self._active.config)
        if bucket is not None and not bucket.take():
            self._send(429, b"Too Many Requests\n", "text/plain; charset=utf-8")
            return
        if not self._authorized():
            self._send(401, b"Unauthorized\n", "text/plain; charset=utf-8",
                       (("WWW-Authenticate", 'Basic realm="gpuwatchd", charset="UTF-8"'),))
            return
        url = urlsplit(self.path)
        if url.path == "/metrics":
            self._metrics(url.query)
        elif url.path == "/":
            self._send(200, LANDING_PAGE.encode(), "text/html; charset=utf-8")
        else:
            self._send(404, f"Not Found: {escape_html(url.path[:200])}\n".encode(),
                       "text/plain; charset=utf-8")

    do_HEAD = do_GET

    def _metrics(self, query: str) -> None:
        try:
            params = parse_qs(query, max_num_fields=MAX_QUERY_PARAMETERS)
        except ValueError:
            self._send(400, f"at most {MAX_QUERY_PARAMETERS} query parameters\n".encode(),
                       "text/plain; charset=utf-8")
            return
        accept = self.headers.get("Accept", "")
        registry: Any = self.server.registry
        choice = negotiate(accept)
        if choice is not None and "name[]" not in params and hasattr(registry, "encode_text"):
            # gpuwatchd's StateRegistry, rendered by gpuwatchd, cached between cycles
            fmt, content_type = choice
            body = registry.encode_text() if fmt == "text" else registry.encode_openmetrics()
        else:
            # Another registry, another format or a name[] filter: client_python's encoders,
            # imported here so that the daemon never loads prometheus_client (and its ssl,
            # http.server, urllib.request) for the scrapes Prometheus makes.
            from prometheus_client.exposition import choose_encoder

            encoder, content_type = choose_encoder(accept)
            source: Any = _Restricted(registry, params["name[]"]) if "name[]" in params else registry
            body = encoder(source)
        self._send(200, body, content_type)

    def _method_not_allowed(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = (
        _method_not_allowed
    )


class _Restricted:
    """client_python's ``name[]`` filter: the samples whose name is listed (``x_total`` of a
    counter, ``x_bucket`` of a histogram), taken from what the registry collects rather than from
    what its collectors describe (gpuwatchd's collector describes nothing, so client_python's
    ``restricted_registry`` finds no names in it and returns an empty body)."""

    def __init__(self, registry: Collector, names: list[str]) -> None:
        self.registry = registry
        self.names = set(names)

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            samples = [s for s in fam.samples if s.name in self.names]
            if samples:
                m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                m.samples = samples
                yield m


class _Site:
    """What a request is answered from: shared by the workers of one listener."""

    def __init__(self, registry: Collector, config: ConfigHolder) -> None:
        self.registry = registry
        self.config = config
        self.auth_cache = _AuthCache()
        self._buckets: dict[RateLimit, _TokenBucket] = {}
        self._lock = threading.Lock()

    def bucket_for(self, cfg: WebConfig) -> _TokenBucket | None:
        if cfg.rate_limit is None:
            return None
        with self._lock:
            b = self._buckets.get(cfg.rate_limit)
            if b is None:
                b = self._buckets[cfg.rate_limit] = _TokenBucket(cfg.rate_limit)
            return b

    def tls(self) -> ssl.SSLContext | None:
        return self.config.current().ssl_context

    def san_allowed(self, conn: ssl.SSLSocket) -> bool:
        tls = self.config.current().config.tls
        allowed = tls.client_allowed_sans if tls else ()
        if not allowed:
            return True
        cert: Any = conn.getpeercert() or {}
        sans = {str(pair[1]) for pair in cert.get("subjectAltName", ())}
        return bool(sans & set(allowed))

    def serve(self, conn: Conn) -> bool:
        """Answer ``conn.head`` (in a worker thread); True to keep the connection."""
        keep = guarded(f"answering {conn.addr}", lambda: self._answer(conn), None)
        if keep is None:
            conn.out.clear()  # never half a response: the client sees the connection close
            return False
        return keep

    def _answer(self, conn: Conn) -> bool:
        if conn.ctx is not self.tls():
            # Accepted under other TLS settings (web-config changed since): not ours to answer.
            return False
        return not _Handler(conn, self).close_connection
