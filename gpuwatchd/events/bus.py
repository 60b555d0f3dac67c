"""The event bus: every event to the JSONL log first (durability), then the journal and
Alertmanager, each sink isolated (``build_bus`` makes the daemon's set)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gpuwatchd.events.alertmanager import AlertmanagerSink
from gpuwatchd.events.journal_sink import JournalSink
from gpuwatchd.events.log import EventSink, JsonlSink
from gpuwatchd.model.events import Event

log = logging.getLogger(__name__)


class EventBus:
    """Fan-out to the sinks; the JSONL sink first (durability), each sink isolated."""

    def __init__(self, sinks: Iterable[EventSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except OSError as e:  # disk full, socket gone: never take the reader thread down
                log.warning("event sink %s failed: %s", type(sink).__name__, e)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_bus(
    state_dir: str,
    alertmanager_url: str | None = None,
    instance: str = "",
    timeout_seconds: float = 2.0,
    journal: bool | None = None,
    scrape_job: str = "gpuwatchd",
    files: Any = None,
) -> EventBus:
    """The daemon's sinks: JSONL always, the journal when journald runs, Alertmanager when set."""
    sinks: list[EventSink] = [JsonlSink(state_dir, files=files)]
    if journal if journal is not None else JournalSink.available():
        sinks.append(JournalSink())
    if alertmanager_url:
        sinks.append(AlertmanagerSink(alertmanager_url, instance, timeout_seconds, scrape_job=scrape_job))
    return EventBus(sinks)
