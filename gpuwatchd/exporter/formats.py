"""Which exposition format a scrape asked for (its ``Accept`` header), without importing
prometheus_client (exporter/families.py says why).

``negotiate`` makes the choice ``prometheus_client.exposition.choose_encoder`` makes, and names
the same content type, for the formats gpuwatchd renders itself: the text format 0.0.4 (no
``Accept``, curl, Prometheus before 2.5) and OpenMetrics 1.0.0 with ``underscores`` or
``allow-utf-8`` escaping (what Prometheus asks for first). Any other choice (text format 1.0.0,
another escaping, an OpenMetrics version after 1.0.0) returns None: the handler then imports
prometheus_client for that request, so the answer stays client_python's.
The renderers are exporter/render.py.
"""

from __future__ import annotations

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
