"""The daemon's NCCL RAS part: asks NCCL's RAS port about the jobs that look stalled or suspect,
and joins the answer to their ranks (gpuwatchd/join/nccl_ras.py).

The track stage hands it the stall part's verdicts, as it does the flight recorder's: a job is
asked only while a rank of it is stalled or suspect, at most every ``stall.nccl_ras_interval_seconds``
and at most ``MAX_JOBS_PER_CYCLE`` jobs a cycle within one time-out for them all, so a healthy node
costs nothing and a hostile one at most ``stall.nccl_ras_timeout_seconds`` a cycle. Each query
(gpuwatchd/sources/nccl_ras.py) first checks that every listener on the rank's RAS port
(``NCCL_RAS_ADDR`` from the rank's own environment) is a socket of a rank of that job, then
connects once with a deadline of ``stall.nccl_ras_timeout_seconds`` and at most 1 MiB read; an
answer that names none of the job's ranks here is refused. It returns ``jobs`` (job_id ->
RasJob, the latest answer or refusal of each suspect job), for the findings and the exporter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from gpuwatchd.daemon.subsystem import DaemonContext, Ranks, Subsystem
from gpuwatchd.join.nccl_ras import RasTracker, parse_status
from gpuwatchd.model import RankEntry, RankId
from gpuwatchd.model.nccl_ras import RasJob
from gpuwatchd.model.parts import RasOutput
from gpuwatchd.model.stall import StallVerdict
from gpuwatchd.sources.nccl_ras import RasRefused, env_address, local_addresses, owned_listener, query

log = logging.getLogger(__name__)
# A cycle asks at most this many jobs, the longest-waiting first, and all its queries share one
# time-out: a user's own slow listeners on four stalled jobs cost the cycle one time-out, not four
# (the others wait for the next cycle).
MAX_JOBS_PER_CYCLE = 4
MIN_QUERY_SECONDS = 0.2  # less of the cycle's time-out left: the job waits for the next cycle
ENV_VARS = ("NCCL_RAS_ADDR", "NCCL_RAS_ENABLE")


class NcclRasSubsystem(Subsystem):
    """Queries NCCL RAS for the suspect jobs (module docstring)."""

    name = "nccl_ras"

    def __init__(self, interval_seconds: float = 10.0, timeout_seconds: float = 2.0) -> None:
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self.tracker = RasTracker()
        self._jobs: dict[str, RasJob] = {}

    def track(self, daemon: DaemonContext, ranks: Ranks,
              verdicts: Mapping[RankId, StallVerdict]) -> RasOutput:  # fmt: skip
        now = ranks.now
        suspect = {k[0] for k, v in verdicts.items() if v.stalled or v.suspect}
        by_job: dict[str, list[RankEntry]] = {}
        for e in ranks.entries:
            if e.pid in ranks.processes:
                by_job.setdefault(e.job_id, []).append(e)
        self.tracker.forget(set(by_job))
        for job in set(self._jobs) - suspect:
            del self._jobs[job]
        due = sorted((self._jobs[j].asked_at if j in self._jobs else 0.0, j)
                     for j in suspect & set(by_job)
                     if j not in self._jobs or now - self._jobs[j].asked_at >= self.interval)
        end = time.monotonic() + self.timeout
        for _, job in due[:MAX_JOBS_PER_CYCLE]:
            left = end - time.monotonic()
            if left < MIN_QUERY_SECONDS:
                break
            self._jobs[job] = self._ask(daemon, job, by_job[job], now, left)
        return RasOutput(dict(self._jobs))

    def _ask(self, daemon: DaemonContext, job: str, entries: list[RankEntry], now: float,
             timeout: float) -> RasJob:
        entries = sorted(entries, key=lambda e: e.rank)
        try:
            env = daemon.procfs.environ_values(entries[0].pid, ENV_VARS)
            if env is None:
                raise RasRefused("the rank's environment is unreadable")
            if env.get("NCCL_RAS_ENABLE") == "0":
                raise RasRefused("RAS is off in the job (NCCL_RAS_ENABLE=0)")
            try:
                _, port = env_address(env)
            except ValueError as exc:
                raise RasRefused(str(exc)) from None
            pids = [e.pid for e in entries]
            address, owner = owned_listener(daemon.paths.proc, pids, port)
            answer = parse_status(query(address, port, timeout))
        except (RasRefused, ValueError) as exc:
            log.debug("NCCL RAS of job %s: %s", job, exc)
            return RasJob(job, now, error=str(exc)[:200])
        local: dict[int, tuple[int, int]] = {}
        for e in entries:
            local[e.pid] = (e.rank, e.pid)
            if e.ns_pid is not None:
                local.setdefault(e.ns_pid, (e.rank, e.pid))
        return self.tracker.observe(job, now, answer, local, local_addresses(daemon.paths.proc, owner))
