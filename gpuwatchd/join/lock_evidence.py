"""What the kernel's futex words say about a hung rank's lock-blocked threads, in words (hang.py).

Pure, no I/O: the futex words come from ``/proc/PID/task/TID/syscall`` (sources/taskwait.py).

- Per thread (py-spy joined its Python threads to tasks): a ``threading.Lock`` waiter on Python
  3.10-3.13 sleeps on the lock's own futex word (a ``sem_t`` the lock allocated), so two waiters
  on different words wait on different locks. A wait in CPython 3.13's parking lot (a PyMutex:
  the import lock; PyEvent: ``Thread.join``) sleeps on a semaphore on the waiter's own stack
  instead: its word names the waiter, not the lock, and is not counted as a lock.
- Process-wide (Python 3.10, where py-spy gives no thread ids, #567): every task asleep at ~0 CPU
  and how many untimed futex waits there are is all the kernel can tell.

Cost: linear in the threads of one look.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpuwatchd.model.threads import SyscallWait, ThreadInfo


def locks_text(futexes: Iterable[int], parked: Sequence[str]) -> str:
    """`` (waiting on 2 different locks)`` from the lock words of the blocked threads, and which
    of them (``parked``: their names) waited on a word that cannot say; "" when nothing tells."""
    addresses = set(futexes)
    parts = [f"waiting on {len(addresses)} different locks"] if len(addresses) > 1 else []
    if parked:
        who = ", ".join(f'"{name}"' for name in parked[:3])
        parts.append(
            f"{who} parked in CPython's parking lot (a PyMutex wait, Python 3.13+, e.g. the import "
            "lock): its futex word is on its own stack, so which lock it waits on is unknown"
        )
    return f" ({'; '.join(parts)})" if parts else ""


def unjoined(threads: Sequence[ThreadInfo], shares: Mapping[int, float],
             waits: Mapping[int, SyscallWait], idle_share: float) -> tuple[int, str] | None:  # fmt: skip
    """For Python threads without a tid (py-spy cannot join them to tasks on Python 3.10, #567):
    when every task read sleeps (S) at ~0 CPU since the previous look, how many wait on a futex
    with no time-out, and the words that say so; None when some task runs or is unknown."""
    if not threads or any(t.state != "S" or shares.get(t.tid, 1.0) > idle_share for t in threads):
        return None
    untimed = [w for t in threads if (w := waits.get(t.tid)) is not None and w.untimed_futex]
    words = len({w.address for w in untimed})
    return len(untimed), (
        f" (thread ids not joinable on Python 3.10 (py-spy #567): all {len(threads)} tasks read "
        f"asleep at 0 % CPU, {len(untimed)} in untimed futex waits on {words} different futex "
        "words)")  # fmt: skip
