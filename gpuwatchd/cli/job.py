"""``gpuwatchd job JOB_ID --prometheus URL``: one job's ranks across every node, from Prometheus.

Reads: Prometheus's HTTP API (``/api/v1/query``) — the series every node's daemon exports
(``gpuwatch_rank_up``, ``gpuwatch_rank_stalled``, ``gpuwatch_rank_info``, ``gpuwatch_oom_kills_total``,
``gpuwatch_rank_gpu_memory_bytes``), instant values plus the raw samples of the last ``--lookback``
to date each rank's failure. Cost: a handful of queries whose size grows with the job's ranks.
Privilege: none on the node; network access to Prometheus. The equivalent by hand::

    curl -s 'http://prometheus:9090/api/v1/query' \\
         --data-urlencode 'query=gpuwatch_rank_up{job_id="llm-7"}[1h]'

Each rank's last exit in the window comes from ``gpuwatch_rank_exits_total{cause}`` (its EXIT
column); a discovered rank, which has no ``rank_up`` once its process is gone, is seen through it.
A rank is ``oom_killed`` (dead, with an OOM kill in the window), ``dead`` (registered, process gone),
``stalled`` (alive, no progress), ``up``, or ``missing`` (seen in the window but no longer reported:
its node stopped being scraped or the rank was unregistered). The *first to fail* is the rank whose
failure (first OOM-kill sample, first ``rank_up == 0`` sample of its current death, first
``rank_stalled == 1`` sample of its current stall) is the earliest: in a collective-based job the
other ranks wait for that one. Ranks that are alive (up or stalled) count as waiting on it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatchd.cli.common import EXIT_UNAVAILABLE, EXIT_USAGE
from gpuwatchd.units import fmt_bytes, fmt_clock_ms

JOB_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}\Z", re.ASCII)  # rank/rankfile.py's
DURATION_RE = re.compile(r"^[0-9]+[smhdw]\Z", re.ASCII)

UP = "up"
STALLED = "stalled"
DEAD = "dead"
OOM_KILLED = "oom_killed"
MISSING = "missing"
FAILED_STATES = (OOM_KILLED, DEAD, STALLED, MISSING)
TEARDOWN = ("SIGTERM", "SIGKILL", "SIGINT")


STEP_WINDOW = "10m"  # as the GPURankStraggler rule
STRAGGLER_RATIO = 0.8


class JobQueryError(Exception):
    """Prometheus could not be asked or answered something unusable."""


class PrometheusUnreachable(JobQueryError):
    """No answer at all: refused, timed out, no such host (exit 3, not the user's query)."""


@dataclass
class RankView:
    instance: str
    rank: str
    state: str = UP
    pid: str = ""
    local_rank: str = ""
    world_size: str = ""
    failed_at: float | None = None  # Unix time of the failure that put it in its state
    oom_kills: int = 0
    oom_comm: str = ""
    oom_killer: str = ""
    exit_cause: str = ""  # gpuwatch_rank_exits_total's cause of its last exit in the window
    exited_at: float | None = None  # the scrape that first saw that exit
    gpu_memory_bytes: float | None = None
    step_rate: float | None = None  # deriv(gpuwatch_rank_step[STEP_WINDOW]), steps per second

    @property
    def rank_number(self) -> float:
        try:
            return int(self.rank)
        except ValueError:
            return math.inf


@dataclass
class JobView:
    job_id: str
    ranks: list[RankView] = field(default_factory=list)
    first_to_fail: RankView | None = None
    waiting: list[RankView] = field(default_factory=list)
    # flight recorder: (rank view, process group, its last collective entered, the peers' highest)
    behind: list[tuple[RankView, str, int, int]] = field(default_factory=list)
    median_step_rate: float | None = None
    stragglers: list[RankView] = field(default_factory=list)
    # NCCL RAS's culprits (gpuwatch_nccl_ras_culprit), with the nodes whose daemon named them
    ras_culprits: list[dict[str, Any]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in (UP, STALLED, DEAD, OOM_KILLED, MISSING)}
        for r in self.ranks:
            out[r.state] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "nodes": sorted({r.instance for r in self.ranks}),
            "world_size": _world_size(self.ranks),
            "counts": self.counts(),
            "first_to_fail": asdict(self.first_to_fail) if self.first_to_fail else None,
            "waiting": [{"instance": r.instance, "rank": r.rank} for r in self.waiting],
            "behind": [
                {"instance": r.instance, "rank": r.rank, "pg": pg, "last_entered": seq, "peers_entered": top}
                for r, pg, seq, top in self.behind
            ],
            "median_step_rate": self.median_step_rate,
            "stragglers": [{"instance": r.instance, "rank": r.rank, "step_rate": r.step_rate} for r in self.stragglers],
            "ranks": [asdict(r) for r in self.ranks],
            "nccl_ras_culprits": self.ras_culprits,
        }


class Prometheus:
    """A minimal client for Prometheus's instant-query API."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        # Here, not at the top: urllib.request loads ssl, and `gpuwatchd run` imports this module.
        import urllib.error
        import urllib.parse
        import urllib.request

        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            # Prometheus answers 400/422 with a JSON error body: say what it said.
            try:
                detail = json.load(e).get("error", "")
            except (json.JSONDecodeError, OSError, AttributeError):
                detail = ""
            if not detail:  # no Prometheus error body: not its API (the exporter, a wrong path)
                raise JobQueryError(
                    f"{self.url}/api/v1/query answered HTTP {e.code}: not Prometheus's query API "
                    "(--prometheus takes the Prometheus server's URL, e.g. http://prometheus:9090)"
                ) from e
            raise JobQueryError(f"{self.url}: HTTP {e.code} for {expr!r}: {detail}") from e
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise PrometheusUnreachable(f"cannot reach Prometheus at {self.url}: {e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise JobQueryError(f"{self.url} did not answer with JSON: {e}") from e
        if not isinstance(body, dict) or body.get("status") != "success":
            raise JobQueryError(f"{self.url}: query {expr!r} failed: {body!r:.200}")
        result = body.get("data", {}).get("result", [])
        if not isinstance(result, list):
            raise JobQueryError(f"{self.url}: unexpected result for {expr!r}")
        return result


def _world_size(ranks: Iterable[RankView]) -> int | None:
    sizes = {r.world_size for r in ranks if r.world_size}
    if len(sizes) == 1:
        try:
            return int(sizes.pop())
        except ValueError:
            return None
    return None


def _samples(series: Mapping[str, Any]) -> list[tuple[float, float]]:
    return [(float(t), float(v)) for t, v in series.get("values", [])]


def _key(metric: Mapping[str, str]) -> tuple[str, str]:
    return (metric.get("instance", ""), metric.get("rank", ""))


def _labels_key(metric: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def start_of_current_run(samples: Sequence[tuple[float, float]], value: float) -> float | None:
    """Time of the first sample of the trailing run of samples equal to ``value``."""
    start = None
    for t, v in reversed(samples):
        if v != value:
            break
        start = t
    return start


def kill_times(samples: Sequence[tuple[float, float]], series_is_new: bool) -> list[float]:
    """Times of the samples at which an OOM counter went up; a series that appears already
    above 0 within the window (``series_is_new``) counts its first sample as a kill."""
    out: list[float] = []
    prev: float | None = None
    for t, v in samples:
        if prev is None:
            if v > 0 and series_is_new:
                out.append(t)
        elif v > prev or (v < prev and v > 0):
            out.append(t)
        prev = v
    return out


def job_view(prom: Prometheus, job_id: str, lookback: str = "1h", at: float | None = None) -> JobView:
    """Ask Prometheus for every rank of ``job_id`` and decide states and the first to fail."""
    if not JOB_ID_RE.match(job_id):
        raise ValueError(f"job_id {job_id!r} is not 1-128 characters of [A-Za-z0-9._:@-]")
    if not DURATION_RE.match(lookback):
        raise ValueError(f"lookback {lookback!r} is not a Prometheus duration such as 1h or 30m")
    at = time.time() if at is None else at
    sel = f'{{job_id="{job_id}"}}'
    ranks: dict[tuple[str, str], RankView] = {}

    def view(metric: Mapping[str, str]) -> RankView:
        key = _key(metric)
        if key not in ranks:
            ranks[key] = RankView(instance=key[0], rank=key[1])
        return ranks[key]

    # every rank seen in the window; those without a current sample are "missing"
    seen = prom.query(f"gpuwatch_rank_up{sel}[{lookback}]", at)
    for s in seen:
        r = view(s["metric"])
        r.state = MISSING
        samples = _samples(s)
        if samples:
            r.failed_at = samples[-1][0]
    for s in prom.query(f"gpuwatch_rank_up{sel}", at):
        r = view(s["metric"])
        r.state = UP if float(s["value"][1]) == 1 else DEAD
        r.failed_at = None
    for s in prom.query(f"gpuwatch_rank_info{sel}", at):
        r = view(s["metric"])
        m = s["metric"]
        r.pid, r.local_rank, r.world_size = (m.get("pid", ""), m.get("local_rank", ""), m.get("world_size", ""))
    for s in prom.query(f"sum by (instance, rank) (gpuwatch_rank_gpu_memory_bytes{sel})", at):
        view(s["metric"]).gpu_memory_bytes = float(s["value"][1])

    # dates: start of the current death / stall, OOM kills in the window
    for s in seen:
        r = view(s["metric"])
        if r.state == DEAD:
            r.failed_at = start_of_current_run(_samples(s), 0.0)
    stalled_now = {_key(s["metric"]) for s in prom.query(f"gpuwatch_rank_stalled{sel} == 1", at)}
    for s in prom.query(f"gpuwatch_rank_stalled{sel}[{lookback}]", at):
        r = view(s["metric"])
        if _key(s["metric"]) in stalled_now and r.state == UP:
            r.state = STALLED
            r.failed_at = start_of_current_run(_samples(s), 1.0)
    # series that existed at the start of the window: their first sample is not a new kill
    old = {_labels_key(s["metric"]) for s in prom.query(f"gpuwatch_oom_kills_total{sel} offset {lookback}", at)}
    kills_of: dict[tuple[str, str], list[tuple[float, str, str]]] = {}
    for s in prom.query(f"gpuwatch_oom_kills_total{sel}[{lookback}]", at):
        metric = s["metric"]
        is_new = _labels_key(metric) not in old
        for t in kill_times(_samples(s), is_new):
            kills_of.setdefault(_key(metric), []).append((t, metric.get("comm", ""), metric.get("killer", "")))
    for key, kills in kills_of.items():
        r = ranks.get(key) or view({"instance": key[0], "rank": key[1]})
        first = min(kills)
        r.oom_kills = len(kills)
        r.oom_comm, r.oom_killer = first[1], first[2]
        if r.state in (DEAD, MISSING):
            # the kill is the failure; rank_up == 0 follows it by up to one daemon cycle
            r.state = OOM_KILLED
            r.failed_at = first[0] if r.failed_at is None else min(first[0], r.failed_at)

    # exits (gpuwatch_rank_exits_total{cause}): each rank's last, and a rank that vanished with
    # its process (discovered ranks have no rank_up after their death) is seen through them
    old_exits = {_labels_key(s["metric"]) for s in prom.query(f"gpuwatch_rank_exits_total{sel} offset {lookback}", at)}
    listed = {_key(x["metric"]) for x in seen}
    for s in prom.query(f"gpuwatch_rank_exits_total{sel}[{lookback}]", at):
        metric = s["metric"]
        times = kill_times(_samples(s), _labels_key(metric) not in old_exits)
        if not times:
            continue
        r = ranks.get(_key(metric)) or view(metric)
        if r.exited_at is None or times[-1] > r.exited_at:
            r.exit_cause, r.exited_at = metric.get("cause", ""), times[-1]
        if r.state == UP and _key(metric) not in listed:
            r.state = MISSING
        if r.state in (DEAD, MISSING) and r.exit_cause not in ("", "exit_0"):
            r.failed_at = r.exited_at if r.failed_at is None else min(r.failed_at, r.exited_at)

    for s in prom.query(f"deriv(gpuwatch_rank_step{sel}[{STEP_WINDOW}])", at):
        view(s["metric"]).step_rate = float(s["value"][1])
    seqs: dict[str, list[tuple[tuple[str, str], int]]] = {}
    jv_culprits: dict[tuple[str, str, str, str], list[str]] = {}
    for s in prom.query(f"gpuwatch_nccl_ras_culprit{sel}", at):  # every node names the same ones
        m = s["metric"]
        seen_by = jv_culprits.setdefault(
            (m.get("nccl_rank", ""), m.get("host", ""), m.get("pid", ""), m.get("reason", "")), []
        )
        seen_by.append(m.get("instance", ""))
    for s in prom.query(f"gpuwatch_rank_collective_last_started_seq{sel}", at):
        seqs.setdefault(s["metric"].get("pg", ""), []).append((_key(s["metric"]), int(float(s["value"][1]))))

    order = sorted(ranks.values(), key=lambda r: (r.rank_number, r.rank, r.instance))
    jv = JobView(job_id=job_id, ranks=order)
    jv.ras_culprits = [
        {"nccl_rank": k[0], "host": k[1], "pid": k[2], "reason": k[3], "seen_by": sorted(set(v))}
        for k, v in sorted(jv_culprits.items())
    ]
    for pg, entered in sorted(seqs.items()):
        top = max(seq for _, seq in entered)
        jv.behind += [(view({"instance": k[0], "rank": k[1]}), pg, seq, top) for k, seq in sorted(entered) if seq < top]
    rates = [r.step_rate for r in jv.ranks if r.step_rate is not None]
    if len(rates) >= 2:
        import statistics  # (decimal, fractions: not for `gpuwatchd run`)

        jv.median_step_rate = statistics.median(rates)
        jv.stragglers = [
            r for r in jv.ranks if r.step_rate is not None and r.step_rate < STRAGGLER_RATIO * jv.median_step_rate
        ]
    failed = [r for r in jv.ranks if r.state in FAILED_STATES and r.failed_at is not None]
    if failed:
        # within one scrape the rank its launcher tore down (SIGTERM / SIGKILL / SIGINT) after
        # the first failure is dated alike: the one that did not end by those failed first
        jv.first_to_fail = min(failed, key=lambda r: (r.failed_at or 0.0, r.exit_cause in TEARDOWN, r.rank_number))
        jv.waiting = [r for r in jv.ranks if r is not jv.first_to_fail and r.state in (UP, STALLED)]
    return jv


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return fmt_clock_ms(t)


def describe_failure(r: RankView) -> str:
    what = {
        OOM_KILLED: f"OOM-killed ({r.oom_comm or '?'}, by {r.oom_killer or '?'})",
        DEAD: "died",
        STALLED: "stalled",
        MISSING: "stopped being reported",
    }.get(r.state, r.state)
    if r.exit_cause and r.state in (DEAD, MISSING):
        what = f"exited ({r.exit_cause})"
    return f"rank {r.rank} on {r.instance} {what} at {_fmt_time(r.failed_at)}"


def render_text(jv: JobView) -> str:
    c = jv.counts()
    nodes = sorted({r.instance for r in jv.ranks})
    ws = _world_size(jv.ranks)
    lines = [
        f"job {jv.job_id}: {len(jv.ranks)} ranks on {len(nodes)} nodes"
        + (f" (world size {ws})" if ws else "")
        + f": {c[UP]} up, {c[STALLED]} stalled, {c[DEAD]} dead, {c[OOM_KILLED]} OOM-killed"
        + (f", {c[MISSING]} missing" if c[MISSING] else "")
    ]
    if jv.first_to_fail:
        lines.append(f"first to fail: {describe_failure(jv.first_to_fail)}; {len(jv.waiting)} ranks are waiting on it")
    else:
        lines.append("no rank has failed")
    for r, pg, seq, top in jv.behind:
        lines.append(
            f"flight recorder: rank {r.rank} on {r.instance} never entered collective "
            f"#{top} of process group {pg} (its last: #{seq})"
        )
    for cul in jv.ras_culprits:
        lines.append(
            f"NCCL RAS: rank {cul['nccl_rank']} on {cul['host']} (pid {cul['pid']}) is "
            f"{cul['reason'].replace('_', ' ')} (seen from {', '.join(cul['seen_by'])})"
        )
    for r in jv.stragglers:
        lines.append(
            f"straggler: rank {r.rank} on {r.instance} makes {r.step_rate:.2f} steps/s, "
            f"{(r.step_rate or 0) / (jv.median_step_rate or 1):.2f}x the job's median "
            f"{jv.median_step_rate:.2f} ({STEP_WINDOW})"
        )
    lines.append("")
    header = ("RANK", "INSTANCE", "STATE", "SINCE", "PID", "GPU MEM", "OOM KILLS", "EXIT")
    rows = [
        (
            r.rank,
            r.instance,
            r.state + (" (first)" if r is jv.first_to_fail else ""),
            _fmt_time(r.failed_at),
            r.pid or "-",
            fmt_bytes(r.gpu_memory_bytes, none="-"),
            str(r.oom_kills),
            r.exit_cause or "-",
        )
        for r in jv.ranks
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Exit 0: every rank up; 1: some rank failed; 2: no such job or a bad query; 3: Prometheus
    cannot be reached."""
    if "://" not in args.prometheus:  # urllib's "unknown url type" is the user's typo, not an outage
        print(
            f"gpuwatchd job: --prometheus {args.prometheus!r} is not a URL; did you mean http://{args.prometheus}?",
            file=sys.stderr,
        )
        return EXIT_USAGE
    prom = Prometheus(args.prometheus, timeout=args.timeout)
    try:
        jv = job_view(prom, args.job_id, lookback=args.lookback)
    except (JobQueryError, ValueError) as e:
        print(f"gpuwatchd job: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(e, PrometheusUnreachable) else EXIT_USAGE
    if not jv.ranks:
        print(
            f"gpuwatchd job: no rank of job {args.job_id!r} in {args.prometheus} within the last {args.lookback}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(jv.to_json(), indent=2))
    else:
        print(render_text(jv))
    return 1 if jv.first_to_fail else 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``job`` subcommand to ``gpuwatchd``'s argparse subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "job",
        help="every rank of a job across nodes, through Prometheus",
        description="Every rank of JOB_ID across all nodes, read from Prometheus: which are up, "
        "dead, stalled or OOM-killed, and the first rank to fail (the one the others wait for). "
        "Exit 0 when every rank is up, 1 when a rank failed, 2 for no such job, 3 when Prometheus "
        "cannot be reached.",
    )
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument(
        "--prometheus", required=True, metavar="URL", help="Prometheus base URL, e.g. http://prometheus:9090"
    )
    p.add_argument(
        "--lookback", default="1h", help="how far back to look for failures (Prometheus duration, default 1h)"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p
