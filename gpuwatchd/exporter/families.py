"""The metric families a scrape is built from, and the registry that collects them, without
prometheus_client.

``import prometheus_client`` runs its package ``__init__``, which imports its HTTP servers,
push gateway and ASGI/WSGI apps: ssl (libssl, libcrypto), http.server, email, urllib.request,
wsgiref, gzip. That was about 5 MiB of the daemon's resident memory for code a scrape never runs
(bench/rss.py). These classes are the part of ``prometheus_client.metrics_core`` the exporter
uses, with the same attribute names and sample tuples, so ``prometheus_client.generate_latest``
and its parser still read them (tests compare the renderers with it). Families are counters and
gauges only: no exemplars, native histograms or ``_created`` samples.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


class Sample(NamedTuple):
    """prometheus_client's ``Sample`` fields, in its order."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None
    exemplar: Any = None
    native_histogram: Any = None


class Metric:
    """One metric family and its samples (``prometheus_client.Metric``'s attributes)."""

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        if typ not in ("counter", "gauge", "unknown", "info"):
            raise ValueError(f"metric type {typ!r} is not one gpuwatchd exports")
        self.name = name
        self.documentation = documentation
        self.type = typ
        self.unit = unit
        self.plain_samples: list[Sample] = []

    @property
    def samples(self) -> list[Sample]:
        return self.plain_samples

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self.plain_samples = samples

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.plain_samples.append(Sample(name, labels, value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Metric) and (self.name, self.documentation, self.type, self.unit, self.samples) == (
            other.name,
            other.documentation,
            other.type,
            other.unit,
            other.samples,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, like prometheus_client's

    def __repr__(self) -> str:
        return f"Metric({self.name}, {self.documentation}, {self.type}, {self.unit}, {self.samples})"


class LabelledFamily(Metric):
    """A family built like client_python's: one ``value``, or ``labels`` and ``add_metric`` calls.

    Its samples are kept as rows, (label values, float value): a scrape builds about twenty per
    rank, and the renderers (exporter/render.py) read the rows directly, so no label dict or
    ``Sample`` is made unless something reads ``samples`` (client_python's renderers, the
    ``name[]`` filter). ``add_metric`` checks what the text formats cannot carry (a label value
    that is not a string, a value ``float()`` refuses) when the family is built, inside the
    scrape's isolation wrapper, rather than half-way through writing the response."""

    suffix = ""  # what each sample's name adds to the family's

    def __init__(
        self, name: str, documentation: str, typ: str, value: float | None, labels: Sequence[str] | None, unit: str
    ) -> None:
        super().__init__(name, documentation, typ, unit)
        if labels is not None and value is not None:
            raise ValueError("give at most one of value and labels")
        self.labelnames = tuple(labels or ())
        self.sample_name = self.name + self.suffix
        self.rows: list[tuple[tuple[str, ...], float]] = []
        self.negative_zero = False  # a -0.0 among the values (== cannot tell it from 0.0)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        values = tuple(labels)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(values)} label values for labels {self.labelnames}")
        try:
            "".join(values)  # the C check that every label value is a str (about 20 a rank)
        except TypeError:
            raise TypeError(f"{self.name}: label values {values!r} are not all strings") from None
        number = float(value)
        if not number and math.copysign(1.0, number) < 0:
            self.negative_zero = True
        self.rows.append((values, number))

    @property
    def samples(self) -> list[Sample]:
        names, sample = self.labelnames, self.sample_name
        rows = [Sample(sample, dict(zip(names, values, strict=True)), v) for values, v in self.rows]
        return rows + self.plain_samples

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self.rows = []
        self.plain_samples = samples


class GaugeMetricFamily(LabelledFamily):
    def __init__(
        self,
        name: str,
        documentation: str,
        value: float | None = None,
        labels: Sequence[str] | None = None,
        unit: str = "",
    ) -> None:
        super().__init__(name, documentation, "gauge", value, labels, unit)


class CounterMetricFamily(LabelledFamily):
    """A counter: the family is named without ``_total``, its samples with it."""

    suffix = "_total"

    def __init__(
        self,
        name: str,
        documentation: str,
        value: float | None = None,
        labels: Sequence[str] | None = None,
        unit: str = "",
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", value, labels, unit)


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class Registry:
    """Collects its collectors in the order registered (what ``CollectorRegistry.collect`` does
    for collectors that describe nothing)."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []
        self._lock = threading.Lock()

    def register(self, collector: Collector) -> None:
        with self._lock:
            if collector in self._collectors:
                raise ValueError(f"{collector!r} is registered already")
            self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        with self._lock:
            self._collectors.remove(collector)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            collectors = list(self._collectors)
        for c in collectors:
            yield from c.collect()
