"""A rank's worker processes (its descendants: DataLoader and compile workers), for hang.py.

``RankWorkers`` remembers, per rank process, which workers it had (every cycle, from the
descendants the daemon reads anyway: no I/O), so that a worker that died while the rank still beat
is known as dead when the rank starves; their CPU between looks (the busiest one tells that
Inductor is compiling in a worker); and, only while the rank is judged stalled, each worker's
context switches (``/proc/PID/status``, read by the caller's ``context_switches``:
sources/stall_looks.py): a worker that was not woken once between two looks is blocked. CPU time
cannot tell that: a producer that sleeps between batches uses ~0 CPU too. Memory: at most
``MAX_REMEMBERED`` pids per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatchd.model.stall import WorkerView

MAX_REMEMBERED = 64  # worker pids remembered per rank (to tell "died" from "never had")
Worker = tuple[int, str, float]  # (pid, /proc state, CPU seconds)


def worker_view(
    seen: Iterable[int],
    now: Mapping[int, tuple[str, int | None]],
    before: Mapping[int, int],
) -> WorkerView:
    """``seen``: every worker pid remembered for this rank process; ``now``: pid -> (state,
    context switches or None) of the live ones; ``before``: pid -> context switches at the previous
    look."""
    seen = tuple(sorted(set(seen) | set(now)))
    gone = tuple(p for p in seen if p not in now or now[p][0] in ("Z", "X"))
    stopped = tuple(p for p in seen if p in now and now[p][0] in ("T", "t"))
    blocked, running = [], []
    for p in seen:
        if p in gone or p in stopped:
            continue
        state, switches = now[p]
        if state != "R" and switches is not None and before.get(p) == switches:
            blocked.append(p)
        else:
            running.append(p)
    return WorkerView(len(seen), gone, stopped, tuple(blocked), tuple(running))


@dataclass
class RankWorkers:
    seen: dict[int, float] = field(default_factory=dict)  # pid -> last time seen alive
    cpu: dict[int, float] | None = None  # None before the first look
    switches: dict[int, int] = field(default_factory=dict)

    def remember(self, now: float, workers: Sequence[Worker]) -> None:
        for pid, state, _ in workers:
            if state not in ("Z", "X"):
                self.seen[pid] = now
        if len(self.seen) > MAX_REMEMBERED:
            for pid in sorted(self.seen, key=self.seen.__getitem__)[: len(self.seen) - MAX_REMEMBERED]:
                del self.seen[pid]

    def busiest(self, workers: Sequence[Worker], elapsed: float) -> float | None:
        """The busiest worker's CPU share since the previous call (None: none known). A worker
        that appeared since then counts with all its CPU: Inductor runs the C++ compiler (and
        Triton its compile workers) as short-lived children, a new pid every few seconds."""
        live = {pid: cpu for pid, state, cpu in workers if state not in ("Z", "X")}
        out = None
        if elapsed > 0 and self.cpu is not None:
            out = max(((cpu - self.cpu.get(pid, 0.0)) / elapsed for pid, cpu in live.items()),
                      default=None)  # fmt: skip
        self.cpu = live
        return out

    def view(self, context_switches: Callable[[int], int | None], workers: Sequence[Worker]) -> WorkerView | None:
        """Dead / stopped / blocked / running; None when the rank never had a worker.
        ``context_switches``: a worker pid -> its voluntary + involuntary switches, None unknown."""
        if not self.seen:
            return None
        live = {pid: (state, context_switches(pid)) for pid, state, _ in workers}
        out = worker_view(self.seen, live, self.switches)
        self.switches = {pid: n for pid, (_, n) in live.items() if n is not None}
        return out
