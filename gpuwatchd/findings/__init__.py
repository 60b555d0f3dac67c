"""Diagnoses: pure functions from one cycle's joined readings to ``Finding`` objects.

One module per kind, named as the kind (``stall`` and ``nccl_env`` raise several). Each exposes
``find(ctx) -> Iterable[Finding]``. Which modules run, and in which order, is the table of kinds
(``gpuwatchd/model/kinds.py``: each row names the module that raises its kind): a row whose module
is missing fails this import, and tests/test_finding_kinds.py fails a module that no row names.
They never touch /proc, NVML or the clock: everything comes in through ``FindingContext``, which is
what lets the tests run them on recorded inputs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from types import ModuleType

from gpuwatchd.findings.context import FindingContext, rank_label
from gpuwatchd.model import Finding
from gpuwatchd.model.kinds import rule_modules
from gpuwatchd.units import fmt_bytes

__all__ = ["LATE_RULES", "MODULES", "RULES", "FindingContext", "evaluate", "fmt_bytes", "rank_label"]

Rule = Callable[[FindingContext], Iterable[Finding]]
# Rules that also read the findings of RULES (rank_straggler names gil_saturated or
# rank_memory_pressure of the same rank as causes): the rows marked ``late``.
LateRule = Callable[[FindingContext, tuple[Finding, ...]], Iterable[Finding]]

MODULES: dict[str, ModuleType] = {
    name: importlib.import_module(f"{__name__}.{name}") for name in (*rule_modules(), *rule_modules(late=True))
}
RULES: list[Rule] = [MODULES[name].find for name in rule_modules()]
LATE_RULES: list[LateRule] = [MODULES[name].find for name in rule_modules(late=True)]


def evaluate(ctx: FindingContext, rules: Iterable[Rule] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for rule in RULES if rules is None else rules:
        out.extend(rule(ctx))
    if rules is None:
        for late in LATE_RULES:
            out.extend(late(ctx, tuple(out)))
    return out
