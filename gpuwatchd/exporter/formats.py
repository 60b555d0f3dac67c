"""Which exposition format a scrape asked for (its ``Accept`` header), and the OpenMetrics text
of gpuwatchd's families, without importing prometheus_client (exporter/families.py says why).

``negotiate`` makes the choice ``prometheus_client.exposition.choose_encoder`` makes, and names
the same content type, for the formats gpuwatchd renders itself: the text format 0.0.4 (no
``Accept``, curl, Prometheus before 2.5) and OpenMetrics 1.0.0 with ``underscores`` or
``allow-utf-8`` escaping (what Prometheus asks for first). Any other choice (text format 1.0.0,
another escaping, an OpenMetrics version after 1.0.0) returns None: the handler then imports
prometheus_client for that request, so the answer stays client_python's.
``render_openmetrics`` is byte for byte ``prometheus_client.openmetrics.exposition
.generate_latest`` for counter and gauge families whose names are legacy names without ``:``
(tests/test_exposition_formats.py compares them). Cost: one pass over the samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gpuwatchd.exporter.families import Metric

TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_1_0_0 = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_ESCAPINGS = ("underscores", "allow-utf-8", "dots", "values")


def _param(toks: list[str], key: str) -> str:
    for tok in toks:
        if "=" in tok:
            k, value = tok.strip().split("=", 1)
            if k == key:
                return value
    return ""


def _escaping(toks: list[str]) -> str:
    value = _param(toks, "escaping")
    return value if value in _ESCAPINGS else "underscores"


def _version(value: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in value.split("."))
    except ValueError:
        return None


def negotiate(accept: str) -> tuple[str, str] | None:
    """(``"text"`` or ``"openmetrics"``, content type), or None for a choice left to
    prometheus_client (the same walk over ``accept`` as its ``choose_encoder``)."""
    for accepted in (accept or "").split(","):
        toks = accepted.split(";")
        mime = toks[0].strip()
        if mime == "application/openmetrics-text":
            version, escaping = _param(toks, "version"), _escaping(toks)
            if not version:
                return "openmetrics", OPENMETRICS_1_0_0
            parsed = _version(version)
            if parsed is None:
                return None  # client_python compares such a version its own way
            if parsed >= (1, 0, 0):
                if parsed != (1, 0, 0) or escaping not in ("underscores", "allow-utf-8"):
                    return None
                return ("openmetrics", f"application/openmetrics-text; version={version}; "
                        f"charset=utf-8; escaping={escaping}")
        elif mime == "text/plain":
            parsed = _version(_param(toks, "version") or "0")
            if parsed is None or parsed >= (1, 0, 0):
                return None  # text format 1.0.0 (or an unparsable version): client_python's
    return "text", TEXT_0_0_4


def _go_float(v: float) -> str:
    """prometheus_client's ``floatToGoString``."""
    d = float(v)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if d != d:
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _esc(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render_openmetrics(families: Iterable[Metric]) -> bytes:
    out: list[str] = []
    for fam in families:
        out.append(f"# HELP {fam.name} {_esc(fam.documentation)}\n# TYPE {fam.name} {fam.type}\n")
        if fam.unit:
            out.append(f"# UNIT {fam.name} {fam.unit}\n")
        for s in fam.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(s.labels.items()))
                out.append(f"{s.name}{{{labels}}} {_go_float(s.value)}\n")
            else:
                out.append(f"{s.name} {_go_float(s.value)}\n")
    out.append("# EOF\n")
    return "".join(out).encode("utf-8")
