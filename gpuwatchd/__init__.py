"""gpuwatchd: per-node monitoring of GPU training ranks.

The launcher-side API lives here so that a training script needs only ``import gpuwatchd``:
``gpuwatchd.register_rank()`` and ``gpuwatchd.heartbeat(step)`` (see ``gpuwatchd.rank.api``).
They are loaded at first use, so that importing a submodule (the wheel's .pth file imports
``gpuwatchd.rank.autobeat`` at interpreter start-up when GPUWATCHD_HEARTBEAT is set) costs no more
than that submodule. This module imports nothing, not even ``typing`` (5 ms at every start-up of
every Python process of a job with GPUWATCHD_HEARTBEAT=1; tests/test_autobeat.py), nor
``__future__`` (so the one annotation is a string).
"""

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads it by name)
if TYPE_CHECKING:
    from typing import Any

    from gpuwatchd.rank.api import heartbeat, register_rank, unregister_rank

__version__ = "0.1.0"
__all__ = ["__version__", "heartbeat", "register_rank", "unregister_rank"]
_API = ("heartbeat", "register_rank", "unregister_rank")


def __getattr__(name: str) -> "Any":
    if name in _API:
        from gpuwatchd.rank import api

        return getattr(api, name)
    raise AttributeError(f"module 'gpuwatchd' has no attribute {name!r}")
