"""The ranks of this cycle as the kernel-event processor sees them: alive or not, and the world
size, so that a kill's event can say how many of the victim's peers are still alive (they will wait
in their next collective).

``KernelEventProcessor.observe`` replaces the view each cycle (one reference swap: readers in the
kernel-log thread see either the old cycle or the new one, never half). Pure; one dictionary per
cycle, as large as the registered ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuwatchd.model import RankId, RankState


@dataclass(frozen=True)
class RankView:
    alive: bool
    world_size: int | None


class RankPeers:
    def __init__(self) -> None:
        self._ranks: dict[RankId, RankView] = {}

    def update(self, ranks: Sequence[RankState]) -> None:
        self._ranks = {r.rank_id: RankView(r.alive, r.world_size) for r in ranks}

    def live(self) -> Iterable[RankId]:
        """(job id, rank) of every rank registered now, alive or not."""
        return tuple(self._ranks)

    def peers_alive(self, job_id: str, rank: int) -> tuple[int, int | None]:
        """(how many other ranks of ``job_id`` are alive, the rank's world size if known)."""
        ranks = self._ranks
        alive = sum(1 for (j, r), v in ranks.items() if j == job_id and r != rank and v.alive)
        view = ranks.get(RankId(job_id, rank))
        return alive, view.world_size if view else None
