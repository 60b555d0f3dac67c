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

Parsed into frozen dataclasses by the checkers of ``gpuwatchd.config.checks`` (as the main config
is); ``WebConfigError`` names every bad key, as ``key.path: must be ..., got ...`` (never the value
of a password hash). Like
exporter-toolkit, the file (and the certificates it names) is looked at again on every new
connection (``ConfigHolder.current``: three ``stat`` calls), so certificates rotate without a
restart; unlike it, a file that became invalid is logged once and the last good configuration
keeps serving instead of failing every scrape.
Cost: reading the file (at most 1 MiB) and loading its certificates, only when a file changed.
Privilege: read access to the file and the certificates.
Shell equivalent: ``gpuwatchd web-config check FILE``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from gpuwatchd.config import strict_yaml
from gpuwatchd.config.checks import (
    Schema,
    check_boolean,
    check_choice,
    check_duration,
    check_integer,
    check_mapping,
    check_one_line,
    check_optional,
    check_path_string,
    check_string_list,
)

log = logging.getLogger(__name__)

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
# Keys of the exporter-toolkit format that this server does not implement: named in the error
# rather than silently ignored, since each of them changes who may connect.
TLS_UNSUPPORTED = dict.fromkeys(
    ("cert", "key", "client_ca", "cipher_suites", "curve_preferences"), "not supported by gpuwatchd"
)
BCRYPT_RE = re.compile(r"^\$2[aby]?\$\d\d\$[./A-Za-z0-9]{53}$")


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


def _client_auth_type(v: Any) -> str:
    if isinstance(v, str) and v in UNSUPPORTED_CLIENT_AUTH:
        raise ValueError(
            f"{v} is not supported (Python's ssl cannot request a certificate without"
            " verifying it); use RequireAndVerifyClientCert"
        )
    return str(check_choice(*CLIENT_AUTH_TYPES)(v))


def _bcrypt_hash(v: Any) -> bytes:
    # never the value in the message: a plain password written where its hash belongs must not
    # reach a log
    if not isinstance(v, str) or not BCRYPT_RE.match(v):
        raise ValueError("not a bcrypt hash ($2b$10$... , 60 characters; make one with `gpuwatchd web-config hash`)")
    return v.encode()


TLS_SCHEMA: Schema = {
    "cert_file": check_path_string,
    "key_file": check_path_string,  # relative: to the web-config file
    "client_auth_type": check_optional(_client_auth_type),
    "client_ca_file": check_optional(check_path_string),
    "client_allowed_sans": check_optional(check_string_list),
    "min_version": check_optional(check_choice(*TLS_VERSIONS)),
    "max_version": check_optional(check_choice(*TLS_VERSIONS)),
    "prefer_server_cipher_suites": check_optional(check_boolean),  # accepted; the server's order always wins
}
HEADERS_SCHEMA: Schema = dict.fromkeys(SECURITY_HEADERS, check_one_line)
# exporter-toolkit's rate limiter: interval 0 turns it off, burst 0 refuses every request.
RATE_LIMIT_SCHEMA: Schema = {
    "interval": lambda v: 0.0 if v in (0, "0") else check_duration(v),
    "burst": check_integer(0),
}
# exporter-toolkit's extraHTTPHeaders: the values these headers may take (others: any one line).
HEADER_VALUES = {"X-Content-Type-Options": ("nosniff",), "X-Frame-Options": ("deny", "sameorigin")}


def _tls(t: Any, base: str, problems: list[str]) -> TLSConfig | None:
    if t is None or t == {}:
        return None
    v = check_mapping(
        t, "tls_server_config", TLS_SCHEMA, problems, required=("cert_file", "key_file"), notes=TLS_UNSUPPORTED
    )
    if not isinstance(t, dict):
        return None
    auth = v.get("client_auth_type") or "NoClientCert"
    if t.get("client_auth_type") is None or "client_auth_type" in v:  # a known type: check its needs
        if auth != "NoClientCert" and t.get("client_ca_file") is None:
            problems.append(f"tls_server_config.client_ca_file: required by client_auth_type {auth}")
        if v.get("client_allowed_sans") and auth == "NoClientCert":
            problems.append(
                "tls_server_config.client_allowed_sans: needs a client_auth_type that verifies client certificates"
            )
    if "cert_file" not in v or "key_file" not in v:
        return None
    ca = v.get("client_ca_file")
    return TLSConfig(
        cert_file=os.path.join(base, v["cert_file"]),
        key_file=os.path.join(base, v["key_file"]),
        client_auth_type=auth,
        client_ca_file=os.path.join(base, ca) if ca else None,
        client_allowed_sans=v.get("client_allowed_sans") or (),
        min_version=v.get("min_version") or "TLS12",
        max_version=v.get("max_version"),
    )


def _users(u: Any, problems: list[str]) -> dict[str, bytes]:
    # the user names are the keys: each good one is checked as a bcrypt hash, the others are named
    names = [n for n in u if isinstance(n, str) and n and ":" not in n] if isinstance(u, dict) else []
    return check_mapping(
        u,
        "basic_auth_users",
        dict.fromkeys(names, _bcrypt_hash),
        problems,
        unknown="user names are non-empty and have no ':'",
    )


def _scalar_string(v: Any) -> Any:
    """A YAML scalar as Go's yaml.v2 reads it into a string (``X-XSS-Protection: 1``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v) if isinstance(v, (int, float)) else v


def _headers(h: Any, problems: list[str]) -> dict[str, str]:
    def headers(v: Any) -> dict[str, str]:
        if isinstance(v, dict):
            v = {k: _scalar_string(x) for k, x in v.items()}
        out = check_mapping(
            v,
            "http_server_config.headers",
            HEADERS_SCHEMA,
            problems,
            unknown="not one of " + ", ".join(sorted(SECURITY_HEADERS)),
        )
        for name, allowed in HEADER_VALUES.items():
            if name in out and out[name] not in allowed:
                problems.append(
                    f"http_server_config.headers.{name}: must be one of {', '.join(allowed)}, got {out[name]!r:.40}"
                )
        return out

    v = check_mapping(h, "http_server_config", {"http2": check_boolean, "headers": headers}, problems)
    return v.get("headers") or {}


def _rate_limit(r: Any, problems: list[str]) -> RateLimit | None:
    if r is None or r == {}:
        return None
    v = check_mapping(r, "rate_limit", RATE_LIMIT_SCHEMA, problems, required=("interval", "burst"))
    if "interval" not in v or "burst" not in v or not v["interval"]:
        return None  # interval 0: no rate limit, as exporter-toolkit
    return RateLimit(v["interval"], v["burst"])


def parse_web_config(doc: Any, path: str = "<web-config>") -> WebConfig:
    """Validate a parsed web-config document; raises WebConfigError naming every bad key, with
    the checkers and the "key: must be ..., got ..." messages of ``gpuwatchd.config.schema``
    (config/checks.py); a password hash's value is never in a message.

    Certificates are not loaded here (``build_ssl_context`` does that)."""
    problems: list[str] = []
    base = os.path.dirname(os.path.abspath(path))
    v = check_mapping(
        doc,
        "",
        {
            "tls_server_config": functools.partial(_tls, base=base, problems=problems),
            "basic_auth_users": functools.partial(_users, problems=problems),
            "http_server_config": functools.partial(_headers, problems=problems),
            "rate_limit": functools.partial(_rate_limit, problems=problems),
        },
        problems,
    )
    if problems:
        raise WebConfigError(path, problems)
    return WebConfig(
        tls=v.get("tls_server_config"),
        basic_auth_users=v.get("basic_auth_users") or {},
        headers=v.get("http_server_config") or {},
        rate_limit=v.get("rate_limit"),
    )


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
        doc = strict_yaml.load(text)
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
        raise WebConfigError(path, [f"tls_server_config.cert_file/key_file: {e.filename}: no such file"]) from None
    except (ssl.SSLError, OSError) as e:
        raise WebConfigError(
            path, [f"tls_server_config.cert_file/key_file: cannot load {tls.cert_file} with {tls.key_file}: {e}"]
        ) from None
    ctx.verify_mode = getattr(ssl, CLIENT_AUTH_TYPES[tls.client_auth_type])
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as e:
            raise WebConfigError(
                path, [f"tls_server_config.client_ca_file: cannot load {tls.client_ca_file}: {e}"]
            ) from None
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
                    self._active = Active(old.config, old.ssl_context, _file_key((self.path, *old.config.files())))
            return self._active
