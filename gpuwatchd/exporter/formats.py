"""Which exposition format a scrape asked for (its ``Accept`` header) and whether it takes gzip
(``Accept-Encoding``), without importing prometheus_client (exporter/families.py says why).

``negotiate`` makes the choice ``prometheus_client.exposition.choose_encoder`` (0.26) makes, and
names the same content type: the text format 0.0.4 (no ``Accept``, curl, Prometheus before 2.5),
the text format 1.0.0 and OpenMetrics 1.0.0 or later (what Prometheus asks for first). Every
choice is rendered by exporter/render.py: for gpuwatchd's legacy names text 1.0.0 is the bytes
of 0.0.4 and OpenMetrics 2.0.0 those of 1.0.0 (no native histograms). Two differences, both in
the content type only: an escaping whose bytes client_python writes differently for legacy names
(``dots`` in both formats, ``values`` in OpenMetrics) is answered with ``escaping=underscores``
and underscores-escaped bytes (the names are legacy: nothing to escape), and a version that is
not dotted numbers is passed over like a type not offered (client_python raises TypeError there).
Cost: one pass over the header.
"""

from __future__ import annotations

TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
TEXT_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"
OPENMETRICS_1_0_0 = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_ESCAPINGS = ("underscores", "allow-utf-8", "dots", "values")
# Escapings whose bytes are the underscores bytes for legacy names, per format.
_SAME_BYTES = {"text": ("underscores", "allow-utf-8", "values"), "openmetrics": ("underscores", "allow-utf-8")}


def _param(toks: list[str], key: str) -> str:
    for tok in toks:
        if "=" in tok:
            k, value = tok.strip().split("=", 1)
            if k == key:
                return value
    return ""


def _escaping(toks: list[str], fmt: str) -> str:
    value = _param(toks, "escaping")
    value = value if value in _ESCAPINGS else "underscores"
    return value if value in _SAME_BYTES[fmt] else "underscores"


def _version(value: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in value.split("."))
    except ValueError:
        return None


def negotiate(accept: str) -> tuple[str, str]:
    """(``"text"`` or ``"openmetrics"``, content type): the same walk over ``accept`` as
    client_python's ``choose_encoder``."""
    for accepted in (accept or "").split(","):
        toks = accepted.split(";")
        mime = toks[0].strip()
        if mime == "application/openmetrics-text":
            version = _param(toks, "version")
            if not version:
                return "openmetrics", OPENMETRICS_1_0_0
            parsed = _version(version)
            if parsed is not None and parsed >= (1, 0, 0):
                return (
                    "openmetrics",
                    f"application/openmetrics-text; version={version}; "
                    f"charset=utf-8; escaping={_escaping(toks, 'openmetrics')}",
                )
        elif mime == "text/plain":
            version = _param(toks, "version")
            parsed = _version(version) if version else None
            if parsed is not None and parsed >= (1, 0, 0):
                return "text", f"{TEXT_1_0_0}; escaping={_escaping(toks, 'text')}"
    return "text", TEXT_0_0_4


def gzip_accepted(accept_encoding: str) -> bool:
    """client_python's ``gzip_accepted``: ``gzip`` among the codings (its q-value not read)."""
    return any(a.split(";")[0].strip().lower() == "gzip" for a in (accept_encoding or "").split(","))
