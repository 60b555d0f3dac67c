"""A part the daemon does not run: what ``daemon/wiring.py: Parts`` holds in the slot of a part
whose config section is off (and in every slot of a one-cycle reader such as ``gpuwatchd ps``).

It starts nothing, its hooks do nothing, and its ``track`` gives the default output of its slot,
which carries no collector status: no ``gpuwatch_collector_*`` series is exported for it, as for
a part that is not there. The track stage calls it like any other part. Costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpuwatchd.daemon.subsystem import Subsystem

T = TypeVar("T")


@dataclass(frozen=True)
class Off(Subsystem, Generic[T]):
    """The part named ``name`` (its collector label), off: ``track`` returns ``output``."""

    name: str = field()  # required: not ``Subsystem.name``'s "subsystem"
    output: T = field()

    def track(self, *_: object) -> T:
        return self.output
