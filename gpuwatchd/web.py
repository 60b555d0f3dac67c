"""HTTP(S) server for ``/metrics``, configured like every Prometheus exporter.

Serves a prometheus_client ``CollectorRegistry`` over plain HTTP by default, or over TLS with
optional client certificates and bcrypt basic auth when given a web-config file in the
exporter-toolkit format (``--web.config.file``; prometheus/exporter-toolkit
``docs/web-configuration.md``)::

    tls_server_config:
      cert_file: server.crt            # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    basic_auth_users:
      prometheus: $2b$10$...           # htpasswd -nBC 10 "" | tr -d ':\\n'

Like exporter-toolkit, the file (and the certificates it names) is looked at again on every new
connection, so certificates rotate without a restart; unlike it, a file that became invalid is
logged and the last good configuration keeps serving instead of failing every scrape.

Cost: connections are accepted, handshaken and read by one loop thread (``web_listener``), so
a waiting connection costs an fd and a small buffer, not a thread; complete requests are answered
by at most ``Limits.max_workers`` threads. A scrape costs what the registry's collectors cost
(gpuwatchd's collector only reads the latest NodeState). bcrypt checks (~70 ms at cost 10) are
cached per (user, password) after the first success.
Robustness: every connection has a deadline (``Limits``), at most ``Limits.max_connections`` are
open and a new one replaces the oldest waiting one, so slow, silent or garbage clients cost
bounded resources for a bounded time, never stop the server and never keep a scraper out.
Privilege: none (binding a port >= 1024).
Shell equivalent: ``curl --cacert ca.crt --cert client.crt --key client.key -u prometheus
https://node:9958/metrics``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import getpass
import hashlib
import html
import io
import logging
import os
import re
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

import bcrypt
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import Metric

from gpuwatchd.counters import CounterStore
from gpuwatchd.isolation import guarded
from gpuwatchd.web_listener import (
    DROP_REASONS,
    MAX_REQUEST_LINE,
    Conn,
    Limits,
    Listener,
    Writer,
    bind,
)

log = logging.getLogger(__name__)

MAX_HEADERS = 64
MAX_QUERY_PARAMETERS = 64

CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# Go's crypto/tls can ask for a certificate without verifying it; Python's ssl module cannot.
UNSUPPORTED_CLIENT_AUTH = {"RequestClientCert", "RequireAnyClientCert"}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
SECURITY_HEADERS = {
    "Content-Security-Policy",
    "X-Frame-Options",
    "X-Content-Type-Options",
    "X-XSS-Protection",
    "Strict-Transport-Security",
}
TLS_KEYS = {
    "cert_file", "key_file", "client_auth_type", "client_ca_file", "client_allowed_sans",
    "min_version", "max_version", "prefer_server_cipher_suites",
}
# Keys of the exporter-toolkit format that this server does not implement: named in the error
# rather than silently ignored, since each of them changes who may connect.
TLS_UNSUPPORTED_KEYS = {"cert", "key", "client_ca", "cipher_suites", "curve_preferences"}
BCRYPT_RE = re.compile(r"^\$2[aby]?\$\d\d\$[./A-Za-z0-9]{53}$")
DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


class WebConfigError(ValueError):
    """A web-config file that cannot be used; ``problems`` names every bad key."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__(f"{path}: " + "; ".join(problems))


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str | None = None


@dataclass(frozen=True)
class RateLimit:
    interval_seconds: float
    burst: int


@dataclass(frozen=True)
class WebConfig:
    tls: TLSConfig | None = None
    basic_auth_users: Mapping[str, bytes] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    rate_limit: RateLimit | None = None

    def files(self) -> tuple[str, ...]:
        """Files whose change must trigger a reload (besides the web-config file itself)."""
        if self.tls is None:
            return ()
        names = [self.tls.cert_file, self.tls.key_file]
        if self.tls.client_ca_file:
            names.append(self.tls.client_ca_file)
        return tuple(names)


def _duration(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    m = DURATION_RE.match(v) if isinstance(v, str) else None
    if not m:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]
    return float(m.group(1)) * scale


def parse_web_config(doc: Any, path: str = "<web-config>") -> WebConfig:
    """Validate a parsed web-config document; raises WebConfigError naming every bad key.

    Certificates are not loaded here (``build_ssl_context`` does that)."""
    problems: list[str] = []
    if doc is None:
        return WebConfig()
    if not isinstance(doc, dict):
        raise WebConfigError(path, ["top level must be a mapping"])
    base = os.path.dirname(os.path.abspath(path))

    def rel(p: str) -> str:
        return p if os.path.isabs(p) else os.path.join(base, p)

    for key in sorted(set(doc) - {"tls_server_config", "http_server_config", "basic_auth_users",
                                  "rate_limit"}):
        problems.append(f"{key}: unknown key")

    tls: TLSConfig | None = None
    t = doc.get("tls_server_config")
    if t is not None and not isinstance(t, dict):
        problems.append("tls_server_config: must be a mapping")
    elif t:
        for key in sorted(set(t) - TLS_KEYS):
            what = "not supported by gpuwatchd" if key in TLS_UNSUPPORTED_KEYS else "unknown key"
            problems.append(f"tls_server_config.{key}: {what}")
        strs: dict[str, str] = {}
        for key in ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
                    "max_version"):
            v = t.get(key)
            if v is not None and (not isinstance(v, str) or not v):
                problems.append(f"tls_server_config.{key}: must be a non-empty string")
            elif v is not None:
                strs[key] = v
        for key in ("cert_file", "key_file"):
            if key not in strs and f"tls_server_config.{key}: must be a non-empty string" not in (
                problems
            ):
                problems.append(f"tls_server_config.{key}: required when tls_server_config is set")
        auth = strs.get("client_auth_type", "NoClientCert")
        if auth in UNSUPPORTED_CLIENT_AUTH:
            problems.append(
                f"tls_server_config.client_auth_type: {auth} is not supported (Python's ssl cannot"
                " request a certificate without verifying it); use RequireAndVerifyClientCert"
            )
        elif auth not in CLIENT_AUTH_TYPES:
            problems.append(
                f"tls_server_config.client_auth_type: {auth!r} is not one of "
                + ", ".join(sorted(set(CLIENT_AUTH_TYPES) | UNSUPPORTED_CLIENT_AUTH))
            )
        elif auth != "NoClientCert" and "client_ca_file" not in strs:
            problems.append(
                f"tls_server_config.client_ca_file: required by client_auth_type {auth}"
            )
        for key in ("min_version", "max_version"):
            if key in strs and strs[key] not in TLS_VERSIONS:
                problems.append(
                    f"tls_server_config.{key}: {strs[key]!r} is not one of "
                    + ", ".join(TLS_VERSIONS)
                )
        sans = t.get("client_allowed_sans", [])
        if not isinstance(sans, list) or not all(isinstance(s, str) and s for s in sans):
            problems.append("tls_server_config.client_allowed_sans: must be a list of strings")
            sans = []
        elif sans and auth == "NoClientCert":
            problems.append("tls_server_config.client_allowed_sans: needs a client_auth_type that"
                            " verifies client certificates")
        psc = t.get("prefer_server_cipher_suites")
        if psc is not None and not isinstance(psc, bool):
            problems.append("tls_server_config.prefer_server_cipher_suites: must be true or false")
        if "cert_file" in strs and "key_file" in strs:
            tls = TLSConfig(
                cert_file=rel(strs["cert_file"]),
                key_file=rel(strs["key_file"]),
                client_auth_type=auth,
                client_ca_file=rel(strs["client_ca_file"]) if "client_ca_file" in strs else None,
                client_allowed_sans=tuple(sans),
                min_version=strs.get("min_version", "TLS12"),
                max_version=strs.get("max_version"),
            )

    users: dict[str, bytes] = {}
    u = doc.get("basic_auth_users")
    if u is not None and not isinstance(u, dict):
        problems.append("basic_auth_users: must be a mapping of user name to bcrypt hash")
    elif u:
        for name, hashed in u.items():
            if not isinstance(name, str) or not name or ":" in name:
                problems.append(
                    f"basic_auth_users.{name}: user names are non-empty and have no ':'"
                )
            elif not isinstance(hashed, str) or not BCRYPT_RE.match(hashed):
                problems.append(f"basic_auth_users.{name}: not a bcrypt hash ($2b$10$... , 60"
                                " characters; make one with `gpuwatchd web-config hash`)")
            else:
                users[name] = hashed.encode()

    headers: dict[str, str] = {}
    h = doc.get("http_server_config")
    if h is not None and not isinstance(h, dict):
        problems.append("http_server_config: must be a mapping")
    elif h:
        for key in sorted(set(h) - {"http2", "headers"}):
            problems.append(f"http_server_config.{key}: unknown key")
        if "http2" in h and not isinstance(h["http2"], bool):
            problems.append("http_server_config.http2: must be true or false")
        hd = h.get("headers") or {}
        if not isinstance(hd, dict):
            problems.append("http_server_config.headers: must be a mapping")
        else:
            for name, value in hd.items():
                if name not in SECURITY_HEADERS:
                    problems.append(f"http_server_config.headers.{name}: not one of "
                                    + ", ".join(sorted(SECURITY_HEADERS)))
                elif not isinstance(value, str) or "\n" in value or "\r" in value:
                    problems.append(f"http_server_config.headers.{name}: must be a one-line string")
                else:
                    headers[name] = value

    rate: RateLimit | None = None
    r = doc.get("rate_limit")
    if r is not None and not isinstance(r, dict):
        problems.append("rate_limit: must be a mapping")
    elif r:
        for key in sorted(set(r) - {"interval", "burst"}):
            problems.append(f"rate_limit.{key}: unknown key")
        interval = _duration(r.get("interval"))
        burst = r.get("burst")
        if interval is None:
            problems.append("rate_limit.interval: must be a duration such as 1s or 100ms")
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            problems.append("rate_limit.burst: must be a positive integer")
        elif interval is not None:
            rate = RateLimit(interval, burst)

    if problems:
        raise WebConfigError(path, problems)
    return WebConfig(tls=tls, basic_auth_users=users, headers=headers, rate_limit=rate)


def load_web_config(path: str) -> WebConfig:
    """Read, parse and validate a web-config file, and load its certificates once."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError as e:
        raise WebConfigError(path, [f"cannot read: {e.strerror}"]) from None
    except UnicodeDecodeError:
        raise WebConfigError(path, ["is not UTF-8 text"]) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WebConfigError(path, [f"is not valid YAML: {e}"]) from None
    cfg = parse_web_config(doc, path)
    if cfg.tls is not None:
        build_ssl_context(cfg.tls, path)
    return cfg


def build_ssl_context(tls: TLSConfig, path: str = "<web-config>") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    if tls.max_version:
        ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_COMPRESSION
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except FileNotFoundError as e:
        raise WebConfigError(path, [f"tls_server_config.cert_file/key_file: {e.filename}: no such"
                                    " file"]) from None
    except (ssl.SSLError, OSError) as e:
        raise WebConfigError(path, [f"tls_server_config.cert_file/key_file: cannot load"
                                    f" {tls.cert_file} with {tls.key_file}: {e}"]) from None
    ctx.verify_mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as e:
            raise WebConfigError(path, [f"tls_server_config.client_ca_file: cannot load"
                                        f" {tls.client_ca_file}: {e}"]) from None
    return ctx


@dataclass(frozen=True)
class _Active:
    config: WebConfig
    ssl_context: ssl.SSLContext | None
    key: tuple[tuple[str, int, int], ...]


def _file_key(paths: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((p, -1, -1))
    return tuple(out)


class _ConfigHolder:
    """The web config in force; reloaded when the file or a certificate it names changes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._active = self._load() if path else _Active(WebConfig(), None, ())

    def _load(self) -> _Active:
        assert self.path is not None
        before = _file_key((self.path,))
        cfg = load_web_config(self.path)
        ctx = build_ssl_context(cfg.tls, self.path) if cfg.tls else None
        return _Active(cfg, ctx, before + _file_key(cfg.files()))

    def current(self) -> _Active:
        active = self._active
        if self.path is None:
            return active
        files = (self.path, *active.config.files())
        if _file_key(files) == active.key:
            return active
        with self._lock:
            if _file_key((self.path, *self._active.config.files())) != self._active.key:
                try:
                    self._active = self._load()
                    log.info("web-config %s reloaded", self.path)
                except WebConfigError as e:
                    log.error("web-config reload failed, keeping the previous one: %s", e)
                    # Remember the broken state so the error is logged once, not per connection.
                    old = self._active
                    self._active = _Active(old.config, old.ssl_context,
                                           _file_key((self.path, *old.config.files())))
            return self._active


class _AuthCache:
    """Remembers (user, password, hash) triples that passed bcrypt, bounded in size."""

    def __init__(self, size: int = 256) -> None:
        self._ok: dict[bytes, None] = {}
        self._size = size
        self._lock = threading.Lock()

    def check(self, users: Mapping[str, bytes], user: str, password: bytes) -> bool:
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


class _Handler(BaseHTTPRequestHandler):
    """Answers one request whose head the listener has read already (``conn.head``), into
    ``conn.out``, which the listener sends: no socket operation happens here."""

    protocol_version = "HTTP/1.1"
    # Answer garbage with a status line; HTTP/0.9 (no status line, no headers) has no clients.
    default_request_version = "HTTP/1.0"
    server_version = "gpuwatchd"
    sys_version = ""
    server: _Site  # type: ignore[assignment]
    raw_requestline: bytes

    def __init__(self, conn: Conn, site: _Site) -> None:
        self.conn = conn
        super().__init__(conn.sock, (conn.addr, 0), site)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.conn.sock
        self.rfile = io.BytesIO(self.conn.head)
        self.wfile = Writer(self.conn.out)  # type: ignore[assignment]

    def handle(self) -> None:
        self.handle_one_request()

    def finish(self) -> None:
        """The listener keeps or closes the connection."""

    def parse_request(self) -> bool:
        # Checked after BaseHTTPRequestHandler.parse_request: send_error needs the attributes it
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
            self._send(404, f"Not Found: {html.escape(url.path[:200])}\n".encode(),
                       "text/plain; charset=utf-8")

    do_HEAD = do_GET

    def _metrics(self, query: str) -> None:
        try:
            params = parse_qs(query, max_num_fields=MAX_QUERY_PARAMETERS)
        except ValueError:
            self._send(400, f"at most {MAX_QUERY_PARAMETERS} query parameters\n".encode(),
                       "text/plain; charset=utf-8")
            return
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        registry: Any = self.server.registry
        if "name[]" in params:
            body = encoder(_Restricted(registry, params["name[]"]))
        elif encoder is generate_latest and hasattr(registry, "encode_text"):
            body = registry.encode_text()  # gpuwatchd's StateRegistry: cached between cycles
        else:
            body = encoder(registry)
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

    def __init__(self, registry: CollectorRegistry, names: list[str]) -> None:
        self.registry = registry
        self.names = set(names)

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            samples = [s for s in fam.samples if s.name in self.names]
            if samples:
                m = Metric(fam.name, fam.documentation, fam.type)
                m.samples = samples
                yield m


class _Site:
    """What a request is answered from: shared by the workers of one listener."""

    def __init__(self, registry: CollectorRegistry, config: _ConfigHolder) -> None:
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


def parse_listen_address(addr: str) -> tuple[str, int]:
    """``"0.0.0.0:9958"``, ``"[::1]:9958"``, ``":9958"`` (all interfaces), ``"localhost:0"``."""
    host, sep, port_s = addr.rpartition(":")
    if not sep or not port_s.isdigit() or int(port_s) > 65535:
        raise ValueError(f"listen address {addr!r} is not HOST:PORT (IPv6 as [::1]:PORT)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"listen address {addr!r}: write IPv6 addresses in brackets, [::1]:PORT")
    return host, int(port_s)


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    if host == "":
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM):
                    return socket.AF_INET6, ("::", port)
            except OSError:
                pass
        return socket.AF_INET, ("0.0.0.0", port)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, sockaddr = infos[0][0], infos[0][4]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


class WebServer:
    """A running /metrics server; ``address`` is the (host, port) actually bound."""

    def __init__(self, listener: Listener, site: _Site, requested: tuple[Any, ...],
                 counters: CounterStore | None) -> None:
        self._listener = listener
        self._site = site
        self._requested = requested
        self._counters = counters

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    @property
    def tls(self) -> bool:
        return self._site.tls() is not None

    @property
    def url(self) -> str:
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{shown}:{port}/metrics"

    def close(self) -> None:
        self._listener.stop()

    def reload(self, listen_address: str, web_config_file: str | None) -> WebServer:
        """Serve with a new address or web-config, never losing the running server: the file is
        validated and a new address bound before the old one is given up. Returns the server now
        running (this one when the address is unchanged); raises like ``serve`` and then this
        server is untouched."""
        host, port = parse_listen_address(listen_address)
        config = _ConfigHolder(web_config_file)
        family, addr = _resolve(host, port)
        if (family, addr) == self._requested or addr == self.address:
            # Same address: the same socket serves on, under the new web-config; connections
            # accepted under other TLS settings are closed at their next request.
            self._site.config = config
            log.info("serving %s", self.url)
            return self
        new = _start(self._site.registry, family, addr, config, self._listener.limits,
                     self._counters)
        self.close()
        return new


def _start(registry: CollectorRegistry, family: socket.AddressFamily, addr: tuple[str, int],
           config: _ConfigHolder, limits: Limits, counters: CounterStore | None) -> WebServer:
    sock = bind(family, addr)
    site = _Site(registry, config)

    def dropped(reason: str) -> None:
        if counters is not None:
            counters.inc("web_connections_dropped", (reason,))

    listener = Listener(sock, limits, site.tls, site.san_allowed, site.serve, dropped)
    listener.start()
    ws = WebServer(listener, site, (family, addr), counters)
    log.info("serving %s", ws.url)
    return ws


def serve(registry: CollectorRegistry, listen_address: str,
          web_config_file: str | None = None, limits: Limits | None = None,
          counters: CounterStore | None = None) -> WebServer:
    """Start serving ``registry`` on ``listen_address`` in background threads; connections
    dropped (see ``web_listener``) are counted in ``counters`` when given.

    Raises ValueError for a bad address, WebConfigError for a bad web-config file, OSError when
    the address cannot be bound."""
    host, port = parse_listen_address(listen_address)
    config = _ConfigHolder(web_config_file)
    family, addr = _resolve(host, port)
    if counters is not None:
        for reason in DROP_REASONS:
            counters.ensure("web_connections_dropped", (reason,))
    return _start(registry, family, addr, config, limits or Limits(), counters)


# --- command line: gpuwatchd web-config check FILE | hash ----------------------------------------

def register(subparsers: Any) -> None:
    """Add ``gpuwatchd web-config {check,hash}`` to the CLI."""
    p = subparsers.add_parser("web-config", help="check a /metrics web-config file (TLS, auth)")
    sub = p.add_subparsers(dest="web_config_command", required=True)
    c = sub.add_parser("check", help="validate a web-config file and load its certificates")
    c.add_argument("file")
    c.set_defaults(func=_cmd_check)
    h = sub.add_parser("hash", help="print a bcrypt hash for basic_auth_users (reads stdin)")
    h.add_argument("--cost", type=int, default=10)
    h.set_defaults(func=_cmd_hash)


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        cfg = load_web_config(args.file)
    except WebConfigError as e:
        print(f"{e.path}: invalid", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    parts = []
    if cfg.tls:
        parts.append(f"TLS (min {cfg.tls.min_version}, client certificates:"
                     f" {cfg.tls.client_auth_type})")
    else:
        parts.append("plain HTTP")
    if cfg.basic_auth_users:
        parts.append(f"basic auth for {len(cfg.basic_auth_users)} user(s)")
    if cfg.rate_limit:
        parts.append(f"rate limit {cfg.rate_limit.burst} per {cfg.rate_limit.interval_seconds}s")
    print(f"{args.file}: ok: " + ", ".join(parts))
    return 0


def _cmd_hash(args: argparse.Namespace, read: Callable[[], str] | None = None) -> int:
    if not 4 <= args.cost <= 31:
        print("--cost must be between 4 and 31", file=sys.stderr)
        return 2
    if read is None:
        read = (lambda: getpass.getpass("password: ")) if sys.stdin.isatty() else sys.stdin.readline
    password = read().rstrip("\n").encode()
    if not password:
        print("empty password", file=sys.stderr)
        return 2
    print(bcrypt.hashpw(password, bcrypt.gensalt(args.cost)).decode())
    return 0
