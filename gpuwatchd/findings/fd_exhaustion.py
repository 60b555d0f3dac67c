"""fd_exhaustion: a rank close to RLIMIT_NOFILE, or growing towards it.

Fires when open/soft-limit >= ``fds.ratio_threshold`` (0.9), or when the growth rate measured by the
daemon reaches the soft limit within ``fds.horizon_seconds`` (1 h). Input: the rank process's fd
count (``stat /proc/PID/fd``) and soft limit (``/proc/PID/limits``).
Shell equivalent: ``ls /proc/PID/fd | wc -l; grep 'open files' /proc/PID/limits``.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwatchd.findings.context import FindingContext, rank_finding, rank_label
from gpuwatchd.model import WARNING, Finding


def find(ctx: FindingContext) -> Iterable[Finding]:
    cfg = ctx.config.fds
    for r in ctx.ranks:
        p = r.process
        if not r.alive or p is None or p.open_fds is None or not p.max_fds_soft:
            continue
        ratio = p.open_fds / p.max_fds_soft
        rate = ctx.fd_rates.get(r.rank_id, 0.0)
        eta = (p.max_fds_soft - p.open_fds) / rate if rate > 0 else None
        if ratio >= cfg.ratio_threshold:
            why = f"{p.open_fds} of {p.max_fds_soft} allowed fds open ({ratio:.0%})"
        elif eta is not None and eta <= cfg.horizon_seconds:
            why = (
                f"{p.open_fds} of {p.max_fds_soft} fds open and growing by {rate * 60:.1f}/min: "
                f"the limit is reached in about {eta / 60:.0f} min"
            )
        else:
            continue
        yield rank_finding(
            r,
            kind="fd_exhaustion",
            severity=WARNING,
            explanation=f"{rank_label(r)}: {why}; next open() fails with 'Too many open files'",
            evidence={"open_fds": p.open_fds, "soft_limit": p.max_fds_soft, "fds_per_second": round(rate, 4)},
        )
