"""gpuwatchd: per-node monitoring of GPU training ranks.

The launcher-side API lives here so that a training script needs only ``import gpuwatchd``:
``gpuwatchd.register_rank()`` and ``gpuwatchd.heartbeat(step)`` (see ``gpuwatchd.rank.api``).
"""

from gpuwatchd.rank.api import heartbeat, register_rank, unregister_rank

__version__ = "0.1.0"
__all__ = ["__version__", "heartbeat", "register_rank", "unregister_rank"]
