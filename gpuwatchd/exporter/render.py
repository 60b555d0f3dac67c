"""The text format 0.0.4 and OpenMetrics 1.0.0 renderings of gpuwatchd's families, byte for byte
what ``prometheus_client.generate_latest`` and ``prometheus_client.openmetrics.exposition
.generate_latest`` write for them (tests/test_exposition_formats.py compares them).

Cost: a scrape at 64 ranks is about 1,400 samples in 40 families; about half the families keep
their values from one cycle to the next and the label sets almost never change. So
``Prefixes`` keeps what the last render wrote: an unchanged family is copied, and in a changed one
a series costs a dictionary lookup and its value's ``repr``; sorting and escaping the labels
happens once per new series. It holds exactly the families of the last render (each render
builds the next from what it used), so it never outgrows one exposition, whatever the job churn.
One per format, used under the caller's lock (exporter/collector.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from gpuwatchd.exporter.families import LabelledFamily, Metric


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _prefix(name: str, labels: Iterable[tuple[str, str]]) -> str:
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels))
    return f"{name}{{{pairs}}} " if pairs else f"{name} "


Rows = list[tuple[tuple[str, ...], float]]


class Prefixes:
    """What the last render wrote of each family: its rows (label values and values), the lines
    they gave, and each series' rendered ``name{labels} ``. A family whose rows are what they were
    is copied as it was (``rank_info``, ``rank_up``, limits, most counters between two events); in
    one that changed, a series seen last time costs a dictionary lookup and its value's ``repr``.
    It holds the families of the last render only. One per format (values are written
    differently)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], tuple[Rows, str, dict[tuple[str, ...], str]]] = {}
        self._next: dict[tuple[str, tuple[str, ...]], tuple[Rows, str, dict[tuple[str, ...], str]]] = {}
        self.built = 0  # series prefixes rendered (tests, benchmarks)
        self.copied = 0  # families reused as they were (tests, benchmarks)

    def begin(self) -> None:
        self._next = {}

    def block(self, fam: LabelledFamily, fmt: Callable[[float], str]) -> str:
        """The sample lines of ``fam``."""
        key = (fam.sample_name, fam.labelnames)
        rows = fam.rows
        hit = self._last.get(key)
        # == calls 0.0 and -0.0 equal, which are written differently: a -0.0 is rendered anew
        if hit is not None and hit[0] == rows and not fam.negative_zero:
            self.copied += 1
            self._next[key] = hit
            return hit[1]
        old = hit[2] if hit is not None else {}
        prefixes: dict[tuple[str, ...], str] = {}
        lines = []
        for values, value in rows:
            prefix = old.get(values)
            if prefix is None:
                self.built += 1
                prefix = _prefix(key[0], zip(key[1], values, strict=True))
            prefixes[values] = prefix
            lines.append(f"{prefix}{fmt(value)}\n")
        text = "".join(lines)
        self._next[key] = ([] if fam.negative_zero else rows, text, prefixes)
        return text

    def end(self) -> None:
        self._last, self._next = self._next, {}

    def __len__(self) -> int:
        return sum(len(v[2]) for v in self._last.values())


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
        out.append(prefixes.block(fam, fmt))
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
    # "replace": a label value that cannot be encoded (a lone surrogate) shows as "?" in its own
    # series, never an exception that blanks the whole scrape (issue 23 N2; validated upstream too)
    return "".join(out).encode("utf-8", "replace")


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
    # "replace": a label value that cannot be encoded (a lone surrogate) shows as "?" in its own
    # series, never an exception that blanks the whole scrape (issue 23 N2; validated upstream too)
    return "".join(out).encode("utf-8", "replace")
