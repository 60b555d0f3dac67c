"""Events -> Alertmanager (optional ``alertmanager.url``): one alert per paging event, posted from a
background thread with a bounded queue, time-outs and retries, so that a slow or down Alertmanager
never delays the kernel-log reader."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from gpuwatchd.events.log import (
    ALERT_NAMES,
    ALERT_SEVERITY,
    ALERT_SUMMARIES,
    RUNBOOK_ANCHORS,
    RUNBOOK_BASE,
)
from gpuwatchd.model.events import Event
from gpuwatchd.units import fmt_rfc3339

log = logging.getLogger(__name__)


def derive_instance(listen_address: str, hostname: str | None = None) -> str:
    """The ``instance`` label Prometheus gives this daemon's series when it scrapes
    ``<host>:<port>``: a wildcard listen host becomes this machine's name."""
    host, _, port = listen_address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = hostname or socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


def alert_for(
    event: Event,
    instance: str,
    runbook_base: str = RUNBOOK_BASE,
    hold_seconds: float = 900.0,
    scrape_job: str = "gpuwatchd",
) -> dict[str, Any] | None:
    """The Alertmanager v2 alert of one event, or None when the event does not page.

    The labels are exactly those the Prometheus rule's alert carries (deploy/prometheus/
    gpuwatchd.rules.yml: every label of the counter series, plus ``instance`` and ``job`` that
    Prometheus attaches at scrape time, plus ``severity``), so Alertmanager sees one alert with one
    fingerprint whichever path delivers it first."""
    name = ALERT_NAMES.get(event.kind)
    if name is None or not event.alert:
        return None
    labels = {"alertname": name, "instance": instance, "job": scrape_job, "severity": ALERT_SEVERITY}
    if event.kind == "oom_kill":
        labels.update(job_id=event.job_id, rank=event.rank, comm=event.comm, killer=event.killer)
    else:  # Xid: the GPU is the subject, as in gpuwatch_gpu_xid_errors_total
        f = event.fields
        labels.update(gpu=str(f.get("gpu", "")), uuid=str(f.get("uuid", "")), xid=str(f.get("xid", "")))
    # Alertmanager drops empty label values; so does Prometheus on the rule side.
    labels = {k: v for k, v in labels.items() if v != ""}
    return {
        "labels": labels,
        "annotations": {
            "summary": ALERT_SUMMARIES[event.kind],
            "description": event.summary,
            "runbook_url": f"{runbook_base}#{RUNBOOK_ANCHORS.get(event.kind, '')}",
        },
        "startsAt": fmt_rfc3339(event.time),
        "endsAt": fmt_rfc3339(max(event.time, time.time()) + hold_seconds),
    }


class AlertmanagerSink:
    """Pushes paging events to ``url``/api/v2/alerts from a background thread (a slow or dead
    Alertmanager never delays the kernel-log thread). Retries with back-off for ``retry_seconds``."""

    def __init__(
        self,
        url: str,
        instance: str,
        timeout_seconds: float = 2.0,
        retry_seconds: float = 60.0,
        runbook_base: str = RUNBOOK_BASE,
        scrape_job: str = "gpuwatchd",
    ) -> None:
        self.scrape_job = scrape_job
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.instance = instance
        self.timeout = timeout_seconds
        self.retry_seconds = retry_seconds
        self.runbook_base = runbook_base
        self.sent = 0
        self.errors = 0
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._loop, name="alertmanager-push", daemon=True)
        self._thread.start()

    def emit(self, event: Event) -> None:
        alert = alert_for(event, self.instance, self.runbook_base, scrape_job=self.scrape_job)
        if alert is None:
            return
        try:
            self._q.put_nowait(alert)
        except queue.Full:
            self.errors += 1
            log.warning("alertmanager queue full; alert %s dropped", event.key)

    def post(self, alerts: Sequence[dict[str, Any]]) -> None:
        import urllib.request  # here: it loads ssl, and most nodes configure no Alertmanager

        body = json.dumps(list(alerts)).encode()
        req = urllib.request.Request(
            self.endpoint, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            resp.read()

    def _loop(self) -> None:
        while True:
            alert = self._q.get()
            if alert is None:
                return
            batch = [alert]
            while True:  # everything already queued goes in one request
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._deliver(batch)
                    return
                batch.append(nxt)
            self._deliver(batch)

    def _deliver(self, batch: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.2
        while True:
            try:
                self.post(batch)
                self.sent += len(batch)
                return
            except (OSError, ValueError) as e:  # urllib's URLError and HTTPError are OSErrors
                self.errors += 1
                if time.monotonic() + delay > deadline:
                    log.warning("alertmanager push failed, %d alerts dropped: %s", len(batch), e)
                    return
                log.info("alertmanager push failed (%s); retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=1.0)
        self._thread.join(timeout=self.timeout + 1.0)
