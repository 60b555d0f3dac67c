"""The text format 0.0.4 and OpenMetrics 1.0.0 renderings of gpuwatchd's families, byte for byte
what ``prometheus_client.generate_latest`` and ``prometheus_client.openmetrics.exposition
.generate_latest`` write for them (tests/test_exposition_formats.py compares them).

Cost: a scrape at 64 ranks is about 1,300 samples, and their values change every cycle while
their label sets almost never do. So ``Prefixes`` keeps each series' rendered
``name{label="value",...} `` from one render to the next: a sample costs a dictionary lookup and
its value's ``repr``; sorting and escaping the labels happens once per new series. The cache
holds exactly the series of the last render (each render builds the next one from what it used),
so it never outgrows one exposition, whatever the job churn. One ``Prefixes`` serves both
formats (the same label sets), under the caller's lock (exporter/collector.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from gpuwatchd.exporter.families import LabelledFamily, Metric

Key = tuple[str, tuple[str, ...], tuple[str, ...]]  # sample name, label names, label values


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _prefix(name: str, labels: Iterable[tuple[str, str]]) -> str:
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels))
    return f"{name}{{{pairs}}} " if pairs else f"{name} "


class Prefixes:
    """The rendered ``name{labels} `` of every series of the last render."""

    def __init__(self) -> None:
        self._last: dict[Key, str] = {}
        self._next: dict[Key, str] = {}

    def begin(self) -> None:
        self._next = {}

    def get(self, key: Key) -> str:
        prefix = self._last.get(key)
        if prefix is None:
            prefix = _prefix(key[0], zip(key[1], key[2], strict=True))
        self._next[key] = prefix
        return prefix

    def end(self) -> None:
        self._last, self._next = self._next, {}

    def __len__(self) -> int:
        return len(self._last)


def text_value(v: float) -> str:
    """prometheus_client's ``floatToGoString`` as the text format 0.0.4 writes it."""
    v = float(v)
    if v != v:
        return "NaN"
    if v in (math.inf, -math.inf):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def go_float(v: float) -> str:
    """prometheus_client's ``floatToGoString`` (OpenMetrics)."""
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


def _samples(fam: Metric, out: list[str], prefixes: Prefixes, fmt: Callable[[float], str]) -> None:
    if isinstance(fam, LabelledFamily):
        name, labelnames = fam.sample_name, fam.labelnames
        for values, value in fam.rows:
            out.append(f"{prefixes.get((name, labelnames, values))}{fmt(value)}\n")
    for s in fam.plain_samples:  # added one by one (add_sample), or the name[] filter's
        out.append(f"{_prefix(s.name, s.labels.items())}{fmt(s.value)}\n")


def render_text(families: Iterable[Metric], prefixes: Prefixes | None = None) -> bytes:
    """Prometheus text format 0.0.4, like ``prometheus_client.generate_latest`` (no exemplars,
    timestamps or native histograms to consider)."""
    prefixes = prefixes if prefixes is not None else Prefixes()
    out: list[str] = []
    prefixes.begin()
    for fam in families:
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        doc = fam.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {fam.type}\n")
        _samples(fam, out, prefixes, text_value)
    prefixes.end()
    return "".join(out).encode("utf-8")


def render_openmetrics(families: Iterable[Metric], prefixes: Prefixes | None = None) -> bytes:
    """OpenMetrics 1.0.0 text, like ``prometheus_client.openmetrics.exposition.generate_latest``
    for counter and gauge families whose names are legacy names without ``:``."""
    prefixes = prefixes if prefixes is not None else Prefixes()
    out: list[str] = []
    prefixes.begin()
    for fam in families:
        out.append(f"# HELP {fam.name} {_escape(fam.documentation)}\n# TYPE {fam.name} {fam.type}\n")
        if fam.unit:
            out.append(f"# UNIT {fam.name} {fam.unit}\n")
        _samples(fam, out, prefixes, go_float)
    prefixes.end()
    out.append("# EOF\n")
    return "".join(out).encode("utf-8")
