"""The isolation wrapper: the one place in gpuwatchd that catches every exception.

Failure is data (node_exporter's ``collector.go: execute``): a source that raises, hangs or returns
garbage marks itself down in ``gpuwatch_collector_success{collector}`` with the reason, keeps its
last good reading until that is too old, and never takes the daemon, the other sources or the
scrape down. ``guarded`` does the same for one metric family at scrape time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gpuwatchd.model import CollectorStatus

# In a CollectorStatus.error: the collector's call outlived its time-out (/-/ready reads it).
STILL_RUNNING = "(call still running)"
log = logging.getLogger(__name__)
T = TypeVar("T")
# A collector's worker thread that got no call for this long (or twice its time-out) ends; the
# next run() starts another. The daemon calls each collector every cycle, so this only bounds the
# threads of collectors nobody runs any more (a Daemon dropped without shutdown()).
IDLE_WORKER_SECONDS = 60.0


class NotPresent(Exception):
    """Raised by a source whose subject is absent on this host (no NVIDIA driver, no journal).

    Not an error: the collector is down, logged at debug level only.
    """


class PartialReading(Exception):
    """Raised by a source that read part of its subject: ``value`` is used for this cycle, the
    collector is reported down with the message (e.g. the rank directory is gone while discovery
    from /proc still works). The last good reading is not replaced by a partial one."""

    def __init__(self, value: Any, message: str) -> None:
        super().__init__(message)
        self.value = value


@dataclass
class _Call(Generic[T]):
    started: float
    finished: threading.Event
    result: T | None = None
    error: BaseException | None = None
    done: bool = False


class Collector(Generic[T]):
    """Runs ``fn`` with a time-out in a worker thread and records its health.

    A call that outlives its time-out is left to finish in the background (a hung NVML call cannot
    be cancelled from Python); until it returns, no second call is started and the collector
    reports ``timed out``. The worker thread (``collector-<name>``) sleeps in a queue between
    calls, so a cycle does not pay for a new thread per collector; it ends after
    ``idle_seconds`` (or two time-outs) without a call, or at ``close()`` (after the call it is in, if any).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[], T],
        timeout: float,
        max_age: float,
        clock: Callable[[], float] = time.time,
        idle_seconds: float = IDLE_WORKER_SECONDS,
    ) -> None:
        self.name = name
        self.fn = fn
        self.idle_seconds = idle_seconds
        self.timeout = timeout
        self.max_age = max_age
        self.clock = clock
        self.last_good: T | None = None
        self.last_good_at: float | None = None
        self.status = CollectorStatus(name, False, 0.0, None, "not run yet")
        self._call: _Call[T] | None = None
        self._logged_error = ""
        self._requests: queue.SimpleQueue[_Call[T] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()  # who serves the queue: run() and an idle worker agree

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            try:  # idle twice as long as a call may take: the next cycle comes first
                call = self._requests.get(timeout=max(self.idle_seconds, 2 * self.timeout))
            except queue.Empty:
                with self._lock:  # nothing was queued meanwhile: end (run() starts another)
                    if self._requests.empty():
                        if self._worker is me:
                            self._worker = None
                        return
                continue
            if call is None:
                return
            try:
                call.result = self.fn()
            except BaseException as e:  # noqa: BLE001 - the isolation wrapper: every failure is data
                call.error = e
            finally:
                call.done = True
                call.finished.set()

    def close(self) -> None:
        """End the worker thread: at once when idle, else when its call returns."""
        with self._lock:
            if self._worker is not None:
                self._requests.put(None)
                self._worker = None

    def _submit(self, call: _Call[T]) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name=f"collector-{self.name}", daemon=True)
                self._worker.start()
            self._requests.put(call)

    def run(self) -> T | None:
        """One collection. Returns the fresh reading, or the last good one while it is recent."""
        t0 = time.monotonic()
        call = self._call
        if call is None or call.done:
            call = _Call(t0, threading.Event())
            self._call = call
            self._submit(call)
            call.finished.wait(self.timeout)
        if not call.done:
            error = f"timed out after {self.timeout:g}s {STILL_RUNNING}"
            return self._fail(error, time.monotonic() - t0)
        duration = time.monotonic() - call.started
        if call.error is not None:
            e = call.error
            if isinstance(e, PartialReading):
                self._fail(str(e), duration)
                return e.value
            if isinstance(e, NotPresent):
                # Once at INFO (again only when the reason changes): a node without the NVIDIA
                # library says so in its log at the default level, not only in a metric.
                if self._logged_error != f"not present: {e}":
                    log.info(
                        "collector %s: source not present on this host, its metrics are absent "
                        "(gpuwatch_collector_success 0): %s",
                        self.name,
                        e,
                    )
                return self._fail(f"not present: {e}", duration, quiet=True)
            return self._fail(f"{type(e).__name__}: {e}", duration)
        now = self.clock()
        self.last_good, self.last_good_at = call.result, now
        self.status = CollectorStatus(self.name, True, duration, now, "")
        self._logged_error = ""
        return call.result

    def _fail(self, error: str, duration: float, quiet: bool = False) -> T | None:
        if not quiet and self._logged_error != error:
            log.warning("collector %s failed: %s", self.name, error)
        self._logged_error = error
        self.status = CollectorStatus(self.name, False, duration, self.last_good_at, error[:300])
        if self.last_good_at is not None and self.clock() - self.last_good_at <= self.max_age:
            return self.last_good
        return None


def guarded(what: str, fn: Callable[[], T], default: T) -> T:
    """Run ``fn``; on any exception log it and return ``default`` (one metric family, one event
    sink, one finding rule: never the whole scrape or cycle)."""
    try:
        return fn()
    except Exception as e:
        log.error("%s failed: %s: %s", what, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return default


def attempt(what: str, fn: Callable[[], T], default: T) -> tuple[T, str | None]:
    """``guarded``, also saying what went wrong: (result, None) or (default, "Type: message"), so
    that the caller can export the failure (a subsystem that does not start is down, not absent)."""
    try:
        return fn(), None
    except Exception as e:
        log.error("%s failed: %s: %s", what, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return default, f"{type(e).__name__}: {e}"[:300]


def run_forever(name: str, fn: Callable[[], Any], stop: threading.Event, backoff: float = 5.0) -> None:
    """Keep a streaming source alive: restart it after a crash, with a pause, until ``stop``."""
    while not stop.is_set():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - isolation for streaming sources
            log.error("streaming source %s crashed: %s: %s; restarting in %gs", name, type(e).__name__, e, backoff)
        if stop.wait(backoff):
            return
