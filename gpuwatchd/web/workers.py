"""The worker threads of the /metrics listener: at most ``Limits.max_workers``, started on demand,
each answering one complete request at a time (``serve(conn)``) and handing the connection back
to the loop; a thread that cannot be started (TasksMax=) drops the connection as ``no_thread``.
``Listener`` (web/listener.py) inherits this; only its loop thread calls ``_dispatch``.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable

from gpuwatchd.isolation import guarded
from gpuwatchd.web.connection import Conn, DropLog, Limits


class WorkersMixin:
    """What of the ``Listener`` its workers share with the loop."""

    limits: Limits
    serve: Callable[[Conn], bool]
    drops: DropLog
    _busy: dict[Conn, None]
    _back: collections.deque[tuple[Conn, bool]]
    _ready: collections.deque[Conn]
    _cv: threading.Condition
    _idle_workers: int
    _workers: list[threading.Thread]
    _stop: threading.Event

    def _wake(self) -> None:
        raise NotImplementedError

    def _dispatch(self, conn: Conn) -> None:
        conn.phase = "ready"
        with self._cv:
            self._ready.append(conn)
            need = len(self._ready) > self._idle_workers
            self._cv.notify()
        if not need or len(self._workers) >= self.limits.max_workers:
            return
        t = threading.Thread(target=self._work, name="gpuwatchd-web-worker", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no thread to be had (TasksMax= reached)
            if self._workers:
                return  # the running workers will get to it
            with self._cv:
                self._ready.remove(conn)
            del self._busy[conn]
            conn.sock.close()
            self.drops.drop("no_thread", conn.addr)
            return
        self._workers.append(t)

    def _work(self) -> None:
        while True:
            with self._cv:
                self._idle_workers += 1
                while not self._ready and not self._stop.is_set():
                    self._cv.wait()
                self._idle_workers -= 1
                if self._stop.is_set():
                    return
                conn = self._ready.popleft()
            conn.phase = "active"
            keep = guarded(f"answering {conn.addr}", functools.partial(self.serve, conn), False)
            self._back.append((conn, keep))
            self._wake()
