"""Each reading is declared once: in the output of the part that produces it (model/parts.py),
which the rules read as it is (``FindingContext.parts``), never copied into a record of its own
on the way (the relay of ``CycleInputs``/``RuleReadings`` re-declared 14 names in three or more
records). Every slot of ``Parts`` holds a part, ``Off`` where its config section is off."""

from __future__ import annotations

import collections
import dataclasses
import typing
from pathlib import Path

from daemonutil import write_config

from gpuwatchd.config.schema import load_config
from gpuwatchd.daemon.core import Daemon
from gpuwatchd.daemon.off import Off
from gpuwatchd.daemon.wiring import Parts, build_parts
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


def test_a_part_that_is_off_holds_its_slot_and_reports_no_collector(tmp_path: Path) -> None:
    """Every slot of ``Parts`` holds a part: one whose config section is off is ``Off``, which the
    track stage calls like the others and which exports no collector, as no part at all did."""
    path, _ = write_config(
        tmp_path,
        memory={"enabled": False},
        straggler={"enabled": False},
        stall={"flight_recorder": False, "nccl_ras": False},
    )
    d = Daemon(load_config(str(path)), parts=build_parts, write_state=False)
    try:
        off = {f.name for f in dataclasses.fields(Parts) if isinstance(getattr(d.parts, f.name), Off)}
        assert off == {"nvml", "memory", "straggler", "flight_recorder", "nccl_ras"}
        assert len(d.subsystems) == len(dataclasses.fields(Parts))  # hooks: each slot the same way
        state = d.cycle()
        assert state.node_memory is None and state.rank_memory == ()  # the default output
        reported = {c.name for c in state.collectors}
        assert {"pyspy", "kernel_log"} <= reported  # the parts that run report theirs
        assert reported.isdisjoint({"nvml", "memory", "straggler", "flight_recorder", "nccl_ras"})
        assert d.failed_subsystems == {}
    finally:
        d.shutdown()
