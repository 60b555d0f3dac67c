"""The daemon's flight-recorder part: asks the ranks of stalled jobs for a dump and reads it.

The protocol, the file rules and the comparison are in gpuwatchd/join/flight_recorder.py (pure) and the
rank side in gpuwatchd/rank/flight_recorder.py. The track stage hands it that cycle's stall
verdicts (the stall part's output) as an argument. It returns ``records`` ((job_id, rank) ->
FrReading, for findings/stall.py) and ``collectives`` (CollectiveStatus per rank and process
group, for the exporter). The request and response files are read and written under ``guarded``:
a file system error loses that rank's request this cycle, never the other ranks'. Only ranks
with a rank file are asked (the responder runs in ``register_rank()``); an unanswered rank is asked
again after 2, 4, then at most ``MAX_BACKOFF`` x the interval, and its answer file is looked for
every cycle for the first half-interval after a request, then every ``LATE_POLL_SECONDS``.

A rank whose own environment turns on PyTorch's dump pipe (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` and
a trace buffer: gpuwatchd/sources/torch_dump_pipe.py) is asked through that pipe instead, rank
file or not: one byte into its FIFO (only a FIFO owned by the rank's uid), then its pickled dump
is read where the rank writes it once its mtime moves, within ``PIPE_GRACE_SECONDS``. Its
environment is read once per rank process, and only while its job is stalled or suspect.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.join.flight_recorder import parse_response
from gpuwatchd.model import ProcessInfo, RankEntry, RankId
from gpuwatchd.model.parts import FlightOutput, FrReading
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.rank.flight_recorder import request_path, response_path
from gpuwatchd.sources.flight_recorder_files import read_response, write_request
from gpuwatchd.sources.torch_dump_pipe import (
    PIPE_VARS,
    PipeSettings,
    dump_mtime,
    in_root,
    read_dump,
    settings,
    trigger,
)

log = logging.getLogger(__name__)
# The rank's thread polls every 0.5 s: an answer missing this long after the request is "no
# answer" (a stopped rank, or Python threads blocked in native code holding the GIL).
ANSWER_GRACE_SECONDS = 2.0
# A rank that left a request unanswered is asked again after twice the interval, then four
# times, up to this factor; an answer brings it back to the interval. Most ranks that never answer
# run no responder (no ``register_rank()``; measured: a stalled job's 64 ranks were each sent a
# request file every minute that nobody read).
MAX_BACKOFF = 8
# After the grace, an unanswered request's answer file is looked for this often, not every cycle
# (a late answer still counts; 64 ranks without a responder cost an open() each per cycle).
LATE_POLL_SECONDS = 30.0
# torch's heartbeat monitor looks at the pipe about every second (TORCH_NCCL_COORD_CHECK_MILSEC)
# and may wait for the GIL before writing: a dump this late after the byte is "no answer".
PIPE_GRACE_SECONDS = 15.0


@dataclass(frozen=True)
class Ask:
    """A rank's last request for a dump: ``NEVER`` until its first, then the one sent last."""

    pid: int = 0
    nonce: str = ""
    asked_at: float = -math.inf
    pending: bool = False  # sent, and no answer in yet
    misses: int = 0  # requests in a row that got no answer within the grace, this one excepted
    polled_at: float = 0.0  # the last look for its answer
    dump_before: float | None = None  # through the pipe: the dump file's mtime before the byte

    def due(self, now: float, interval: float) -> bool:
        """May the next request go? At once the first time, ``interval`` after one answered (or
        refused), 2, 4, then at most MAX_BACKOFF x ``interval`` after one left unanswered."""
        wait = interval * min(2 ** (self.misses + 1), MAX_BACKOFF) if self.pending else interval
        return now - self.asked_at >= wait

    def look(self, now: float, interval: float) -> bool:
        """Look for its answer file this cycle? While pending: every cycle for the grace and half
        an interval after the request, then every LATE_POLL_SECONDS."""
        return self.pending and (
            now - self.asked_at < ANSWER_GRACE_SECONDS + interval / 2 or now - self.polled_at >= LATE_POLL_SECONDS
        )

    def then(self, pid: int, nonce: str, now: float, dump_before: float | None = None) -> Ask:
        """The request sent after this one: a miss more if this one is still unanswered."""
        misses = min(self.misses + 1, MAX_BACKOFF) if self.pending else 0
        return Ask(pid, nonce, now, pending=True, misses=misses, dump_before=dump_before)


NEVER = Ask()


class FlightRecorderSubsystem(Subsystem):
    """Requests and reads flight-recorder dumps for the ranks of stalled jobs (module docstring)."""

    name = "flight_recorder"

    def __init__(self, interval_seconds: float = 60.0) -> None:
        self.interval = interval_seconds
        self._asks: dict[RankId, Ask] = {}
        self._readings: dict[RankId, FrReading] = {}
        self._unwritable = False  # the last request could not be written (said once per streak)
        self._pipes: dict[RankId, tuple[int, PipeSettings | None]] = {}  # (pid, settings)

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
        for key in set(self._pipes) - set(live):
            del self._pipes[key]
        for key, e in live.items():
            ask = self._asks.get(key, NEVER)
            pipe = self._pipe_of(daemon, e) if e.job_id in stalled_jobs or key in self._pipes else None
            if pipe is not None:
                self._through_pipe(daemon, e, pipe, processes[e.pid].uid, now, e.job_id in stalled_jobs)
                continue
            if e.source != "rankfile":
                continue  # discovered: no responder (it runs in register_rank())
            if e.job_id in stalled_jobs and ask.due(now, self.interval):
                self._ask(rank_dir, e, now, ask)
            elif ask.look(now, self.interval):
                self._asks[key] = replace(ask, polled_at=now)
                self._collect(rank_dir, e, processes[e.pid].uid)
                reading = self._readings.get(key)
                if reading is not None and reading.error == "waiting" and now - ask.asked_at >= ANSWER_GRACE_SECONDS:
                    self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error="no answer")
        readings = {k: r for k, r in self._readings.items() if k[0] in stalled_jobs}
        return FlightOutput(readings, tuple(g for r in self._readings.values() for g in r.groups))

    def _pipe_of(self, daemon: DaemonContext, e: RankEntry) -> PipeSettings | None:
        known = self._pipes.get(e.rank_id)
        if known is not None and known[0] == e.pid:
            return known[1]
        env = daemon.procfs.environ_values(e.pid, PIPE_VARS)
        if env is None:
            return None  # unreadable for now: asked again next cycle
        found = settings(env, e.rank)
        self._pipes[e.rank_id] = (e.pid, found)
        return found

    def _through_pipe(
        self, daemon: DaemonContext, e: RankEntry, pipe: PipeSettings, uid: int, now: float, stalled: bool
    ) -> None:
        key, ask = e.rank_id, self._asks.get(e.rank_id, NEVER)
        root = daemon.paths.proc(e.pid, "root")
        dump = in_root(root, pipe.dump)
        if stalled and ask.due(now, self.interval):
            before = dump_mtime(dump, uid)
            try:
                trigger(in_root(root, pipe.pipe), uid)
            except (OSError, ValueError) as exc:
                self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error=f"pipe refused: {exc}"[:200])
                self._asks[key] = Ask(e.pid, "", now)  # not pending: asked again at the interval
                return
            self._asks[key] = ask.then(e.pid, "", now, dump_before=before)
            self._readings.setdefault(key, FrReading(e.job_id, e.rank, e.pid, error="waiting"))
            return
        if not ask.pending:
            return
        if now - ask.asked_at >= PIPE_GRACE_SECONDS:  # looked for no more until the next byte
            if key in self._readings and self._readings[key].error == "waiting":
                self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error="no answer")
            return
        mtime = dump_mtime(dump, uid)
        if mtime is None or mtime == ask.dump_before:
            return
        try:
            doc = {"version": 1, "time": mtime, "trace": read_dump(dump, uid)}
            self._readings[key] = parse_response(doc, e.job_id, e.rank, e.pid)
        except (OSError, ValueError) as exc:
            self._readings[key] = FrReading(e.job_id, e.rank, e.pid, error=f"refused: {exc}"[:200])
        self._asks[key] = replace(ask, pending=False)

    def _ask(self, rank_dir: str, e: RankEntry, now: float, last: Ask = NEVER) -> None:
        nonce = os.urandom(8).hex()  # secrets.token_hex, without loading libcrypto via hmac
        try:
            write_request(request_path(rank_dir, e.job_id, e.rank), nonce)
        except OSError as exc:
            # once per streak: a read-only rank directory (a DaemonSet's readOnly mount) or one
            # the daemon's user may not write fails every request, and no dump ever comes
            if not self._unwritable:
                log.warning(
                    "flight-recorder requests cannot be written into %s (%s): no "
                    "flight-recorder dumps for stalled ranks until they can",
                    rank_dir,
                    exc.strerror or exc,
                )
            self._unwritable = True
            return
        if self._unwritable:
            log.warning("flight-recorder requests are written into %s again", rank_dir)
            self._unwritable = False
        self._asks[e.rank_id] = last.then(e.pid, nonce, now)
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
        self._asks[key] = replace(ask, pending=False)
        with contextlib.suppress(OSError):
            os.unlink(request_path(rank_dir, e.job_id, e.rank))

    def _forget(self, rank_dir: str, key: RankId) -> None:
        self._readings.pop(key, None)
        if self._asks.pop(key, None) is not None:
            with contextlib.suppress(OSError):
                os.unlink(request_path(rank_dir, *key))
