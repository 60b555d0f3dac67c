"""The life cycle shared by the event-driven sources that own one thread (the NVML Xid watcher,
the udev watcher): a stop event, one daemon thread, ``error`` for the last problem, and a bounded
``stop``. Each subclass writes ``_run`` (a loop until ``_stop`` is set)."""

from __future__ import annotations

import threading


class WatcherThread:
    thread_name = "gpuwatchd-watcher"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str = ""

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Its thread is started and has not ended (an ended one left its reason in ``error``)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError
