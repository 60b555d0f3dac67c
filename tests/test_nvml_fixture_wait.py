"""The NVML replay's Xid event wait blocks like NVML's, so the daemon's Xid watcher does not spin
on a recording (it used 13 % of a core under ``nvml.fixture`` before)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.sources.nvml_events import XidEventWatcher
from gpuwatchd.sources.nvml_fixture import RecordedNvml

FIXTURE = Path(__file__).parent / "fixtures" / "nvml" / "h200_idle.json"


def test_xid_watcher_on_a_replay_without_events_does_not_spin() -> None:
    nv = RecordedNvml.from_file(str(FIXTURE))
    watcher = XidEventWatcher(lambda name, labels: None, XidDeduper(), pynvml=nv, wait_ms=1000)
    nv.nvmlInit()
    event_set = nv.nvmlEventSetCreate()
    result: list[float] = []

    def loop() -> None:  # the watcher's own loop for one second, its thread's CPU measured
        t0 = time.thread_time()
        end, polls = time.monotonic() + 1.0, 0
        while time.monotonic() < end:
            watcher.poll_once(nv, event_set)
            polls += 1
        result.extend([time.thread_time() - t0, polls])

    t = threading.Thread(target=loop)
    t.start()
    t.join(10)
    assert result, "the watcher loop did not finish"
    used, polls = result
    assert polls <= 20, polls  # about ten waits of 0.1 s, not a busy loop
    assert used < 0.2, used
