"""The daemon's NCCL RAS part: asks NCCL's RAS port about the jobs that look stalled or suspect,
and joins the answer to their ranks (gpuwatchd/join/nccl_ras.py).

The track stage hands it the stall part's verdicts, as it does the flight recorder's: a job is
asked only while a rank of it is stalled, suspect, or watched (``ras_jobs``: its heartbeat late,
working or not, or its last dump in a collective), at most every ``stall.nccl_ras_interval_seconds``
and at most ``MAX_JOBS_PER_CYCLE`` jobs a cycle within one time-out for them all, so a healthy node
costs nothing and a hostile one at most ``stall.nccl_ras_timeout_seconds`` a cycle. Each query
(gpuwatchd/sources/nccl_ras.py) first checks that every listener on the rank's RAS port
(``NCCL_RAS_ADDR`` from the rank's own environment) is a socket of a rank of that job, then
connects once with a deadline of ``stall.nccl_ras_timeout_seconds`` and at most 1 MiB read; an
answer that names none of the job's ranks here is refused. It returns ``jobs`` (job_id ->
RasJob, the latest answer or refusal of each suspect job), for the findings and the exporter.
The log says, at INFO when a job's outcome changes (DEBUG while it holds), which port was asked
for which job and why, whose listener it was, and the answer's shape or why it was refused.
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


def ras_jobs(verdicts: Mapping[RankId, StallVerdict]) -> set[str]:
    """The jobs whose RAS port is worth asking: a rank stalled, suspect, or watched (its heartbeat
    late, or its last dump in a collective: join/stall.py ``_watch``). A rank that stopped beating
    but works on its CPU or GPU progresses to the stall part, and only RAS can say whether its
    collectives still complete; a rank beating on time is never a reason."""
    return {k[0] for k, v in verdicts.items() if v.stalled or v.suspect or v.watch}


class NcclRasSubsystem(Subsystem):
    """Queries NCCL RAS for the suspect jobs (module docstring)."""

    name = "nccl_ras"

    def __init__(self, interval_seconds: float = 10.0, timeout_seconds: float = 2.0) -> None:
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self.tracker = RasTracker()
        self._jobs: dict[str, RasJob] = {}
        self._said: dict[str, str] = {}  # job -> the outcome last logged at INFO (``_say``)

    def track(self, daemon: DaemonContext, ranks: Ranks,
              verdicts: Mapping[RankId, StallVerdict]) -> RasOutput:  # fmt: skip
        now = ranks.now
        suspect = ras_jobs(verdicts)
        reasons: dict[str, str] = {}  # job -> why it is asked, for the log
        for k, v in sorted(verdicts.items()):
            if k[0] in suspect and k[0] not in reasons and (v.stalled or v.suspect or v.watch):
                reasons[k[0]] = f"rank {k[1]} " + ("stalled" if v.stalled else "suspect" if v.suspect else v.watch)
        by_job: dict[str, list[RankEntry]] = {}
        for e in ranks.entries:
            if e.pid in ranks.processes:
                by_job.setdefault(e.job_id, []).append(e)
        self.tracker.forget(set(by_job))
        for job in set(self._jobs) - suspect:
            del self._jobs[job]
        for job in set(self._said) - set(by_job):
            del self._said[job]
        due = sorted(
            (self._jobs[j].asked_at if j in self._jobs else 0.0, j)
            for j in suspect & set(by_job)
            if j not in self._jobs or now - self._jobs[j].asked_at >= self.interval
        )
        end = time.monotonic() + self.timeout
        for _, job in due[:MAX_JOBS_PER_CYCLE]:
            left = end - time.monotonic()
            if left < MIN_QUERY_SECONDS:
                break
            self._jobs[job] = self._ask(daemon, job, by_job[job], now, left, reasons.get(job, ""))
        return RasOutput(dict(self._jobs))

    def _ask(
        self, daemon: DaemonContext, job: str, entries: list[RankEntry], now: float, timeout: float, why: str
    ) -> RasJob:
        entries = sorted(entries, key=lambda e: e.rank)
        pids = [e.pid for e in entries]
        where = "its port"  # what was asked, for the log: the port, then the listener's owner
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
            where = f"port {port} (NCCL_RAS_ADDR={env.get('NCCL_RAS_ADDR', '')[:64]!r} of pid {pids[0]})"
            address, owner = owned_listener(daemon.paths.proc, pids, port)
            where = f"{address}:{port}, a listener of rank pid {owner}"
            answer = parse_status(query(address, port, timeout))
        except (RasRefused, ValueError) as exc:
            self._say(job, "refused", "NCCL RAS of job %s (%s; ranks' pids %s): %s: %s", job, why, pids, where, exc)
            return RasJob(job, now, error=str(exc)[:200])
        local: dict[int, tuple[int, int]] = {}
        for e in entries:
            local[e.pid] = (e.rank, e.pid)
            if e.ns_pid is not None:
                local.setdefault(e.ns_pid, (e.rank, e.pid))
        out = self.tracker.observe(job, now, answer, local, local_addresses(daemon.paths.proc, owner))
        if out.error:
            self._say(
                job,
                "unjoined",
                "NCCL RAS of job %s (%s; ranks' pids %s): %s answered "
                "NCCL %s, communicator of %d, ranks (host, pid) %s: %s",
                job,
                why,
                pids,
                where,
                answer.nccl_version,
                answer.size,
                [(r.host, r.pid) for r in answer.ranks[:8]],
                out.error,
            )
        else:
            self._say(
                job,
                "answered",
                "NCCL RAS of job %s (%s): %s answered NCCL %s, communicator "
                "of %d, %d missing; joined ranks (rank, ops) %s%s",
                job,
                why,
                where,
                answer.nccl_version,
                answer.size,
                len(answer.missing),
                [(s.rank, s.ops) for s in out.local[:8]],
                "" if answer.size > 1 else " (a one-rank communicator: NCCL counts none)",
            )
        return out

    def _say(self, job: str, outcome: str, fmt: str, *args: object) -> None:
        """INFO when the job's outcome (answered, refused, not joined) changes, DEBUG otherwise:
        the first answer and every change are in the log, a steady state costs no line a cycle."""
        level = logging.DEBUG if self._said.get(job) == outcome else logging.INFO
        self._said[job] = outcome
        log.log(level, fmt, *args)
