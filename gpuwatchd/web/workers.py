"""The worker threads of the /metrics listener: at most ``max_workers``, started on demand, each
answering one complete request at a time (``serve(conn)``) and handing the connection back through
``done(conn, keep)``; a thread that cannot be started (TasksMax=) while none runs makes ``submit``
say so, and the listener drops the connection as ``no_thread``.

``WorkerPool`` is an object of its own: ``Listener`` (web/listener.py) holds one, and everything it
reads is a constructor argument. Only the listener's loop thread calls ``submit``. Cost: up to
``max_workers`` threads once requests arrive; one deque of connections ready to be answered.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable

from gpuwatchd.isolation import guarded
from gpuwatchd.web.connection import Conn


class WorkerPool:
    """``serve(conn)`` (must not raise) answers ``conn.request``, saying whether to keep the
    connection (None: it handed the connection on, and whoever took it calls ``done``);
    ``done(conn, keep)`` hands the answered connection back to the loop."""

    def __init__(
        self, max_workers: int, serve: Callable[[Conn], bool | None], done: Callable[[Conn, bool], None]
    ) -> None:
        self.max_workers = max_workers
        self.serve = serve
        self.done = done
        self._ready: collections.deque[Conn] = collections.deque()
        self._cv = threading.Condition()
        self._idle_workers = 0
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()

    def submit(self, conn: Conn) -> bool:
        """Queue ``conn`` for a worker, starting one if every running worker is busy. False when
        no thread could be started and none runs: ``conn`` is not queued, the caller drops it."""
        conn.phase = "ready"
        with self._cv:
            self._ready.append(conn)
            need = len(self._ready) > self._idle_workers
            self._cv.notify()
        if not need or len(self._workers) >= self.max_workers:
            return True
        t = threading.Thread(target=self._work, name="gpuwatchd-web-worker", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no thread to be had (TasksMax= reached)
            if self._workers:
                return True  # the running workers will get to it
            with self._cv:
                self._ready.remove(conn)
            return False
        self._workers.append(t)
        return True

    def stop(self) -> None:
        """End every worker once its current answer is done; queued connections stay unanswered
        (the listener closes them as its loop ends)."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()

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
            failed: bool | None = False  # a bug answering: close the connection
            keep = guarded(f"answering {conn.addr}", functools.partial(self.serve, conn), failed)
            if keep is not None:  # None: handed on (to the auth thread), which hands it back
                self.done(conn, keep)
