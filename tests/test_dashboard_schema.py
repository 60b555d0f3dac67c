"""The dashboards against Grafana's own schema: grafana-foundation-sdk (11.6, the Python models
Grafana generates from the schema it validates dashboards with) loads each file and writes it
back. A field the schema requires and the file omits comes back added, with the schema's default
(a timeseries legend without showLegend comes back with showLegend false: every legend off); a
field the schema does not know comes back dropped. The round trip must change nothing, except
what the schema leaves to others, listed in ALLOWED with the reason."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from promstack import DASHBOARDS

plugins.register_default_plugins()  # the panel plugins' options and fieldConfig models

# (change, path with list indexes as []) -> why it is not a defect of the file
ALLOWED = {
    (
        "dropped",
        ".templating.list[].definition",
    ): "the query text Grafana's variable editor writes beside `query`; not in the schema",
    **{
        (
            "dropped",
            f".annotations.list[].{k}",
        ): "a Prometheus annotation's own query field: the schema leaves those to the data source"
        for k in ("step", "titleFormat", "textFormat", "tagKeys", "useValueForTime")
    },
}
# FieldConfig.links is an untyped list in the schema; the SDK models each data link as a
# dashboard link and adds that type's fields (type, asDropdown, icon ...) to it.
DATA_LINK = re.compile(r"^added \.panels\[\]\.fieldConfig\.defaults\.links\[\]\.\w+$")


def _walk(a: Any, b: Any, path: str, out: list[tuple[str, str, Any]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            p = f"{path}.{k}"
            if k not in b:
                out.append(("dropped", p, a[k]))
            elif k not in a:
                out.append(("added", p, b[k]))
            else:
                _walk(a[k], b[k], p, out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(("changed", path, (a, b)))


def round_trip_changes(raw: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """What a load into the schema's models and a write back changes, allowed ones left out."""
    back = json.loads(JSONEncoder(sort_keys=True).encode(Dashboard.from_json(raw)))
    out: list[tuple[str, str, Any]] = []
    _walk(raw, back, "", out)
    kept = []
    for change, path, value in out:
        generic = re.sub(r"\[\d+\]", "[]", path)
        if (change, generic) in ALLOWED or DATA_LINK.match(f"{change} {generic}"):
            continue
        kept.append((change, path, value))
    return kept


@pytest.mark.parametrize("name", ["gpuwatchd-node.json", "gpuwatchd-job.json", "gpuwatchd-health.json"])
def test_round_trip_through_the_schema_changes_nothing(name: str) -> None:
    raw = json.loads((DASHBOARDS / name).read_text())
    assert round_trip_changes(raw) == []


def test_the_oracle_sees_an_omitted_required_field() -> None:
    """What the dashboards omitted before: a legend without showLegend comes back turned off, a
    stat panel without its layout options comes back with them, an unknown key is dropped."""
    raw = json.loads((DASHBOARDS / "gpuwatchd-node.json").read_text())
    ts = next(p for p in raw["panels"] if p["type"] == "timeseries")
    del ts["options"]["legend"]["showLegend"]
    st = next(p for p in raw["panels"] if p["type"] == "stat")
    del st["options"]["wideLayout"]
    raw["notAField"] = 1
    got = {(c, re.sub(r"\[\d+\]", "[]", p), v) for c, p, v in round_trip_changes(raw)}
    assert got == {
        ("added", ".panels[].options.legend.showLegend", False),
        ("added", ".panels[].options.wideLayout", True),
        ("dropped", ".notAField", 1),
    }


def test_the_sdk_is_the_pinned_grafana_version() -> None:
    """`pip install grafana-foundation-sdk` alone takes the highest epoch, the 10.1 types."""
    from importlib.metadata import version

    assert version("grafana-foundation-sdk").endswith("!11.6.0")
