"""Job churn does not grow the daemon (issue 11 item 4): the counter series of ranks that ended
vanish (retention.py), a non-zero OOM counter after the alert rule's window, old counters are not
resurrected from the event log at a restart, and the event log is compacted while running.
Real daemon, real rank processes, real py-spy, a real memory-cgroup OOM kill read from /dev/kmsg."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, write_config
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oom_helpers import MemCgroup, go

from gpuwatchd.config.schema import RetentionConfig
from gpuwatchd.counters import CounterStore
from gpuwatchd.daemon.finding_events import finding_event
from gpuwatchd.daemon.retention import SeriesRetention
from gpuwatchd.events.bus import EventBus
from gpuwatchd.events.log import JsonlSink, read_events
from gpuwatchd.join.kernel_events import KernelEventProcessor
from gpuwatchd.model import Finding, RankState
from gpuwatchd.rank import api
from gpuwatchd.sources.kernel_lines import parse_message

# about half a core: on CPU, so it is sampled (an idle rank is not screened, daemon/gil.py)
SPIN = (
    "import time\nwhile True:\n    t = time.monotonic()\n"
    "    while time.monotonic() - t < 0.01:\n        sum(range(1000))\n    time.sleep(0.01)\n"
)


def job_series(d: DaemonProc, prefix: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The counter series of the test's jobs (a recent kill's finding is a gauge with its own
    window, findings/rank_oom_killed.py)."""
    return {
        k: v
        for k, v in d.samples().items()
        if k[0].endswith("_total") and dict(k[1]).get("job_id", "").startswith(prefix)
    }


@pytest.fixture
def cgroup() -> Iterable[MemCgroup]:
    cg = MemCgroup("retention")
    try:
        yield cg
    finally:
        cg.remove()


def test_churned_ranks_vanish_and_an_oom_kill_stays_for_its_window(
    tmp_path: Path, procs: list[subprocess.Popen[Any]], cgroup: MemCgroup
) -> None:
    path, cfg = write_config(
        tmp_path,
        kernel_log="kmsg",
        interval_seconds=0.3,
        gil={
            "enabled": True,
            "interval_seconds": 0.5,
            "duration_seconds": 0.3,
            "rate_hz": 50,
            "healthy_interval_seconds": 0.5,
        },  # every rank sampled, healthy or not
        retention={"ended_rank_seconds": 2, "oom_kill_seconds": 10},
    )
    prefix = f"churn-{uuid.uuid4().hex[:6]}-"
    rank_dir = cfg["rank_dir"]
    d = DaemonProc(path, cfg)
    try:
        # 8 short jobs of 2 real Python ranks each, the first sampled by py-spy before it ends
        for n in range(8):
            job = f"{prefix}{n}"
            ranks = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
            procs.extend(ranks)
            for r, p in enumerate(ranks):
                api.register_rank(
                    job, r, pid=p.pid, rank_dir=rank_dir, heartbeat=False, cuda_oom_hook=False, strict=True
                )
            d.wait_for(
                lambda j=job: d.value("gpuwatch_rank_up", job_id=j, rank="1") == 1.0, timeout=20, what=f"{job} up"
            )
            if n == 0:
                d.wait_for(
                    lambda j=job: (d.value("gpuwatch_rank_gil_samples_total", job_id=j, rank="0") or 0) > 0,
                    timeout=30,
                    what="a GIL sample of the first job",
                )
            for p in ranks:
                p.kill()
                p.wait(10)
            for r in range(2):
                assert api.unregister_rank(job, r, rank_dir)
        # and one whose rank is OOM-killed by the kernel, then unregistered
        oom_job = f"{prefix}oom"
        victim = cgroup.spawn()
        api.register_rank(
            oom_job, 0, pid=victim.pid, rank_dir=rank_dir, heartbeat=False, cuda_oom_hook=False, strict=True
        )
        d.wait_for(
            lambda: d.value("gpuwatch_oom_kills_total", job_id=oom_job) == 0.0, timeout=20, what="the OOM series at 0"
        )
        go(victim)
        assert victim.wait(20) == -9
        d.wait_for(
            lambda: d.value("gpuwatch_oom_kills_total", job_id=oom_job) == 1.0, timeout=20, what="the kill counted"
        )
        assert api.unregister_rank(oom_job, 0, rank_dir)
        ended = time.monotonic()
        # within a couple of seconds every series of the ended jobs is gone but the kill
        d.wait_for(
            lambda: [dict(k[1])["job_id"] for k in job_series(d, prefix)] == [oom_job],
            timeout=20,
            what="only the OOM-killed job's counter left",
        )
        assert time.monotonic() - ended < 9.0  # long before oom_kill_seconds
        (((name, _), value),) = job_series(d, prefix).items()
        assert name == "gpuwatch_oom_kills_total" and value == 1.0
        d.wait_for(
            lambda: job_series(d, prefix) == {},
            timeout=30,
            what="the OOM counter gone after retention.oom_kill_seconds",
        )
        assert time.monotonic() - ended >= 9.0
        state = json.loads((Path(cfg["state_dir"]) / "state.json").read_text())
        assert prefix not in json.dumps(state["counters"])  # state.json: the same window
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.log_path.read_text(errors="replace")


def _kill_event(job: str, rank: str, when: float, key: str) -> str:
    from gpuwatchd.model.events import Event

    return Event(
        key=key,
        kind="oom_kill",
        time=when,
        severity="page",
        summary=f"{job} killed",
        job_id=job,
        rank=rank,
        pid=4242,
        comm="python3",
        killer="kernel",
        boot_id="b",
        counter="oom_kills",
        labels=(job, rank, "python3", "kernel"),
    ).to_json()


def test_restart_does_not_resurrect_counters_of_ranks_long_gone(tmp_path: Path) -> None:
    """GPURankOOMKilled pages for a series that appears above 0 (it was scraped 10 min ago):
    a restart must not bring back the counter of a job that ended an hour ago."""
    path, cfg = write_config(tmp_path)
    state = Path(cfg["state_dir"])
    state.mkdir()
    now = time.time()
    (state / "events.jsonl").write_text(
        _kill_event("old-job", "3", now - 3600, "k-old") + "\n" + _kill_event("new-job", "1", now - 60, "k-new") + "\n"
    )
    d = DaemonProc(path, cfg)
    try:
        first = d.text()  # the first scrape with counters
        assert 'job_id="new-job"' in first
        assert 'job_id="old-job"' not in first
    finally:
        assert d.stop() == 0


def test_event_log_is_compacted_while_running(tmp_path: Path) -> None:
    """Finding transitions under job churn go to events.jsonl every cycle: the log stays bounded
    without a restart, the counters stay exact, and a compaction drops the counters of ranks
    that ended longer ago than the retention, but keeps those of ranks still registered."""
    t = [1_800_000_000.0]
    counters = CounterStore(clock=lambda: t[0])
    p = KernelEventProcessor(
        counters,
        str(tmp_path),
        parse=parse_message,
        bus=EventBus([JsonlSink(str(tmp_path))]),
        clock=lambda: t[0],
        max_log_bytes=40_000,
        keep_events=20,
        retention_seconds=600.0,
    )
    from gpuwatchd.model.events import Event

    for job, rank in (("gone", "0"), ("still", "1")):
        p.record_event(Event.from_dict(json.loads(_kill_event(job, rank, t[0], f"k-{job}"))))
    still = RankState("still", 1, 999_999, 1, 2, False, None)
    t[0] += 3600  # an hour later "still" is registered (dead), "gone" is not
    p.observe([still], {}, t[0])
    for i in range(2000):  # churn: rank_down raised and cleared for a thousand short jobs
        f = Finding("rank_down", "page", f"rank 0 of job churn-{i} is down", f"churn-{i}", "0", "7", since=t[0])
        p.record_event(finding_event(f, t[0], cleared=bool(i % 2)))
        t[0] += 0.5
        assert (tmp_path / "events.jsonl").stat().st_size < 2 * 40_000
    assert counters.get("oom_kills", ("still", "1", "python3", "kernel")) == 1.0
    assert counters.get("oom_kills", ("gone", "0", "python3", "kernel")) == 1.0  # retention.py's job
    stored = list(read_events(str(tmp_path / "events.jsonl")))
    assert stored[0].kind == "counter_base" and len(stored) < 400  # of 2002
    p2 = KernelEventProcessor(CounterStore(), str(tmp_path), parse=parse_message, clock=lambda: t[0])
    oom = dict(p2.counters.snapshot()["oom_kills"])
    assert oom == {("still", "1", "python3", "kernel"): 1.0}
    assert not list(tmp_path.glob("*.tmp*")) and not list(tmp_path.glob("*.compact"))


def test_rank_tree_record_forgets_churned_members_but_keeps_those_of_a_restart(tmp_path: Path) -> None:
    from gpuwatchd.join.rank_trees import RankTreeRecord, TreeMember

    def m(pid: int, t: float) -> TreeMember:
        return TreeMember(pid, 100.0, f"job-{pid}", 0, pid, False, "python3", t)

    path = str(tmp_path / "rank_trees.json")
    rec = RankTreeRecord(path, ttl_seconds=900.0, ended_grace_seconds=120.0)
    t = 1000.0
    for i in range(600):  # one short job per second, each seen alive for 2 cycles
        rec.update([m(10_000 + i, t), m(10_000 + i - 1, t)] if i else [m(10_000, t)], t)
        t += 1.0
    assert len(json.loads(Path(path).read_text())["members"]) <= 125  # not 600 (ttl 900 s)
    assert rec.lookup(10_599, t) is not None  # a late kill line of a recent job: attributed
    assert rec.lookup(10_100, t) is None
    # members alive when the daemon stopped are kept for ttl, and a kill while it was down is
    # attributed within the grace after the restart
    rec2 = RankTreeRecord(path, ttl_seconds=900.0, ended_grace_seconds=120.0)
    t += 600.0  # ten minutes down
    rec2.update([], t)
    assert rec2.lookup(10_599, t - 300.0) is not None
    rec2.update([], t + 121.0)
    assert rec2.lookup(10_599, t - 300.0) is None


# --- the policy on its own: properties over any sequence of cycles ---------------------------

CFG = RetentionConfig(ended_rank_seconds=120.0, oom_kill_seconds=1800.0)
RANKS = [("j1", "0"), ("j1", "1"), ("j2", "0")]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sets(st.sampled_from(RANKS)),  # registered in this cycle
            st.lists(
                st.tuples(st.sampled_from(RANKS), st.sampled_from(["oom_kills", "rank_gil_samples"]), st.integers(0, 3))
            ),
            st.floats(0.5, 400.0),
        ),  # seconds to the next cycle
        min_size=1,
        max_size=30,
    )
)
def test_retention_keeps_exactly_what_is_live_or_within_its_window(cycles: list[Any]) -> None:
    now = [1000.0]
    store = CounterStore(clock=lambda: now[0])
    policy = SeriesRetention(store)
    last_live: dict[tuple[str, str], float] = {}
    for registered, incs, step in cycles:
        for (job, rank), name, n in incs:
            labels = (job, rank, "python3", "kernel") if name == "oom_kills" else (job, rank)
            store.inc(name, labels, n)
        for key in registered:
            last_live[key] = now[0]
        before = store.series()
        policy.apply(registered, now[0], CFG)
        kept = {(n, ls) for n, ls, _, _ in store.series()}
        for name, labels, value, touched in before:
            key = (labels[0], labels[1])
            age = now[0] - max(last_live.get(key, -1e18), touched)
            window = CFG.oom_kill_seconds if name == "oom_kills" and value > 0 else CFG.ended_rank_seconds
            should_keep = key in registered or age <= window
            assert ((name, labels) in kept) == should_keep, (name, labels, value, age)
        now[0] += step
