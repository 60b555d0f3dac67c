"""gpuwatchd's own exposition (exporter/families.py, exporter/formats.py) against client_python's:
the same bytes, the same content-type choice, so dropping prometheus_client from the daemon's
imports (bench/rss.py) changes no scrape."""

from __future__ import annotations

import functools
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as om
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from test_exporter import full_state

from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.exporter.families import CounterMetricFamily, GaugeMetricFamily
from gpuwatchd.exporter.formats import negotiate
from gpuwatchd.exporter.render import render_openmetrics
from gpuwatchd.web.server import serve

ACCEPTS = [
    "",
    "*/*",
    "text/plain",
    "text/plain; version=0.0.4",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=1.0.0;escaping=bogus",
    "application/openmetrics-text;version=0.0.1",
    "application/openmetrics-text;version=0.0.1,text/plain;version=0.0.4",
    "application/openmetrics-text;version=2.0.0",
    "application/openmetrics-text;version=1.0",
    # Prometheus 2.x and 3.x scrape_protocols defaults
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics"
    "-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;"
    "version=0.0.4;q=0.3,*/*;q=0.2",
]


@pytest.mark.parametrize("accept", ACCEPTS)
def test_negotiate_chooses_what_client_python_chooses(accept: str) -> None:
    choice = negotiate(accept)
    encoder, content_type = choose_encoder(accept)
    if choice is None:  # left to client_python: only for what gpuwatchd does not render
        assert ("version=1.0.0" in content_type and "text/plain" in content_type) \
            or "version=2.0.0" in content_type or "escaping=values" in content_type
        return
    fmt, ours = choice
    assert ours == content_type
    base = encoder.func if isinstance(encoder, functools.partial) else encoder
    assert base is (om.generate_latest if fmt == "openmetrics" else generate_latest)


def test_openmetrics_is_client_pythons_bytes_for_the_full_state() -> None:
    state, counters = full_state()
    reg = make_registry(lambda: state, counters)
    ours = reg.encode_openmetrics()
    assert ours == om.generate_latest(reg)
    assert ours == render_openmetrics(reg.collect())
    families = list(text_string_to_metric_families(ours.decode()))  # OpenMetrics parser: valid
    assert {f.name for f in families} >= {"gpuwatch_rank_up", "gpuwatch_oom_kills"}


def test_families_escape_and_format_like_client_python() -> None:
    g = GaugeMetricFamily("gpuwatch_x", 'doc with \\ and "quotes"\nand a newline', labels=["a"])
    g.add_metric(['v"\\\n'], 6008340480.0)
    g.add_metric(["inf"], float("inf"))
    g.add_metric(["nan"], float("nan"))
    g.add_metric(["neg"], -1234567890.5)
    c = CounterMetricFamily("gpuwatch_y_total", "a counter", value=3)

    class Two:
        def collect(self):
            return [g, c]

    assert render_openmetrics([g, c]) == om.generate_latest(Two())
    assert c.name == "gpuwatch_y" and c.samples[0].name == "gpuwatch_y_total"
    with pytest.raises(ValueError):
        g.add_metric(["one", "two"], 1.0)  # more label values than label names


def test_the_daemon_registry_answers_prometheus_in_openmetrics() -> None:
    state, counters = full_state()
    reg = make_registry(lambda: state, counters)
    server = serve(reg, "127.0.0.1:0")
    try:
        port = server.address[1]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
            "Accept": ACCEPTS[-2]})
        with urllib.request.urlopen(req, timeout=10) as r:
            body, ctype = r.read(), r.headers["Content-Type"]
        assert ctype == "application/openmetrics-text; version=1.0.0; charset=utf-8; " \
            "escaping=underscores"
        assert body == om.generate_latest(reg)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.read() == reg.encode_text()
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    finally:
        server.close()


def test_openmetrics_before_the_first_cycle() -> None:
    reg = make_registry(lambda: None, CounterStore())
    assert reg.encode_openmetrics() == om.generate_latest(reg)


def test_renders_reuse_what_did_not_change_and_forget_what_went() -> None:
    """exporter/render.py keeps what the last render wrote: unchanged families are copied, known
    series keep their rendered labels, and the bytes stay client_python's through value changes,
    new and gone series and a -0.0 (== cannot tell it from 0.0)."""
    from prometheus_client import generate_latest as text_latest

    from gpuwatchd.exporter.render import Prefixes, render_text

    def families(ranks: range, cpu: float, zero: float) -> list[GaugeMetricFamily]:
        up = GaugeMetricFamily("gpuwatch_up", "up", labels=["job_id", "rank"])
        used = GaugeMetricFamily("gpuwatch_cpu", "cpu", labels=["job_id", "rank"])
        for r in ranks:
            up.add_metric(["j", str(r)], 1)
            used.add_metric(["j", str(r)], cpu + r)
        z = GaugeMetricFamily("gpuwatch_zero", "zero", labels=["k"])
        z.add_metric(["a"], zero)
        return [up, used, z]

    class Fixed:
        def __init__(self, fams: list[GaugeMetricFamily]) -> None:
            self.fams = fams

        def collect(self) -> list[GaugeMetricFamily]:
            return self.fams

    text, om_cache = Prefixes(), Prefixes()
    steps = [(range(64), 1.5, 0.0), (range(64), 2.5, 0.0), (range(64), 2.5, -0.0),
             (range(8, 40), 3.5, 0.0), (range(8, 40), 3.5, 0.0)]
    for k, step in enumerate(steps):
        built, copied = text.built, text.copied
        assert render_text(families(*step), text) == text_latest(Fixed(families(*step)))
        assert render_openmetrics(families(*step), om_cache) == om.generate_latest(Fixed(families(*step)))
        if k == 1:  # new cpu values: up copied, cpu rendered with the labels it had
            assert text.built == built and text.copied == copied + 2
        if k == 2:  # -0.0 is written anew
            assert text.copied == copied + 2 and b"gpuwatch_zero{k=\"a\"} -0.0" in render_text(
                families(*step), Prefixes())
        if k == 4:
            assert text.built == built and text.copied == copied + 3
        assert len(text) == 2 * len(step[0]) + 1  # only the series of the last render are kept
