"""The value checkers of the YAML configuration files: ``config/schema.py``'s ``SCHEMA`` and the
``/metrics`` web-config (``gpuwatchd.web.web_config``) are built on them.

Each checker takes one YAML value and returns it converted, or raises ``ValueError(reason)``; the
reason becomes the text after the dotted key (``gil.rate_hz: must be a number > 0, got 'fast'``).
``check_mapping`` applies a schema of them to one mapping and collects every problem. Pure
functions, no I/O.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Check = Callable[[Any], Any]
Schema = Mapping[str, Check]  # key -> its checker (a section: a checker that calls check_mapping)


def check_number(minimum: float | None = None, exclusive: bool = True, maximum: float | None = None) -> Check:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"must be a number, got {v!r}")
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"must be finite, got {v!r}")
        if minimum is not None and (v <= minimum if exclusive else v < minimum):
            raise ValueError(f"must be {'>' if exclusive else '>='} {minimum}, got {v!r}")
        if maximum is not None and v > maximum:
            raise ValueError(f"must be <= {maximum}, got {v!r}")
        return float(v)

    return check


def check_integer(minimum: int, maximum: int | None = None) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer, got {v!r}")
        if maximum is None and v < minimum:
            raise ValueError(f"must be >= {minimum}, got {v!r}")
        if maximum is not None and not minimum <= v <= maximum:
            raise ValueError(f"must be between {minimum} and {maximum}, got {v!r}")
        return v

    return check


def check_boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def check_path_string(v: Any) -> str:
    """A file name, relative or absolute."""
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty path string, got {v!r}")
    if "\x00" in v:
        raise ValueError("must not contain NUL bytes")
    return v


def check_path(v: Any) -> str:
    if not os.path.isabs(check_path_string(v)):
        raise ValueError(f"must be an absolute path, got {v!r}")
    return str(v)


def check_optional(check: Check) -> Check:
    def wrapped(v: Any) -> Any:
        return None if v is None else check(v)

    return wrapped


def check_label_value(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > 128:
        raise ValueError(f"must be a non-empty string of at most 128 characters, got {v!r}")
    return v


def check_instance(v: Any) -> str:
    """An ``instance`` label value as Prometheus may give it: ``host:port``, or a name that
    relabelling left without the port (a node name)."""
    return check_one_line(check_label_value(v))


def check_string_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"must be a list of non-empty strings, got {v!r}")
    return tuple(v)


def check_one_line(v: Any) -> str:
    """A string that cannot split an HTTP header (no CR or LF)."""
    if not isinstance(v, str) or "\n" in v or "\r" in v:
        raise ValueError(f"must be a one-line string, got {v!r}")
    return v


# Go's time.ParseDuration: one or more number+unit parts ("1m30s", "1.5h", "300ms"), or "0".
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)", re.ASCII)
_DURATION = re.compile(r"(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+\Z")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def check_duration(v: Any) -> float:
    """Seconds: a number, or a duration string as Go's time.ParseDuration reads it ("100ms",
    "1s", "5m", "1m30s", "0")."""
    if isinstance(v, str):
        if v == "0":
            v = 0
        elif not _DURATION.match(v):
            raise ValueError(f"must be a duration such as 1s, 100ms or 1m30s, got {v!r}")
        else:
            v = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(v))
    elif isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a duration such as 1s, 100ms or 1m30s, got {v!r}")
    return check_number(0.0)(v)


def check_choice(*options: str) -> Check:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return str(v)

    return check


def parse_listen_address(v: Any) -> tuple[str, int]:
    """``"0.0.0.0:9863"``, ``"[::1]:9863"``, ``"localhost:0"`` -> (host, port); ``":9863"`` ->
    ``("", 9863)``: all interfaces, which the web server binds as dual-stack ``::`` where the
    host has IPv6, else ``0.0.0.0``. The one parser of the config check and the web server."""
    if not isinstance(v, str) or ":" not in v:
        raise ValueError(f"must be HOST:PORT, got {v!r}")
    host, _, port_s = v.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as e:
            raise ValueError(f"bad IPv6 address in {v!r}") from e
    elif ":" in host:
        raise ValueError(f"IPv6 addresses need brackets, as in [::1]:{port_s}")
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"port must be 0..65535, got {port_s!r}")
    return (host, int(port_s))


def check_listen(v: Any) -> str:
    parse_listen_address(v)
    return str(v)


def check_url(v: Any) -> str:
    if not isinstance(v, str) or not v.startswith(("http://", "https://")):
        raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
    return v


def check_launchers(v: Any) -> tuple[str, ...]:
    allowed = ("torchrun", "slurm", "openmpi")
    if not isinstance(v, list) or not all(isinstance(x, str) and x in allowed for x in v):
        raise ValueError(f"must be a list drawn from {', '.join(allowed)}, got {v!r}")
    return tuple(v)


def check_mapping(
    data: Any,
    prefix: str,
    schema: Schema,
    problems: list[str],
    *,
    required: Iterable[str] = (),
    notes: Mapping[str, str] | None = None,
    unknown: str = "unknown key",
) -> dict[str, Any]:
    """The converted values of the good keys of mapping ``data`` (None: empty), each checked by
    its ``schema`` entry; every problem goes to ``problems`` as ``"prefix.key: why"``: a value its
    checker refuses, a key the schema lacks (``notes[key]``, else ``unknown``), a ``required`` key
    that is absent, or ``data`` that is not a mapping."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{prefix or '(top level)'}: must be a mapping, got {type(data).__name__}")
        return {}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        spec = schema.get(key) if isinstance(key, str) else None
        if spec is None:
            problems.append(f"{dotted}: {(notes or {}).get(str(key), unknown)}")
            continue
        try:
            values[key] = spec(raw)
        except ValueError as e:
            problems.append(f"{dotted}: {e}")
    problems += [f"{prefix}.{key}: required when {prefix} is set" for key in required if key not in data]
    return values
