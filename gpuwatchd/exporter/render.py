"""The text format (0.0.4, and 1.0.0: the same bytes for legacy names) and OpenMetrics 1.0.0
renderings of metric families: the bytes ``prometheus_client.generate_latest`` and
``prometheus_client.openmetrics.exposition.generate_latest`` (client_python 0.26) write for the
same families, for legacy metric and label names (gpuwatchd's; OpenMetrics: without ``:``) with
``underscores`` or ``allow-utf-8`` escaping, no exemplars. Values are written with
client_python's ``floatToGoString`` (``go_float``) in both formats. tests/test_exposition_formats.py
byte-compares random families with client_python, and tests/test_golden_exposition.py pins what
``/metrics`` serves. The renderings are kept as ``Part``s, one per family, so that a ``name[]``
filter is a selection from this cycle's rendering (``select``), not a render of its own.

Cost: a scrape at 64 ranks is about 1,400 samples in 40 families; about half the families keep
their values from one cycle to the next and the label sets almost never change. So
``Prefixes`` keeps what the last render wrote: an unchanged family is copied, and in a changed one
a series costs a dictionary lookup and its value's ``floatToGoString``; sorting and escaping the labels
happens once per new series. It holds exactly the families of the last render (each render
builds the next from what it used), so it never outgrows one exposition, whatever the job churn.
One per format, used under the caller's lock (exporter/collector.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

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
    one that changed, a series seen last time costs a dictionary lookup and its value's
    ``go_float``. It holds the families of the last render only. One per format (each holds the
    lines of its own format)."""

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


def go_float(v: float) -> str:
    """prometheus_client's ``floatToGoString``, as both of its text renderers write a value."""
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
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


class Part(NamedTuple):
    """One family of a rendering: its HELP/TYPE (and UNIT) lines, its sample lines, the names of
    its samples (what ``name[]`` selects by) and whether every sample line bears one of them
    (``uniform``: a LabelledFamily's rows; else lines are picked one by one)."""

    header: str
    lines: str
    names: frozenset[str]
    uniform: bool


_OM_ONLY = ("_created", "_gsum", "_gcount")  # client_python moves these into gauges of their own
_TEXT_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}


def _plain_line(s: Any, fmt: Callable[[float], str], om: bool) -> str:
    ts = ""
    if s.timestamp is not None:
        ts = f" {s.timestamp}" if om else f" {int(float(s.timestamp) * 1000):d}"
    return f"{_prefix(s.name, s.labels.items())}{fmt(s.value)}{ts}\n"


def _plain(fam: Any) -> list[Any]:
    # gpuwatchd's families keep add_sample()'s samples apart from their rows; another library's
    # family (a test's client_python registry) has only ``samples``.
    return fam.plain_samples if isinstance(fam, Metric) else list(fam.samples)


def _names(fam: Any) -> frozenset[str]:
    names = {s.name for s in _plain(fam)}
    if isinstance(fam, LabelledFamily) and fam.rows:
        names.add(fam.sample_name)
    return frozenset(names)


def text_parts(families: Iterable[Metric], prefixes: Prefixes | None = None) -> list[Part]:
    """The text format's families, as ``prometheus_client.generate_latest`` writes them
    (0.0.4, and 1.0.0 for legacy names: the same bytes)."""
    prefixes = prefixes if prefixes is not None else Prefixes()
    parts: list[Part] = []
    prefixes.begin()
    for fam in families:
        name, typ = fam.name, fam.type
        if typ == "counter":
            name += "_total"
        elif typ == "info":
            name += "_info"
        typ = _TEXT_TYPES.get(typ, typ)
        doc = fam.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        header = f"# HELP {name} {doc}\n# TYPE {name} {typ}\n"
        block = prefixes.block(fam, go_float) if isinstance(fam, LabelledFamily) else ""
        plain = _plain(fam)
        if not plain:
            uniform = isinstance(fam, LabelledFamily)
            parts.append(Part(header, block, _names(fam), uniform))
            continue
        names = _names(fam)
        lines: list[str] = [block]
        extra: dict[str, list[str]] = {}
        for s in plain:
            suffix = next((x for x in _OM_ONLY if s.name == fam.name + x), None)
            (extra.setdefault(suffix, []) if suffix else lines).append(_plain_line(s, go_float, False))
        parts.append(Part(header, "".join(lines), names, False))
        for suffix, more in sorted(extra.items()):
            gauge = fam.name + suffix
            parts.append(Part(f"# HELP {gauge} {doc}\n# TYPE {gauge} gauge\n", "".join(more), names, False))
    prefixes.end()
    return parts


def openmetrics_parts(families: Iterable[Metric], prefixes: Prefixes | None = None) -> list[Part]:
    """OpenMetrics 1.0.0's families (``# EOF`` not included), as
    ``prometheus_client.openmetrics.exposition.generate_latest`` writes them for legacy names
    without ``:`` (no exemplars: gpuwatchd attaches none)."""
    prefixes = prefixes if prefixes is not None else Prefixes()
    parts: list[Part] = []
    prefixes.begin()
    for fam in families:
        header = f"# HELP {fam.name} {_escape(fam.documentation)}\n# TYPE {fam.name} {fam.type}\n"
        if fam.unit:
            header += f"# UNIT {fam.name} {fam.unit}\n"
        block = prefixes.block(fam, go_float) if isinstance(fam, LabelledFamily) else ""
        plain = _plain(fam)
        lines = block + "".join(_plain_line(s, go_float, True) for s in plain)
        parts.append(Part(header, lines, _names(fam), isinstance(fam, LabelledFamily) and not plain))
    prefixes.end()
    return parts


EOF = "# EOF\n"


def join(parts: Iterable[Part], om: bool) -> bytes:
    # "replace": a label value that cannot be encoded (a lone surrogate) shows as "?" in its own
    # series, never an exception that blanks the whole scrape
    return ("".join(p.header + p.lines for p in parts) + (EOF if om else "")).encode("utf-8", "replace")


def _sample_name(line: str) -> str:
    end = len(line)
    for sep in "{ ":
        i = line.find(sep)
        if 0 <= i < end:
            end = i
    return line[:end]


def select(parts: Iterable[Part], names: Iterable[str], om: bool) -> bytes:
    """client_python's ``name[]`` filter (``restricted_registry``) over a rendering: the
    families with a sample of a listed name, and of them only such samples."""
    wanted = set(names)
    out: list[str] = []
    for p in parts:
        if not p.names & wanted:
            continue
        out.append(p.header)
        if p.uniform:
            out.append(p.lines)
        else:
            out.extend(f"{line}\n" for line in p.lines.splitlines() if _sample_name(line) in wanted)
    if om:
        out.append(EOF)
    return "".join(out).encode("utf-8", "replace")


def render_text(families: Iterable[Metric], prefixes: Prefixes | None = None) -> bytes:
    """Prometheus text format 0.0.4: the bytes ``prometheus_client.generate_latest`` writes."""
    return join(text_parts(families, prefixes), False)


def render_openmetrics(families: Iterable[Metric], prefixes: Prefixes | None = None) -> bytes:
    """OpenMetrics 1.0.0 text: the bytes ``prometheus_client.openmetrics.exposition
    .generate_latest`` writes (legacy names without ``:``)."""
    return join(openmetrics_parts(families, prefixes), True)


def render(families: Iterable[Metric], fmt: str) -> bytes:
    """``render_text`` (fmt ``"text"``) or ``render_openmetrics``, with no cache."""
    return render_openmetrics(families) if fmt == "openmetrics" else render_text(families)
