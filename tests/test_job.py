"""`gpuwatchd job`: one job's ranks across nodes, read from a real Prometheus on loopback.

The nodes here are stand-ins (MetricsServer serving DESIGN §4 text) so that failures can be
timed exactly; tests/test_e2e_alerting.py runs the same command against real daemons."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from promstack import REPO, MetricsServer, NodeRank, node_exposition, prometheus, wait_until

from gpuwatchd.cli import job


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "job", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_kill_times_counts_first_kill_and_series_appearing_above_zero() -> None:
    assert job.kill_times([(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)], series_is_new=True) == [3, 5]
    # a series that appeared at 1 inside the window: its first sample is the kill
    assert job.kill_times([(10, 1), (11, 1)], series_is_new=True) == [10]
    # ... but not when it already existed at the window's start (an old kill)
    assert job.kill_times([(10, 1), (11, 1)], series_is_new=False) == []
    # a counter reset followed by a kill
    assert job.kill_times([(1, 2), (2, 1)], series_is_new=False) == [2]


def test_start_of_current_run() -> None:
    assert job.start_of_current_run([(1, 1), (2, 0), (3, 1), (4, 0), (5, 0)], 0) == 4
    assert job.start_of_current_run([(1, 1)], 0) is None


def test_rejects_bad_job_id_and_lookback() -> None:
    prom = job.Prometheus("http://127.0.0.1:9")
    with pytest.raises(ValueError):
        job.job_view(prom, 'x"} or vector(1)', "1h")
    with pytest.raises(ValueError):
        job.job_view(prom, "llm-7", "1h) or (")


def test_unreachable_prometheus_exits_3() -> None:
    p = _cli("llm-7", "--prometheus", "http://127.0.0.1:9", "--timeout", "2")
    assert p.returncode == 3  # not the user's query: nothing answered (docs/cli.md)
    assert "cannot reach Prometheus" in p.stderr
    # without a scheme it is the user's typo: exit 2, saying what was meant
    p = _cli("llm-7", "--prometheus", "127.0.0.1:9", "--timeout", "2")
    assert p.returncode == 2 and "did you mean http://127.0.0.1:9?" in p.stderr, p


def test_job_across_two_nodes_names_first_oom_killed_rank(tmp_path: Path) -> None:
    """Ranks 0-3 of llm-7 on two nodes, rank 5 of another job beside them. Rank 2 (node B) is
    OOM-killed first; 3 s later rank 0 (node A) dies without an OOM kill; rank 3 stalls. The job
    view names rank 2 as the first to fail and counts ranks 1 and 3 as waiting on it."""
    a_ranks = [
        NodeRank("llm-7", 0, 1000, 4, gpu=0),
        NodeRank("llm-7", 1, 1001, 4, gpu=1),
        NodeRank("other", 5, 1002, 8, gpu=2),
    ]
    b_ranks = [NodeRank("llm-7", 2, 2000, 4, gpu=0), NodeRank("llm-7", 3, 2001, 4, gpu=1)]
    with MetricsServer(node_exposition(a_ranks)) as a, MetricsServer(node_exposition(b_ranks)) as b:

        def refresh() -> None:
            a.text = node_exposition(a_ranks)
            b.text = node_exposition(b_ranks)

        with prometheus(tmp_path, [a.address, b.address]) as prom:
            wait_until(lambda: len(prom.query('gpuwatch_rank_up{job_id="llm-7"}')) == 4, 20, "4 ranks scraped")
            wait_until(
                lambda: len(prom.query('gpuwatch_oom_kills_total{job_id="llm-7"}[1h]')[0]["values"]) >= 2,
                10,
                "two samples",
            )
            healthy = _cli("llm-7", "--prometheus", prom.url)
            assert healthy.returncode == 0, healthy.stdout + healthy.stderr
            assert "4 up, 0 stalled, 0 dead, 0 OOM-killed" in healthy.stdout
            assert "no rank has failed" in healthy.stdout

            t_kill = time.time()
            b_ranks[0].oom_kills = 1
            b_ranks[0].up = False
            refresh()
            time.sleep(3)
            a_ranks[0].up = False
            b_ranks[1].stalled = True
            refresh()
            wait_until(
                lambda: prom.query('gpuwatch_rank_up{job_id="llm-7",rank="0"} == 0'), 10, "rank 0 dead in Prometheus"
            )
            wait_until(
                lambda: prom.query('gpuwatch_rank_stalled{job_id="llm-7"} == 1'), 10, "rank 3 stalled in Prometheus"
            )

            p = _cli("llm-7", "--prometheus", prom.url, "--json")
            assert p.returncode == 1, p.stdout + p.stderr
            out = json.loads(p.stdout)
            assert out["counts"] == {"up": 1, "stalled": 1, "dead": 1, "oom_killed": 1, "missing": 0}
            assert out["nodes"] == sorted([a.address, b.address])
            assert out["world_size"] == 4
            first = out["first_to_fail"]
            assert (first["rank"], first["instance"], first["state"]) == ("2", b.address, "oom_killed")
            assert (first["oom_comm"], first["oom_killer"], first["pid"]) == ("python", "kernel", "2000")
            # dated by the scrape that first saw the kill (1 s scrapes)
            assert t_kill - 0.5 <= first["failed_at"] <= t_kill + 2.5
            assert sorted(w["rank"] for w in out["waiting"]) == ["1", "3"]
            by_rank = {r["rank"]: r for r in out["ranks"]}
            assert set(by_rank) == {"0", "1", "2", "3"}
            assert by_rank["0"]["state"] == "dead" and by_rank["0"]["failed_at"] > first["failed_at"]
            assert by_rank["3"]["state"] == "stalled"
            assert by_rank["1"]["gpu_memory_bytes"] == 40 * 2**30

            text = _cli("llm-7", "--prometheus", prom.url)
            assert text.returncode == 1
            assert f"first to fail: rank 2 on {b.address} OOM-killed (python, by kernel)" in text.stdout
            assert "2 ranks are waiting on it" in text.stdout
            print(text.stdout)

            unknown = _cli("no-such-job", "--prometheus", prom.url)
            assert unknown.returncode == 2
            assert "no rank of job 'no-such-job'" in unknown.stderr

            # node B stops being scraped: its ranks are "missing", rank 2 stays OOM-killed
            b.server.shutdown()
            b.server.server_close()
            wait_until(lambda: not prom.query('gpuwatch_rank_up{job_id="llm-7",rank="3"}'), 15, "node B's series stale")
            gone = json.loads(_cli("llm-7", "--prometheus", prom.url, "--json").stdout)
            states = {r["rank"]: r["state"] for r in gone["ranks"]}
            assert states == {"0": "dead", "1": "up", "2": "oom_killed", "3": "missing"}
            assert gone["first_to_fail"]["rank"] == "2"


def test_job_shows_each_ranks_exit_and_the_first_to_fail(tmp_path: Path) -> None:
    """Two discovered ranks: rank 1 segfaults, its launcher SIGTERMs rank 0 within the same
    scrape, and both vanish with their processes (no rank_up after). The job view finds them
    through gpuwatch_rank_exits_total, names rank 1 (not the torn-down rank 0) the first to fail,
    and shows each rank's exit."""
    ranks = [NodeRank("crash-9", 0, 3000, 2, gpu=0), NodeRank("crash-9", 1, 3001, 2, gpu=1)]
    with MetricsServer(node_exposition(ranks)) as node, prometheus(tmp_path, [node.address]) as prom:
        wait_until(lambda: len(prom.query('gpuwatch_rank_up{job_id="crash-9"}')) == 2, 20, "2 ranks scraped")
        ranks[1].exit_cause, ranks[0].exit_cause = "SIGSEGV", "SIGTERM"
        for r in ranks:
            r.listed = False
        node.text = node_exposition(ranks)
        wait_until(lambda: len(prom.query('gpuwatch_rank_exits_total{job_id="crash-9"}')) == 2, 10, "the exits scraped")
        out = json.loads(_cli("crash-9", "--prometheus", prom.url, "--json").stdout)
        assert (out["first_to_fail"]["rank"], out["first_to_fail"]["exit_cause"]) == ("1", "SIGSEGV")
        assert {r["rank"]: r["exit_cause"] for r in out["ranks"]} == {"0": "SIGTERM", "1": "SIGSEGV"}
        text = _cli("crash-9", "--prometheus", prom.url).stdout
        assert f"first to fail: rank 1 on {node.address} exited (SIGSEGV)" in text, text
        assert any(x.startswith("RANK") and x.endswith("EXIT") for x in text.splitlines()) and "SIGTERM" in text


def test_job_names_the_rank_behind_in_the_flight_recorder_and_the_straggler(tmp_path: Path) -> None:
    """Three ranks on a stand-in node: ranks 0 and 1 step on and entered collective #5; rank 2
    stopped stepping and its flight recorder says #4. `gpuwatchd job` names rank 2 both as the
    rank that never entered collective #5 and as the straggler (0 steps/s)."""
    ranks = [NodeRank("fr-7", r, 2000 + r, 3, gpu=r) for r in range(3)]
    ranks[2].stalled = True
    with MetricsServer(node_exposition(ranks)) as node, prometheus(tmp_path, [node.address]) as prom:
        wait_until(lambda: len(prom.query("deriv(gpuwatch_rank_step[10m])")) == 3, 30, "three step rates")
        node.text = node_exposition(ranks)
        time.sleep(2)
        jv = job.job_view(job.Prometheus(prom.url), "fr-7")
        assert [(r.rank, pg, seq, top) for r, pg, seq, top in jv.behind] == [("2", "0", 4, 5)]
        assert [r.rank for r in jv.stragglers] == ["2"]
        out = _cli("fr-7", "--prometheus", prom.url)
        print(out.stdout)
        assert out.returncode == 1, out.stderr  # a rank has failed (stalled)
        assert (
            f"flight recorder: rank 2 on {node.address} never entered collective #5 of "
            "process group 0 (its last: #4)" in out.stdout
        )
        assert f"straggler: rank 2 on {node.address} makes 0.00 steps/s" in out.stdout
        doc = json.loads(_cli("fr-7", "--prometheus", prom.url, "--json").stdout)
        assert doc["behind"][0]["rank"] == "2" and doc["stragglers"][0]["rank"] == "2"


def test_job_names_the_nccl_ras_culprit_every_node_names(tmp_path: Path) -> None:
    """Two nodes' daemons each asked NCCL RAS about fr-8 and both name rank 3 on 10.1.0.5
    (pid 4104) dead (``gpuwatch_nccl_ras_culprit``): `gpuwatchd job` says it once, with both."""
    culprit = (
        '# TYPE gpuwatch_nccl_ras_culprit gauge\ngpuwatch_nccl_ras_culprit{job_id="fr-8",'
        'nccl_rank="3",host="10.1.0.5",pid="4104",reason="dead"} 1\n'
    )
    a_ranks = [NodeRank("fr-8", 0, 1000, 4, gpu=0)]
    b_ranks = [NodeRank("fr-8", 2, 2000, 4, gpu=0)]
    with (
        MetricsServer(node_exposition(a_ranks).replace("# EOF\n", "") + culprit) as a,
        MetricsServer(node_exposition(b_ranks).replace("# EOF\n", "") + culprit) as b,
        prometheus(tmp_path, [a.address, b.address]) as prom,
    ):
        wait_until(
            lambda: len(prom.query('gpuwatch_nccl_ras_culprit{job_id="fr-8"}')) == 2, 30, "both nodes' culprit series"
        )
        out = _cli("fr-8", "--prometheus", prom.url)
        nodes = ", ".join(sorted([a.address, b.address]))
        assert f"NCCL RAS: rank 3 on 10.1.0.5 (pid 4104) is dead (seen from {nodes})" in out.stdout
        assert out.stdout.count("NCCL RAS:") == 1
        doc = json.loads(_cli("fr-8", "--prometheus", prom.url, "--json").stdout)
        assert doc["nccl_ras_culprits"] == [
            {
                "nccl_rank": "3",
                "host": "10.1.0.5",
                "pid": "4104",
                "reason": "dead",
                "seen_by": sorted([a.address, b.address]),
            }
        ]
