"""The /proc GIL-convoy signature of one process (research §2.3), from two thread snapshots.

Pure: two ``ThreadInfo`` tuples (sources/threads.py, read by daemon/gil.py's probe) in, a
``ConvoyHint`` out; cost linear in the number of threads, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.model.threads import ThreadInfo

CONVOY_CORES = (0.3, 1.4)  # a GIL convoy uses about one core in total (see convoy_hint)
BUSY_THREAD_CORES = 0.8  # one thread on CPU this much of the time: a Python-bound loop, maybe


@dataclass(frozen=True)
class ConvoyHint:
    """The /proc convoy signature of one process over one probe window."""

    busy_threads: int  # threads that got > 5 % of a core
    total_cores: float  # CPU of all threads together, in cores
    futex_parked: int  # busy threads that sat in a futex wait at the probe
    convoy: bool
    busiest_cores: float = 0.0  # the busiest thread's CPU, in cores

    @property
    def busy_thread(self) -> bool:
        """One thread at about a full core (what a GIL-bound single-threaded loop shows)."""
        return self.busiest_cores >= BUSY_THREAD_CORES


def convoy_hint(
    before: tuple[ThreadInfo, ...], after: tuple[ThreadInfo, ...], seconds: float, clk_tck: int
) -> ConvoyHint:
    """Compare two thread snapshots ``seconds`` apart (research §2.3).

    Convoy: >= 2 busy threads sharing the CPU about evenly (each 0.4-2.5 times the mean share),
    together 0.3-1.4 cores (they share one GIL; real parallelism adds up to more; the lower bound is
    low because a loaded node gives the convoy less than a core), and at least half of them found
    parked in a futex at one of the two looks. Kernel wchan names differ (``futex_wait_queue_me``
    <= 5.x, ``futex_do_wait`` 6.18), so any wchan containing "futex" counts.
    """
    if seconds <= 0:
        return ConvoyHint(0, 0.0, 0, False)
    prev = {t.tid: t for t in before}
    shares = []
    parked = 0
    for t in after:
        if (b := prev.get(t.tid)) is None:
            continue
        share = (t.cpu_ticks - b.cpu_ticks) / clk_tck / seconds
        if share > 0.05:
            shares.append(share)
            # at either look: a thread waiting for the GIL is woken every switch interval to ask
            # for it, so one look often finds it runnable (more so on a busy node), not parked
            if any(x.state == "S" and "futex" in x.wchan for x in (b, t)):
                parked += 1
    n = len(shares)
    total = sum(shares)
    convoy = (
        n >= 2
        and CONVOY_CORES[0] <= total <= CONVOY_CORES[1]
        and all(0.4 * total / n <= s <= 2.5 * total / n for s in shares)
        and parked >= max(1, n // 2)
    )
    return ConvoyHint(n, round(total, 3), parked, convoy, round(max(shares, default=0.0), 3))
