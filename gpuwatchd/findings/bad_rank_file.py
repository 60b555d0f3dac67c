"""bad_rank_file: a rank file that was refused (unreadable, invalid, untrusted), with the reason.

Input: the rank-file reader's rejections and the join's trust refusals. The daemon keeps going
with the good files beside it. Shell equivalent: ``python -m json.tool FILE; stat FILE``.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext
from gpuwatchd.model import INFO, Finding


def find(ctx: FindingContext) -> Iterable[Finding]:
    seen: set[str] = set()
    for bad in (*ctx.bad_files, *ctx.refused):
        key = f"{bad.path}\0{bad.reason}"
        if key in seen:
            continue
        seen.add(key)
        yield Finding(
            kind="bad_rank_file",
            severity=INFO,
            explanation=(
                f"rank claim from {bad.path} refused: {bad.reason}"
                if bad.path.startswith("discovery")
                else f"rank file {bad.path} skipped: {bad.reason}"
            ),
            evidence={"path": bad.path, "reason": bad.reason},
        )
