"""The daemon's flight-recorder part: asks the ranks of stalled jobs for a dump and reads it.

The protocol, the file rules and the comparison are in gpuwatchd/join/flight_recorder.py (pure) and the
rank side in gpuwatchd/rank/flight_recorder.py. The track stage hands it that cycle's stall
verdicts (the stall part's output) as an argument. It returns ``records`` ((job_id, rank) ->
FrReading, for findings/stall.py) and ``collectives`` (CollectiveStatus per rank and process
group, for the exporter). The request and response files are read and written under ``guarded``:
a file system error loses that rank's request this cycle, never the other ranks'.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatchd.daemon.subsystem import DaemonContext, FlightOutput, Ranks, Subsystem
from gpuwatchd.join.flight_recorder import FrReading, parse_response
from gpuwatchd.model import ProcessInfo, RankEntry, RankId
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.rank.flight_recorder import request_path, response_path
from gpuwatchd.sources.flight_recorder_files import read_response, write_request

log = logging.getLogger(__name__)
# The rank's thread polls every 0.5 s: an answer missing this long after the request is "no
# answer" (a stopped rank, or Python threads blocked in native code holding the GIL).
ANSWER_GRACE_SECONDS = 2.0


@dataclass
class _Ask:
    pid: int
    nonce: str
    asked_at: float
    answered: bool = False


class FlightRecorderSubsystem(Subsystem):
    """Requests and reads flight-recorder dumps for the ranks of stalled jobs (module docstring)."""

    name = "flight_recorder"

    def __init__(self, interval_seconds: float = 60.0) -> None:
        self.interval = interval_seconds
        self._asks: dict[RankId, _Ask] = {}
        self._readings: dict[RankId, FrReading] = {}

    def track(self, daemon: DaemonContext, ranks: Ranks,
              verdicts: Mapping[RankId, StallVerdict]) -> FlightOutput:  # fmt: skip
        """Ask the ranks of the jobs ``verdicts`` calls stalled or suspect, and read answers."""
        now = ranks.now
        rank_dir = daemon.config.rank_dir
        processes: Mapping[int, ProcessInfo] = ranks.processes
        entries: list[RankEntry] = [e for e in ranks.entries if e.pid in processes]
        stalled_jobs = {k[0] for k, v in verdicts.items() if v.stalled or v.suspect}
        live = {e.rank_id: e for e in entries}
        for key in set(self._asks) | set(self._readings):
            if key not in live or live[key].pid != (self._asks.get(key) or self._readings[key]).pid:
                self._forget(rank_dir, key)
        for key, e in live.items():
            ask = self._asks.get(key)
            if e.job_id in stalled_jobs and (ask is None or now - ask.asked_at >= self.interval):
                self._ask(rank_dir, e, now)
            elif ask is not None and not ask.answered:
                self._collect(rank_dir, e, processes[e.pid].uid)
                reading = self._readings.get(key)
                if reading is not None and reading.error == "waiting" and \
                        now - ask.asked_at >= ANSWER_GRACE_SECONDS:
                    self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error="no answer")
        readings = {k: r for k, r in self._readings.items() if k[0] in stalled_jobs}
        return FlightOutput(readings, tuple(g for r in self._readings.values() for g in r.groups))

    def _ask(self, rank_dir: str, e: RankEntry, now: float) -> None:
        nonce = os.urandom(8).hex()  # secrets.token_hex, without loading libcrypto via hmac
        try:
            write_request(request_path(rank_dir, e.job_id, e.rank), nonce)
        except OSError as exc:
            log.debug("flight-recorder request for %s/%d failed: %s", e.job_id, e.rank, exc)
            return
        self._asks[e.rank_id] = _Ask(e.pid, nonce, now)
        if e.rank_id not in self._readings:
            self._readings[e.rank_id] = FrReading(e.job_id, e.rank, e.pid, error="waiting")

    def _collect(self, rank_dir: str, e: RankEntry, uid: int) -> None:
        key = e.rank_id
        ask = self._asks[key]
        try:
            doc = read_response(response_path(rank_dir, e.job_id, e.rank), {0, uid})
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error=f"refused: {exc}"[:200])
            return
        if not isinstance(doc, dict) or doc.get("nonce") != ask.nonce:
            return  # an older answer: wait for this one
        try:
            if doc.get("pid") != e.pid:
                raise ValueError(f"answered by pid {doc.get('pid')!r:.20}, not the rank's")
            self._readings[key] = parse_response(doc, e.job_id, e.rank, e.pid)
        except ValueError as exc:
            self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error=f"refused: {exc}"[:200])
        ask.answered = True
        with contextlib.suppress(OSError):
            os.unlink(request_path(rank_dir, e.job_id, e.rank))

    def _forget(self, rank_dir: str, key: RankId) -> None:
        self._readings.pop(key, None)
        if self._asks.pop(key, None) is not None:
            with contextlib.suppress(OSError):
                os.unlink(request_path(rank_dir, *key))
