"""The value checkers of the YAML configuration (``gpuwatchd.config``'s ``SCHEMA`` uses them).

Each takes one YAML value and returns it converted, or raises ``ValueError(reason)``; the reason
becomes the text after the dotted key in ``ConfigError``. Pure functions, no I/O.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], Any]


def _number(minimum: float | None = None, exclusive: bool = True, maximum: float | None = None) -> Check:
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


def _integer(minimum: int, maximum: int) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer, got {v!r}")
        if not minimum <= v <= maximum:
            raise ValueError(f"must be between {minimum} and {maximum}, got {v!r}")
        return v

    return check


def _boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty path string, got {v!r}")
    if "\x00" in v:
        raise ValueError("must not contain NUL bytes")
    if not os.path.isabs(v):
        raise ValueError(f"must be an absolute path, got {v!r}")
    return v


def _optional(check: Check) -> Check:
    def wrapped(v: Any) -> Any:
        return None if v is None else check(v)

    return wrapped


def _label_value(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > 128:
        raise ValueError(f"must be a non-empty string of at most 128 characters, got {v!r}")
    return v


def _choice(*options: str) -> Check:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return str(v)

    return check


def parse_listen_address(v: Any) -> tuple[str, int]:
    """``"0.0.0.0:9863"``, ``"[::1]:9863"``, ``":9863"`` -> (host, port)."""
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
    return (host or "0.0.0.0", int(port_s))


def _listen(v: Any) -> str:
    parse_listen_address(v)
    return str(v)


def _url(v: Any) -> str:
    if not isinstance(v, str) or not v.startswith(("http://", "https://")):
        raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
    return v


def _launchers(v: Any) -> tuple[str, ...]:
    allowed = ("torchrun", "slurm", "openmpi")
    if not isinstance(v, list) or not all(isinstance(x, str) and x in allowed for x in v):
        raise ValueError(f"must be a list drawn from {', '.join(allowed)}, got {v!r}")
    return tuple(v)
