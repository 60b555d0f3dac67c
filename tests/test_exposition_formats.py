"""gpuwatchd's own exposition (exporter/render.py, exporter/formats.py, exporter/process.py)
against client_python's, the oracle: the same bytes (random families, every Accept over a real
socket, the name[] filter, process_*), the same content-type choice, so no request needs
prometheus_client at run time (tests/test_run_footprint.py)."""

from __future__ import annotations

import functools
import math
import re
import time
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as om
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from test_exporter import full_state

from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.collector import make_registry
from gpuwatchd.exporter.families import CounterMetricFamily, GaugeMetricFamily
from gpuwatchd.exporter.formats import negotiate
from gpuwatchd.exporter.render import render_openmetrics, render_text
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


ACCEPTS_MORE = [
    "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=underscores",
    "text/plain;version=1.0.0;escaping=values",
    "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=2.0.0;escaping=allow-utf-8",
    "text/plain;version=x.y,application/openmetrics-text",
]


def _served_escaping(fmt: str, content_type: str) -> str:
    """The content type gpuwatchd answers for client_python's choice: an escaping whose bytes
    client_python writes differently for legacy names is answered as underscores (formats.py)."""
    odd = ("dots", "values") if fmt == "openmetrics" else ("dots",)
    return re.sub(
        r"escaping=(\w+)", lambda m: "escaping=underscores" if m.group(1) in odd else m.group(0), content_type
    )


@pytest.mark.parametrize("accept", ACCEPTS + ACCEPTS_MORE)
def test_negotiate_chooses_what_client_python_chooses(accept: str) -> None:
    fmt, ours = negotiate(accept)
    if "x.y" in accept:  # client_python raises TypeError on that version; gpuwatchd passes it over
        with pytest.raises(TypeError):
            choose_encoder(accept)
        assert (fmt, ours) == negotiate("application/openmetrics-text")
        return
    encoder, content_type = choose_encoder(accept)
    assert ours == _served_escaping(fmt, content_type)
    base = encoder.func if isinstance(encoder, functools.partial) else encoder
    assert base is (om.generate_latest if fmt == "openmetrics" else generate_latest)


def _fixed_process() -> list:
    return [GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=7.0)]


@pytest.mark.parametrize("accept", [a for a in ACCEPTS + ACCEPTS_MORE if "x.y" not in a])
def test_served_bytes_are_client_pythons_for_every_accept(accept: str) -> None:
    """What /metrics serves, over a socket, for each Accept: client_python's encoder's bytes for
    the same registry (its escaping replaced as the content type says), its content type."""
    state, counters = full_state()
    reg = make_registry(lambda: state, counters, _fixed_process)
    server = serve(reg, "127.0.0.1:0")
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{server.address[1]}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            body, ctype = r.read(), r.headers["Content-Type"]
    finally:
        server.close()
    fmt, ours = negotiate(accept)
    assert ctype == ours
    encoder, _content_type = choose_encoder(_served_escaping(fmt, accept))
    assert body == encoder(reg)


def test_openmetrics_is_client_pythons_bytes_for_the_full_state() -> None:
    state, counters = full_state()
    reg = make_registry(lambda: state, counters, _fixed_process)
    ours = reg.exposition("openmetrics").body
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
    reg = make_registry(lambda: state, counters, _fixed_process)
    server = serve(reg, "127.0.0.1:0")
    try:
        port = server.address[1]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": ACCEPTS[-2]})
        with urllib.request.urlopen(req, timeout=10) as r:
            body, ctype = r.read(), r.headers["Content-Type"]
        assert ctype == "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
        assert body == om.generate_latest(reg)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.read() == reg.encode_text() == generate_latest(reg)
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    finally:
        server.close()


def test_openmetrics_before_the_first_cycle() -> None:
    reg = make_registry(lambda: None, CounterStore(), _fixed_process)
    assert reg.exposition("openmetrics").body == om.generate_latest(reg)


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
    steps = [
        (range(64), 1.5, 0.0),
        (range(64), 2.5, 0.0),
        (range(64), 2.5, -0.0),
        (range(8, 40), 3.5, 0.0),
        (range(8, 40), 3.5, 0.0),
    ]
    for k, step in enumerate(steps):
        built, copied = text.built, text.copied
        assert render_text(families(*step), text) == text_latest(Fixed(families(*step)))
        assert render_openmetrics(families(*step), om_cache) == om.generate_latest(Fixed(families(*step)))
        if k == 1:  # new cpu values: up copied, cpu rendered with the labels it had
            assert text.built == built and text.copied == copied + 2
        if k == 2:  # -0.0 is written anew
            assert text.copied == copied + 2 and b'gpuwatch_zero{k="a"} -0.0' in render_text(
                families(*step), Prefixes()
            )
        if k == 4:
            assert text.built == built and text.copied == copied + 3
        assert len(text) == 2 * len(step[0]) + 1  # only the series of the last render are kept


# --- random families, byte for byte against client_python ----------------------------------------

_LEGACY = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True)
_LABEL = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}", fullmatch=True)  # no reserved __ prefix
_VALUE_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", "\\", "\n", '"', '\\"\n', "caf\u00e9", "\u2603", "a\\nb"]
)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [
        0.0,
        -0.0,
        1e-9,
        5e-324,
        1.7976931348623157e308,
        1796155037.0781217,
        6008340480.0,
        123456.0,
        1234567.0,
        -1234567.0,
        1e20,
        1e21,
        0.1,
        100.0,
        math.inf,
        -math.inf,
        math.nan,
    ]
)


@st.composite
def _families(draw: st.DrawFn) -> list:
    fams = []
    used: set[str] = set()
    for _ in range(draw(st.integers(1, 4))):
        name = "gw_" + draw(_LEGACY)
        if name in used or any(name.startswith(u) or u.startswith(name) for u in used):
            continue  # client_python refuses clashing names (x and x_total) at registration
        used.add(name)
        labels = draw(st.lists(_LABEL, max_size=3, unique=True))
        doc = draw(_VALUE_TEXT)
        kind = draw(st.sampled_from([GaugeMetricFamily, CounterMetricFamily]))
        fam = kind(name, doc, labels=labels)
        seen = set()
        for _ in range(draw(st.integers(0, 4))):
            values = tuple(draw(_VALUE_TEXT) for _ in labels)
            if values in seen:
                continue
            seen.add(values)
            fam.add_metric(list(values), draw(_FLOAT))
        fams.append(fam)
    return fams


class _Fixed:
    def __init__(self, fams: list) -> None:
        self.fams = fams

    def collect(self) -> list:
        return self.fams


@settings(max_examples=300, deadline=None)
@given(_families())
def test_random_families_render_to_client_pythons_bytes(fams: list) -> None:
    """Label escapes, NaN, +-Inf, -0.0, huge and tiny values, unicode: text 0.0.4, text 1.0.0
    (underscores, allow-utf-8, values: the bytes 0.0.4 writes for legacy names) and OpenMetrics
    1.0.0 (underscores, allow-utf-8), byte for byte."""
    ref = _Fixed(fams)
    text = render_text(fams)
    assert text == generate_latest(ref)
    for escaping in ("underscores", "allow-utf-8", "values"):
        assert text == generate_latest(ref, escaping=escaping)
    ours_om = render_openmetrics(fams)
    for escaping in ("underscores", "allow-utf-8"):
        assert ours_om == om.generate_latest(ref, escaping=escaping)


@settings(max_examples=100, deadline=None)
@given(_families(), st.data())
def test_name_filter_is_client_pythons_restricted_registry(fams: list, data: st.DataObject) -> None:
    """``name[]`` answered from the cycle's rendering (exporter/exposition.py) against
    client_python's ``restricted_registry`` over the same families, in both formats."""
    from prometheus_client import CollectorRegistry

    from gpuwatchd.exporter.exposition import Exposition
    from gpuwatchd.exporter.render import openmetrics_parts, text_parts

    names = sorted({s.name for f in fams for s in f.samples} | {f.name for f in fams})
    wanted = data.draw(st.lists(st.sampled_from([*names, "gw_absent"]), max_size=4))
    from prometheus_client import core

    theirs = []
    for f in fams:  # the same families built with client_python's own classes
        kind = core.CounterMetricFamily if f.type == "counter" else core.GaugeMetricFamily
        t = kind(f.name, f.documentation, labels=list(f.labelnames))
        for values, v in f.rows:
            t.add_metric(list(values), v)
        theirs.append(t)
    reg = CollectorRegistry(auto_describe=True)  # names known from collect(), as gpuwatchd's
    reg.register(_Fixed(theirs))
    restricted = reg.restricted_registry(wanted)
    assert Exposition(text_parts(fams), False).select(wanted) == generate_latest(restricted)
    assert Exposition(openmetrics_parts(fams), True).select(wanted) == om.generate_latest(restricted)


def test_process_metrics_are_process_collectors_on_the_same_process(tmp_path) -> None:
    """process_* as client_python's ProcessCollector writes them, read from one sleeping child
    (its values hold still between the two reads)."""
    import subprocess
    import sys

    from prometheus_client import ProcessCollector

    from gpuwatchd.exporter.process import process_families

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        ours = render_text(process_families(str(child.pid)))
        theirs = generate_latest(_Fixed(list(ProcessCollector(pid=lambda: child.pid, registry=None).collect())))
        assert ours == theirs
        assert sorted(re.findall(rb"^# TYPE (\S+ \S+)", ours, re.M)) == [
            b"process_cpu_seconds_total counter",
            b"process_max_fds gauge",
            b"process_open_fds gauge",
            b"process_resident_memory_bytes gauge",
            b"process_start_time_seconds gauge",
            b"process_virtual_memory_bytes gauge",
        ]
    finally:
        child.kill()
        child.wait()


def test_another_librarys_registry_is_served_as_client_python_writes_it() -> None:
    """A client_python registry (histograms, counters with _created, info) served by gpuwatchd's
    server: the bytes client_python writes, in both formats and through name[]."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, Info

    reg = CollectorRegistry()
    Histogram("gw_req_seconds", "Request time.", registry=reg).observe(0.3)
    Counter("gw_hits", "Hits.", ["a"], registry=reg).labels('x\n"').inc(1796155037.0781217)
    Info("gw_build", "Build.", registry=reg).info({"version": "1"})
    server = serve(reg, "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read() == generate_latest(reg)
        req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.read() == om.generate_latest(reg)
        with urllib.request.urlopen(url + "?name[]=gw_req_seconds_bucket", timeout=10) as r:
            assert r.read() == generate_latest(reg.restricted_registry(["gw_req_seconds_bucket"]))
    finally:
        server.close()
