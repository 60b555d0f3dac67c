"""The web-config file of ``/metrics``, in the exporter-toolkit format (``--web.config.file``;
prometheus/exporter-toolkit ``docs/web-configuration.md``)::

    tls_server_config:
      cert_file: server.crt            # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    basic_auth_users:
      prometheus: $2b$10$...           # htpasswd -nBC 10 "" | tr -d ':\\n'

Parsed into frozen dataclasses; ``WebConfigError`` names every bad key (never a value). Like
exporter-toolkit, the file (and the certificates it names) is looked at again on every new
connection (``ConfigHolder.current``: three ``stat`` calls), so certificates rotate without a
restart; unlike it, a file that became invalid is logged once and the last good configuration
keeps serving instead of failing every scrape.
Cost: reading the file (at most 1 MiB) and loading its certificates, only when a file changed.
Privilege: read access to the file and the certificates.
Shell equivalent: ``gpuwatchd web-config check FILE``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

log = logging.getLogger("gpuwatchd.web")

if TYPE_CHECKING:
    import ssl

# Names in the ssl module, looked up when a TLS context is built: without TLS the daemon never
# imports ssl (libssl, libcrypto: bench/rss.py).
CLIENT_AUTH_TYPES = {
    "NoClientCert": "CERT_NONE",
    "VerifyClientCertIfGiven": "CERT_OPTIONAL",
    "RequireAndVerifyClientCert": "CERT_REQUIRED",
}
# Go's crypto/tls can ask for a certificate without verifying it; Python's ssl module cannot.
UNSUPPORTED_CLIENT_AUTH = {"RequestClientCert", "RequireAnyClientCert"}
TLS_VERSIONS = {
    "TLS10": "TLSv1",
    "TLS11": "TLSv1_1",
    "TLS12": "TLSv1_2",
    "TLS13": "TLSv1_3",
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
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion[TLS_VERSIONS[tls.min_version]]
    if tls.max_version:
        ctx.maximum_version = ssl.TLSVersion[TLS_VERSIONS[tls.max_version]]
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_COMPRESSION
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except FileNotFoundError as e:
        raise WebConfigError(path, [f"tls_server_config.cert_file/key_file: {e.filename}: no such"
                                    " file"]) from None
    except (ssl.SSLError, OSError) as e:
        raise WebConfigError(path, [f"tls_server_config.cert_file/key_file: cannot load"
                                    f" {tls.cert_file} with {tls.key_file}: {e}"]) from None
    ctx.verify_mode = getattr(ssl, CLIENT_AUTH_TYPES[tls.client_auth_type])
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as e:
            raise WebConfigError(path, [f"tls_server_config.client_ca_file: cannot load"
                                        f" {tls.client_ca_file}: {e}"]) from None
    return ctx


@dataclass(frozen=True)
class Active:
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


class ConfigHolder:
    """The web config in force; reloaded when the file or a certificate it names changes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._active = self._load() if path else Active(WebConfig(), None, ())

    def _load(self) -> Active:
        assert self.path is not None
        before = _file_key((self.path,))
        cfg = load_web_config(self.path)
        ctx = build_ssl_context(cfg.tls, self.path) if cfg.tls else None
        return Active(cfg, ctx, before + _file_key(cfg.files()))

    def current(self) -> Active:
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
                    self._active = Active(old.config, old.ssl_context,
                                           _file_key((self.path, *old.config.files())))
            return self._active
