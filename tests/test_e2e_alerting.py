"""End to end, all on loopback: real `gpuwatchd run` daemons, a real Prometheus scraping them with
the shipped rules (1 s scrape and evaluation), a real Alertmanager with the shipped routing and
inhibitions, and a webhook receiver here. A registered rank is OOM-killed by the kernel inside a
memory cgroup; the page must arrive with the right job_id, rank and explanation, once: the rank's
GPURankDown and its peer's GPURankStalled that follow are inhibited. The GPU is the one
thing this machine lacks: NVML is the recorded H200 replay with live PIDs put in.

Latencies are printed (pytest -s shows them)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernel_oom_helpers import MemCgroup, go
from promstack import (
    CONDITIONAL_SERIES,
    RECORDING_RULES,
    REPO,
    RULES,
    Daemon,
    Webhook,
    alertmanager,
    dashboard_panels,
    dashboard_variable_queries,
    derived_nvml_fixture,
    fill_vars,
    prometheus,
    shipped_alertmanager_config,
    sleeper,
    wait_until,
)


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Any:
    """print() that shows in CI's log too (past pytest's output capture)."""

    def out(text: str) -> None:
        with capsys.disabled():
            print(text, flush=True)

    return out


@pytest.fixture
def cgroups() -> Iterator[list[MemCgroup]]:
    out: list[MemCgroup] = []
    yield out
    for cg in out:
        cg.remove()


def _oom_victim(cgroups: list[MemCgroup], procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A rank process in its own 64 MiB memory cgroup that allocates 256 MiB on go()."""
    cg = MemCgroup("h6e2e")
    cgroups.append(cg)
    p = cg.spawn()
    procs.append(p)
    return p


def _oom_page(hook: Webhook, job_id: str, rank: str) -> tuple[float, dict[str, Any]] | None:
    for t, _path, alert in hook.alerts("/page"):
        lab = alert["labels"]
        if (lab.get("alertname"), lab.get("job_id"), lab.get("rank"), alert["status"]) == (
            "GPURankOOMKilled",
            job_id,
            rank,
            "firing",
        ):
            return t, alert
    return None


def _scraped_at_zero(prom: Any, job_id: str, rank: str) -> bool:
    """The killed rank's counter series was scraped at 0 at least twice before the kill."""
    res = prom.query(f'gpuwatch_oom_kills_total{{job_id="{job_id}",rank="{rank}"}}[1m]')
    return bool(res) and len(res[0]["values"]) >= 2 and all(float(v) == 0 for _, v in res[0]["values"])


def _kill(victim: subprocess.Popen[bytes]) -> float:
    """Let the victim allocate past its cgroup's limit; returns the monotonic time of the go."""
    t0 = time.monotonic()
    go(victim)
    victim.wait(timeout=30)
    assert victim.returncode == -9, victim.returncode  # SIGKILL from the OOM killer
    return t0


def test_oom_kill_pages_once_through_prometheus_and_alertmanager_every_panel_has_data(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], cgroups: list[MemCgroup], report: Any
) -> None:
    job_id = "e2e-llm-7"
    victim = _oom_victim(cgroups, procs)
    peer_cg = MemCgroup("h6e2epeer", 1 << 30)  # the peer's job limit: the host-memory panels
    cgroups.append(peer_cg)
    # the peer answers the flight-recorder request the daemon sends once it stalls
    # on CPU, so that the GIL sampler samples it (the GIL panels have data)
    blocked = tmp_path / "peer-blocked"  # once rank 1 is killed, rank 0 waits for it at 0 % CPU
    peer = sleeper(flight_recorder=(tmp_path / "node-a" / "ranks", job_id, 0), on_cpu=True, until=blocked)
    peer_cg.adopt(peer.pid)
    orphan = sleeper()  # holds GPU memory in the replay but belongs to no rank
    procs += [peer, orphan]
    node = Daemon(
        tmp_path,
        "a",
        nvml={
            "enabled": True,
            "fixture": str(
                derived_nvml_fixture(tmp_path / "nvml.json", {447: peer.pid, 449: victim.pid, 453: orphan.pid}, xid=13)
            ),
        },
        orphans={"grace_seconds": 0},
        gil={
            "enabled": True,
            "interval_seconds": 1,
            "duration_seconds": 0.5,
            "rate_hz": 20,
            "timeout_seconds": 5,
            "healthy_interval_seconds": 1,
        },  # every rank, for the panels
        stall={"after_seconds": 8},  # the peer's heartbeat is touched once: it stalls
    )
    node.register(job_id, 0, peer.pid, 2, gpus="0", heartbeat=tmp_path / "rank0.heartbeat")
    node.register(job_id, 1, victim.pid, 2, gpus="0", heartbeat=tmp_path / "rank1.heartbeat")
    for r in (0, 1):  # the step a heartbeat(step) writes: gpuwatch_rank_step for the step panels
        (tmp_path / f"rank{r}.heartbeat").write_text("100\n")
    (node.rank_dir / "broken.json").write_text('{"version": 1, "job_id": ')  # bad_rank_file
    with Webhook() as hook, alertmanager(tmp_path, shipped_alertmanager_config(hook.url)) as am:
        node.start()
        try:
            with prometheus(
                tmp_path, [node.address], rule_files=[RULES, RECORDING_RULES], alertmanager_url=am.url
            ) as prom:
                wait_until(lambda: _scraped_at_zero(prom, job_id, "1"), 30, "rank 1's OOM counter scraped at 0")
                t0 = _kill(victim)
                blocked.touch()
                got = wait_until(lambda: _oom_page(hook, job_id, "1"), 60, "the OOM page")
                latency = got[0] - t0
                alert = got[1]
                kill_wall = time.time() - (time.monotonic() - t0)
                (series,) = prom.query(f'gpuwatch_oom_kills_total{{job_id="{job_id}",rank="1"}}[2m]')
                scraped = min(float(ts) for ts, v in series["values"] if float(v) == 1)
                report(
                    f"\nOOM kill -> counter at 1 in Prometheus (1 s scrapes): "
                    f"{scraped - kill_wall:.2f} s; -> webhook page through Prometheus "
                    f"(1 s evaluation) + Alertmanager (1 s group_wait): {latency:.2f} s"
                )
                lab = alert["labels"]
                assert lab["severity"] == "critical"
                assert lab["instance"] == node.address
                assert (lab["comm"], lab["killer"]) == ("python", "kernel")
                desc = alert["annotations"]["description"]
                assert desc.startswith(
                    f"Rank 1 of job {job_id} on {node.address} lost process python to the kernel OOM killer"
                ), desc
                assert "1 other ranks of the job are still up and will wait" in desc, desc
                assert alert["annotations"]["runbook_url"].endswith("#gpurankoomkilled")

                # every panel of every dashboard, through Prometheus's HTTP API
                wait_until(
                    lambda: prom.query(f'gpuwatch_rank_gil_samples_total{{job_id="{job_id}"}} > 0'), 30, "GIL samples"
                )
                time.sleep(5)  # a $__rate_interval of samples after the kill
                empty = []
                for d, title, expr in dashboard_panels():
                    if any(s in expr for s in CONDITIONAL_SERIES):
                        continue  # nothing here to show (no pod, no memory limit on the daemon)
                    q = fill_vars(expr, instance=node.address, job_id=job_id)
                    if not prom.query(q):
                        empty.append(f"{d} / {title}: {q}")
                for d, name, q in dashboard_variable_queries():
                    q = fill_vars(q, instance=node.address, job_id=job_id)
                    if not prom.query(q):
                        empty.append(f"{d} / variable {name}: {q}")
                report(f"dashboard queries: {len(dashboard_panels())} panels, {len(empty)} without data")
                assert not empty, "\n".join(empty)

                # A minute later the killed rank is GPURankDown and its peer GPURankStalled in
                # Prometheus; Alertmanager inhibits both under the OOM page: no second page.
                def firing(name: str, rank: str) -> bool:
                    return any(
                        a["labels"]["alertname"] == name
                        and a["state"] == "firing"
                        and a["labels"].get("job_id") == job_id
                        and a["labels"].get("rank") == rank
                        for a in prom.alerts()
                    )

                wait_until(
                    lambda: firing("GPURankDown", "1") and firing("GPURankStalled", "0"),
                    120,
                    "GPURankDown and GPURankStalled firing in Prometheus",
                    step=1,
                )

                def suppressed() -> dict[str, list[str]] | None:
                    got = {
                        a["labels"]["alertname"]: a["status"]["inhibitedBy"]
                        for a in am.alerts()
                        if a["labels"].get("job_id") == job_id
                    }
                    ok = {"GPURankDown", "GPURankStalled"} <= set(got) and all(
                        got[n] for n in ("GPURankDown", "GPURankStalled")
                    )
                    return got if ok else None

                wait_until(suppressed, 15, "both inhibited in Alertmanager")
                time.sleep(3)  # a notification would have gone out by now (1 s group_interval)
                paged = {
                    (a["labels"]["alertname"], a["labels"].get("rank"))
                    for _, _, a in hook.alerts("/page")
                    if a["labels"].get("job_id") == job_id
                }
                assert paged == {("GPURankOOMKilled", "1")}, paged
        finally:
            node.stop()


def test_direct_push_and_rule_arrive_as_one_alert(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], cgroups: list[MemCgroup], report: Any
) -> None:
    """With alertmanager.url set the daemon pushes the page itself (Prometheus does not send
    alerts yet, so the page can only come from the push); then Prometheus's rule sends its copy:
    Alertmanager merges the two into one GPURankOOMKilled alert, not two."""
    job_id = "e2e-push"
    victim = _oom_victim(cgroups, procs)
    peer_cg = MemCgroup("h6e2epeer", 1 << 30)  # the peer's job limit: the host-memory panels
    cgroups.append(peer_cg)
    peer = peer_cg.spawn("import time; time.sleep(600)")
    procs.append(peer)
    with Webhook() as hook, alertmanager(tmp_path, shipped_alertmanager_config(hook.url)) as am:
        node = Daemon(tmp_path, "push", alertmanager={"url": am.url})
        node.register(job_id, 0, peer.pid, 2)
        node.register(job_id, 1, victim.pid, 2)
        node.start()
        try:
            with prometheus(tmp_path, [node.address], rule_files=[RULES]) as prom:
                wait_until(lambda: _scraped_at_zero(prom, job_id, "1"), 30, "rank 1's OOM counter scraped at 0")
                t0 = _kill(victim)
                t, pushed = wait_until(lambda: _oom_page(hook, job_id, "1"), 30, "the pushed page")
                report(f"\nOOM kill -> webhook page by direct push: {t - t0:.2f} s")
                assert pushed["labels"]["instance"] == node.address
                assert (pushed["labels"]["comm"], pushed["labels"]["killer"]) == ("python", "kernel")
                # the daemon's own explanation (events.py), not the rule's template
                push_desc = pushed["annotations"]["description"]
                assert f"job {job_id}" in push_desc and "lost process" not in push_desc

                def rule_firing() -> bool:
                    return any(
                        a["labels"]["alertname"] == "GPURankOOMKilled"
                        and a["labels"].get("job_id") == job_id
                        and a["state"] == "firing"
                        for a in prom.alerts()
                    )

                wait_until(rule_firing, 30, "the rule's alert firing in Prometheus")
                prom.send_alerts_to(am.url)

                def ours() -> list[dict[str, Any]]:
                    return [
                        a
                        for a in am.alerts()
                        if a["labels"]["alertname"] == "GPURankOOMKilled" and a["labels"].get("job_id") == job_id
                    ]

                # Prometheus's copy arrived when the annotations became the rule's
                wait_until(
                    lambda: any("lost process python" in a["annotations"]["description"] for a in ours()),
                    30,
                    "the rule's copy in Alertmanager",
                )
                in_am = ours()
                assert len(in_am) == 1, json.dumps(in_am, indent=1)
                assert in_am[0]["labels"]["rank"] == "1"
                assert in_am[0]["fingerprint"] == pushed["fingerprint"]
        finally:
            node.stop()


def test_several_nodes_one_job_first_oom_killed_rank_is_the_cause(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], cgroups: list[MemCgroup], report: Any
) -> None:
    """Ranks 0-5 of one job on three daemons acting as nodes (own ports, rank and state dirs),
    one Prometheus. Rank 3 (node b) is OOM-killed first, rank 0 (node a) 4 s later: the Job
    dashboard's queries and `gpuwatchd job` both name rank 3 as the cause and count the four live
    ranks as waiting."""
    job_id = "e2e-multi"
    nodes = [Daemon(tmp_path, n) for n in "abc"]
    victims = {0: _oom_victim(cgroups, procs), 3: _oom_victim(cgroups, procs)}
    for rank in range(6):
        p = victims.get(rank) or sleeper()
        if rank not in victims:
            procs.append(p)
        nodes[rank // 2].register(job_id, rank, p.pid, 6)
    try:
        for n in nodes:
            n.start()
        with prometheus(tmp_path, [n.address for n in nodes]) as prom:
            wait_until(lambda: len(prom.query(f'gpuwatch_rank_up{{job_id="{job_id}"}} == 1')) == 6, 30, "6 ranks up")
            wait_until(
                lambda: _scraped_at_zero(prom, job_id, "3") and _scraped_at_zero(prom, job_id, "0"), 30, "counters at 0"
            )
            _kill(victims[3])
            wait_until(
                lambda: prom.query(f'gpuwatch_rank_up{{job_id="{job_id}",rank="3"}} == 0'),
                30,
                "rank 3 down in Prometheus",
            )
            time.sleep(4)
            _kill(victims[0])
            wait_until(
                lambda: prom.query(f'gpuwatch_rank_up{{job_id="{job_id}",rank="0"}} == 0'),
                30,
                "rank 0 down in Prometheus",
            )
            wait_until(
                lambda: len(prom.query(f'gpuwatch_oom_kills_total{{job_id="{job_id}"}} > 0')) == 2, 30, "two kills"
            )

            # the Job dashboard's queries
            panels = {title: expr for d, title, expr in dashboard_panels() if d == "gpuwatchd-job.json"}

            def q(title: str) -> list[dict[str, Any]]:
                return prom.query(fill_vars(panels[title], job_id=job_id))

            # the subquery's steps are aligned to whole seconds: the newest failure shows up to
            # one step after the instant query sees it
            wait_until(lambda: len(q("Failed ranks, in order")) == 2, 10, "both failures dated")
            (first,) = q("First rank to fail")
            assert (first["metric"]["rank"], first["metric"]["instance"]) == ("3", nodes[1].address)
            order = [r["metric"]["rank"] for r in q("Failed ranks, in order")]
            assert order == ["3", "0"], order
            assert float(q("Ranks waiting on a failed rank")[0]["value"][1]) == 4
            assert float(q("Ranks down")[0]["value"][1]) == 2
            assert float(q("OOM kills")[0]["value"][1]) == 2
            assert float(q("Nodes")[0]["value"][1]) == 3

            # the on-call engineer's command
            p = subprocess.run(
                [sys.executable, "-m", "gpuwatchd", "job", job_id, "--prometheus", prom.url, "--json"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO,
            )
            assert p.returncode == 1, p.stdout + p.stderr
            view = json.loads(p.stdout)
            f = view["first_to_fail"]
            assert (f["rank"], f["instance"], f["state"]) == ("3", nodes[1].address, "oom_killed")
            assert sorted(w["rank"] for w in view["waiting"]) == ["1", "2", "4", "5"]
            assert view["counts"] == {"up": 4, "stalled": 0, "dead": 0, "oom_killed": 2, "missing": 0}
            text = subprocess.run(
                [sys.executable, "-m", "gpuwatchd", "job", job_id, "--prometheus", prom.url],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO,
            ).stdout
            report("\n" + text)
            assert f"first to fail: rank 3 on {nodes[1].address} OOM-killed" in text
            assert "4 ranks are waiting on it" in text
    finally:
        for n in nodes:
            n.stop()
