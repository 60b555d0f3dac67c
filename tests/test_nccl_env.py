"""findings/nccl_env.py's policy on its own: which variables the daemon reads (``WATCHED_VARS``)
and what of their values becomes a flag (``env_flags``); sources/procfs.py only reads them."""

from __future__ import annotations

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import FindingContext, nccl_env
from gpuwatchd.model import RankState


def test_watched_vars_are_the_legacy_names_and_the_error_handling_level() -> None:
    assert set(nccl_env.WATCHED_VARS) == {*nccl_env.RENAMED, "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def test_env_flags_keeps_names_and_only_the_decisive_value() -> None:
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": " 0\n",
        "SECRET": "hunter2",
    }
    assert nccl_env.env_flags(env) == (
        "NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0",
    )
    assert nccl_env.env_flags({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == ()
    assert nccl_env.env_flags({}) == ()


def test_flags_from_values_become_both_findings() -> None:
    r = RankState("j", 0, 10, 0, 1, True, None)
    flags = nccl_env.env_flags({"NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    found = list(nccl_env.find(FindingContext(now=0.0, config=Config(), ranks=(r,), env_flags={10: flags})))
    assert [f.kind for f in found] == ["nccl_legacy_env", "nccl_error_handling_off"]
    assert "NCCL_BLOCKING_WAIT (use TORCH_NCCL_BLOCKING_WAIT)" in found[0].explanation
    assert found[1].evidence["variables"] == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
