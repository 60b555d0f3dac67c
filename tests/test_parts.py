"""Each reading is declared once: in the output of the part that produces it (model/parts.py),
which the rules read as it is (``FindingContext.parts``), never copied into a record of its own
on the way (the relay of ``CycleInputs``/``RuleReadings`` re-declared 14 names in three or more
records)."""

from __future__ import annotations

import collections
import dataclasses
import typing

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import parts

OWN_STATUS = "status"  # each part's collector status, one per part by design


def declared() -> dict[str, list[str]]:
    """Field name -> the records that declare it: every part's output and the rules' context."""
    hints = typing.get_type_hints(parts.Tracked, vars(parts))
    outputs = [t for name, t in hints.items() if dataclasses.is_dataclass(t)]
    where: dict[str, list[str]] = collections.defaultdict(list)
    for record in (*outputs, FindingContext):
        for f in dataclasses.fields(record):
            where[f.name].append(record.__name__)
    return where


def test_every_reading_is_declared_once() -> None:
    where = declared()
    assert len({r for names in where.values() for r in names}) == 9  # eight outputs and the context
    twice = {name: records for name, records in where.items() if len(records) > 1 and name != OWN_STATUS}
    assert twice == {}


def test_the_rules_read_the_parts_outputs_as_they_are() -> None:
    (field,) = [f for f in dataclasses.fields(FindingContext) if f.name == "parts"]
    assert field.type in ("Tracked", parts.Tracked)
    assert declared()["gil"] == ["StallOutput"]  # the stall part's reading, only there
