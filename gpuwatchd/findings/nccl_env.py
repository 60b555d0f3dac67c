"""nccl_legacy_env and nccl_error_handling_off: NCCL settings that silently do nothing, or that
turn off the watchdog that would turn a hang into an error.

PyTorch 2.2+ renamed NCCL_ASYNC_ERROR_HANDLING, NCCL_BLOCKING_WAIT, NCCL_DESYNC_DEBUG,
NCCL_ENABLE_TIMING and NCCL_DEBUG_INFO_TEMP_FILE to TORCH_NCCL_* (the old names were deprecated,
then ignored; see torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp).

Input: ``ctx.env_flags``, per rank PID the flags ``env_flags`` makes of the values of
``WATCHED_VARS`` (which the daemon asks ``sources/procfs.py`` for, once per rank PID, from
``/proc/PID/environ``): the names of the legacy variables that are set, and
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` when that decisive value is set (no other value leaves the
daemon). Shell equivalent: ``tr '\\0' '\\n' < /proc/PID/environ | grep NCCL``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuwatchd.findings.context import FindingContext, rank_finding, rank_label
from gpuwatchd.model import INFO, WARNING, Finding

# Legacy spellings that torch no longer reads (TORCH_NCCL_DEBUG_INFO_TEMP_FILE is the current name
# of NCCL_DEBUG_INFO_TEMP_FILE; setting it alone without TORCH_NCCL_TRACE_BUFFER_SIZE records nothing).
RENAMED = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE with TORCH_NCCL_TRACE_BUFFER_SIZE",
    # the flight recorder's buffer: renamed for gloo and NCCL alike (torch 2.11 FlightRecorder.hpp
    # reads TORCH_FR_BUFFER_SIZE first, the old name only as a deprecated alias)
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
}
ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ERROR_HANDLING_OFF = f"{ERROR_HANDLING}=0"  # the one value that is decisive: the watchdog is off
# The variables whose values the daemon reads from a rank's environment, for env_flags.
WATCHED_VARS = (*RENAMED, ERROR_HANDLING)


def env_flags(env: Mapping[str, str]) -> tuple[str, ...]:
    """The flags of one rank's environment (``env``: its values of ``WATCHED_VARS``): the legacy
    names that are set, in ``RENAMED``'s order, then ``ERROR_HANDLING_OFF`` when it is 0. Names
    only; no other value is kept."""
    flags = [name for name in RENAMED if name in env]
    if env.get(ERROR_HANDLING, "").strip() == "0":
        flags.append(ERROR_HANDLING_OFF)
    return tuple(flags)


def find(ctx: FindingContext) -> Iterable[Finding]:
    for r in ctx.ranks:
        if not r.alive:
            continue
        flags = ctx.env_flags.get(r.pid, ())
        legacy = [f for f in flags if f in RENAMED]
        if legacy:
            names = ", ".join(f"{f} (use {RENAMED[f]})" for f in legacy)
            yield rank_finding(
                r,
                kind="nccl_legacy_env",
                severity=INFO,
                explanation=f"{rank_label(r)} sets legacy NCCL variable(s) that PyTorch ignores: {names}",
                evidence={"variables": legacy},
            )
        if ERROR_HANDLING_OFF in flags:
            yield rank_finding(
                r,
                kind="nccl_error_handling_off",
                severity=WARNING,
                explanation=(
                    f"{rank_label(r)} runs with TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a failed or "
                    "timed-out collective will hang this rank forever instead of aborting it"
                ),
                evidence={"variables": [ERROR_HANDLING]},
            )
