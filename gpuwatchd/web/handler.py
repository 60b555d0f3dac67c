"""Answering one request of the ``/metrics`` server: routes, auth, rate limit, the exposition.

``Site`` is what a listener's worker threads answer from (registry, web-config, the auth
checker, the per-client token buckets). The request arrives parsed (``Conn.request``, an
``h11.Request``: web/request.py) and the response leaves through the same h11 connection into
``Conn.out``. No socket I/O here: ``web/listener.py`` moves the bytes, ``web/server.py`` serves.

Routes: ``/metrics`` (``name[]`` filters, gzip when asked), ``/-/healthy`` (the process answers
and its cycles keep finishing: the systemd watchdog's rule, for a pod's liveness probe),
``/-/ready`` (the first cycle has ended and no collector's call is stuck), ``/`` (a landing
page). Everything is answered from what the registry cached for the current cycle
(exporter/collector.py): a scrape, filtered or compressed, renders nothing new. A registry that
caches nothing (a test's, a client_python one) is rendered per request by one thread at a time
(``_Uncached``), busy: 503, so it cannot take every worker.

Cost: a scrape is a dictionary lookup and a write once the cycle's exposition is rendered; a
bcrypt check (~70 ms at cost 10) runs on the auth thread only (web/auth.py), never in a worker.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from gpuwatchd.exporter.families import Collector
from gpuwatchd.exporter.formats import gzip_accepted, negotiate
from gpuwatchd.exporter.render import render
from gpuwatchd.isolation import STILL_RUNNING, guarded
from gpuwatchd.web import request
from gpuwatchd.web.auth import AuthChecker, Buckets
from gpuwatchd.web.connection import Conn
from gpuwatchd.web.web_config import ConfigHolder, WebConfig

if TYPE_CHECKING:
    import ssl

    import h11

log = logging.getLogger(__name__)

MAX_QUERY_PARAMETERS = 64
TEXT = "text/plain; charset=utf-8"
_FAILED = object()
# RFC 9110's methods: one of these other than GET and HEAD is 405, any other method 501.
_KNOWN_METHODS = frozenset(("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"))
HTML = "text/html; charset=utf-8"

LANDING_PAGE = b"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>gpuwatchd</title></head>
<body>
<h1>gpuwatchd</h1>
<p>Per-node monitor of GPU training jobs: ranks, GPU memory, OOM kills, GIL, stalls.</p>
<ul>
<li><a href="metrics">Metrics</a></li>
<li><a href="-/healthy">Health</a> (the process is up and its cycles keep finishing)</li>
<li><a href="-/ready">Readiness</a> (the first cycle has ended, no collector is stuck)</li>
</ul>
</body>
</html>
"""


def _escape_html(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


class _Restricted:
    """client_python's ``name[]`` filter for a registry that caches nothing: the samples whose
    name is listed (``x_total`` of a counter), taken from what the registry collects."""

    def __init__(self, registry: Collector, names: list[str]) -> None:
        self.registry = registry
        self.names = set(names)

    def collect(self) -> Iterator[Any]:
        for fam in self.registry.collect():
            samples = [s for s in fam.samples if s.name in self.names]
            if samples:  # any type another library writes (a histogram): not a gpuwatchd Metric
                yield types.SimpleNamespace(
                    name=fam.name, documentation=fam.documentation, type=fam.type, unit=fam.unit, samples=samples
                )


class _Uncached:
    """One render at a time for a registry without a per-cycle cache; busy: None (503)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def render(self, registry: Collector, fmt: str, names: list[str] | None) -> bytes | None:
        if not self._lock.acquire(blocking=False):
            return None
        try:
            source: Collector = _Restricted(registry, names) if names else registry
            return render(source.collect(), fmt)
        finally:
            self._lock.release()


class _Request:
    """The parts of an ``h11.Request`` a route reads: its method, path, query and headers
    (first value of each, case-insensitive; values as latin-1, as RFC 9110's obs-text)."""

    def __init__(self, event: h11.Request) -> None:
        self.method = event.method.decode("ascii")
        url = urlsplit(event.target.decode("ascii"))  # h11 allows visible ASCII only
        self.path, self.query = url.path, url.query
        self.headers: dict[str, str] = {}
        for name, value in event.headers:
            self.headers.setdefault(name.decode("ascii"), value.decode("latin-1"))


class Site:
    """What a request is answered from: shared by the workers of one listener."""

    def __init__(self, registry: Collector, config: ConfigHolder) -> None:
        self.registry = registry
        self.config = config
        self.auth = AuthChecker()
        self.buckets = Buckets()
        self.uncached = _Uncached()
        # Set by the listener: hands a connection answered off the worker pool (by the auth
        # thread) back to its loop.
        self.hand_back: Any = None

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

    def serve(self, conn: Conn) -> bool | None:
        """Answer ``conn.request`` (in a worker thread): True to keep the connection, None when
        the auth thread took it over (it hands it back itself)."""
        keep: Any = guarded(f"answering {conn.addr}", lambda: self._answer(conn), _FAILED)
        if keep is _FAILED:
            conn.out.clear()  # never half a response: the client sees the connection close
            return False
        return bool(keep) if keep is not None else None

    def _answer(self, conn: Conn) -> bool | None:
        if conn.ctx is not self.tls():
            # Accepted under other TLS settings (web-config changed since): not ours to answer.
            conn.out.clear()
            return False
        assert conn.request is not None
        req = _Request(conn.request)
        active = self.config.current().config
        if req.method not in ("GET", "HEAD"):
            if req.method not in _KNOWN_METHODS:
                return self._send(conn, active, req, 501, b"Not Implemented\n", TEXT, (("Connection", "close"),))
            return self._send(
                conn, active, req, 405, b"Method Not Allowed\n", TEXT, (("Allow", "GET, HEAD"), ("Connection", "close"))
            )
        creds = verdict = None
        if active.basic_auth_users:
            creds = _credentials(req.headers.get("authorization", ""))
            verdict = None if creds is None else self.auth.cached(active.basic_auth_users, *creds)
        known = creds[0] if creds is not None and verdict else None
        if not self.buckets.take(active.rate_limit, conn.addr, known):
            return self._send(conn, active, req, 429, b"Too Many Requests\n", TEXT)
        if active.basic_auth_users:
            if creds is not None and verdict is None:
                # Not seen before: bcrypt, on the auth thread, never in this worker.
                def finish(ok: bool) -> None:
                    keep: Any = guarded(
                        f"answering {conn.addr}", lambda: self._authorized(conn, active, req, ok), _FAILED
                    )
                    if keep is _FAILED:
                        conn.out.clear()
                    self.hand_back(conn, keep is True)

                if self.auth.submit(active.basic_auth_users, *creds, conn.addr, finish):
                    return None
                return self._send(conn, active, req, 503, b"Busy checking passwords\n", TEXT, (("Retry-After", "1"),))
            return self._authorized(conn, active, req, bool(verdict))
        return self._route(conn, active, req)

    def _authorized(self, conn: Conn, active: WebConfig, req: _Request, ok: bool) -> bool:
        if not ok:
            return self._send(
                conn,
                active,
                req,
                401,
                b"Unauthorized\n",
                TEXT,
                (("WWW-Authenticate", 'Basic realm="gpuwatchd", charset="UTF-8"'),),
            )
        return self._route(conn, active, req)

    def _route(self, conn: Conn, active: WebConfig, req: _Request) -> bool:
        if req.path == "/metrics":
            return self._metrics(conn, active, req)
        if req.path == "/-/healthy":
            live = getattr(self.registry, "liveness", None)
            why = live() if live is not None else ""
            if why:
                return self._send(conn, active, req, 503, f"gpuwatchd is not healthy: {why}\n".encode(), TEXT)
            return self._send(conn, active, req, 200, b"gpuwatchd is Healthy.\n", TEXT)
        if req.path == "/-/ready":
            why = self._not_ready()
            if why:
                return self._send(conn, active, req, 503, f"gpuwatchd is not ready: {why}\n".encode(), TEXT)
            return self._send(conn, active, req, 200, b"gpuwatchd is Ready.\n", TEXT)
        if req.path == "/":
            return self._send(conn, active, req, 200, LANDING_PAGE, HTML)
        return self._send(conn, active, req, 404, f"Not Found: {_escape_html(req.path[:200])}\n".encode(), TEXT)

    def _not_ready(self) -> str:
        ready = getattr(self.registry, "readiness", None)
        if ready is None:
            return ""  # a registry with no cycle behind it is ready when it answers
        state = ready()
        if state is None:
            return "the first cycle has not ended"
        stuck = sorted(c.name for c in state.collectors if STILL_RUNNING in c.error)
        return f"collector call still running: {', '.join(stuck)}" if stuck else ""

    def _metrics(self, conn: Conn, active: WebConfig, req: _Request) -> bool:
        try:
            params = parse_qs(req.query, max_num_fields=MAX_QUERY_PARAMETERS)
        except ValueError:
            return self._send(
                conn, active, req, 400, f"at most {MAX_QUERY_PARAMETERS} query parameters\n".encode(), TEXT
            )
        fmt, content_type = negotiate(req.headers.get("accept", ""))
        names = params.get("name[]")
        extra: tuple[tuple[str, str], ...] = ()
        exposition = getattr(self.registry, "exposition", None)
        if exposition is not None:
            # gpuwatchd's StateRegistry: this cycle's rendering, its gzip and its families,
            # each made once per cycle (exporter/collector.py).
            exp = exposition(fmt)
            if names:
                body = exp.select(names)
            elif gzip_accepted(req.headers.get("accept-encoding", "")):
                body, extra = exp.gzipped(), (("Content-Encoding", "gzip"),)
            else:
                body = exp.body
        else:
            rendered = self.uncached.render(self.registry, fmt, names)
            if rendered is None:
                return self._send(
                    conn, active, req, 503, b"Busy rendering another request\n", TEXT, (("Retry-After", "1"),)
                )
            body = rendered
        return self._send(conn, active, req, 200, body, content_type, extra)

    def _send(
        self,
        conn: Conn,
        active: WebConfig,
        req: _Request,
        status: int,
        body: bytes,
        content_type: str,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> bool:
        assert conn.parser is not None
        headers = [("Content-Type", content_type), *active.headers.items(), *extra]
        out: list[bytes] = []
        keep = request.respond(conn.parser, req.method == "HEAD", status, headers, body, out)
        conn.out.extend(memoryview(piece) for piece in out)
        log.debug("%s %s %s %d", conn.addr, req.method, req.path[:200], status)
        return keep


def _credentials(value: str) -> tuple[str, bytes] | None:
    """(user, password) of a ``Basic`` Authorization header; None when there is none or it is
    not one (then 401 without a bcrypt check)."""
    scheme, _, encoded = value.partition(" ")
    if scheme.lower() != "basic" or len(encoded) > 4096:
        return None
    try:
        user, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        name = user.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return (name, password) if sep else None
