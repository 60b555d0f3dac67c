"""Ranks inside containers (issue 16), with real PID and mount namespaces (tests/containerutil.py:
``unshare --pid --fork --mount-proc``, private /tmp and /run, bind-mounted rank directory), real
memory-cgroup OOM kills and a real second user, through the real daemon, ``ps``, ``doctor`` and
``check``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from containerutil import Container
from daemonutil import REPO, DaemonProc, finding_jobs, write_config
from userutil import system_user, user_writes

USER = "gwtrustrank-c"
POD = REPO / "deploy" / "kubernetes" / "training-pod.example.yaml"


@pytest.fixture
def world() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gwtrustrank-ct-", dir="/tmp"))
    d.chmod(0o755)
    (d / "ranks").mkdir()
    (d / "ranks").chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for c in started:
        c.close()


def torchrun(job: str, rank: int) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": job, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}


def _state(d: DaemonProc) -> dict[str, Any]:
    """The daemon's state file (written just after /metrics shows a cycle: wait for the first)."""
    path = Path(d.cfg["state_dir"]) / "state.json"
    d.wait_for(path.exists, what="state.json")
    return dict(json.loads(path.read_text()))


def _findings(d: DaemonProc, kind: str) -> list[dict[str, Any]]:
    return [f for f in _state(d)["findings"] if f["kind"] == kind]


def _cli(cfg_path: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args, "--config.file", str(cfg_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    return out.stdout + out.stderr


def _beating(d: DaemonProc, job: str, seconds: float, quiet: tuple[str, ...] | None = None) -> None:
    """For ``seconds``: up, progress advancing, never stalled, and no rank_down: of any job, or,
    where the daemon discovers ranks (it then sees the whole host, other suites' ranks too), of the
    jobs ``quiet``."""
    end = time.monotonic() + seconds
    first = d.value("gpuwatch_rank_progress_timestamp_seconds", job_id=job, rank="0")
    assert first is not None, d.text()
    while time.monotonic() < end:
        assert d.value("gpuwatch_rank_up", job_id=job, rank="0") == 1.0, d.text()
        down = finding_jobs(d, "rank_down")
        assert not (down if quiet is None else down & set(quiet)), d.text()
        assert d.value("gpuwatch_finding", kind="rank_stalled", job_id=job) is None, d.text()
        time.sleep(0.2)
    last = d.value("gpuwatch_rank_progress_timestamp_seconds", job_id=job, rank="0")
    assert last is not None and last > first, (first, last)


def test_pod_spec_path_rank_is_watched_then_rank_down(world: Path, containers: list[Container]) -> None:
    """What deploy/kubernetes/training-pod.example.yaml says, enacted: the host's rank directory
    bind-mounted at the pod's mountPath, the pod's env, register_rank() from torchrun's variables
    and heartbeat() every 0.25 s, in a new PID namespace (the rank is PID 1 there)."""
    pod = yaml.safe_load(POD.read_text())
    [ctr] = pod["spec"]["containers"]
    [vol] = pod["spec"]["volumes"]
    [mount] = ctr["volumeMounts"]
    assert mount["name"] == vol["name"] and vol["hostPath"]["path"] == "/run/gpuwatch/ranks"
    assert not mount.get("readOnly")  # the pod writes its rank file there
    env = {e["name"]: e["value"] for e in ctr["env"]}
    ranks = world / "ranks"  # stands in for the node's /run/gpuwatch/ranks
    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:
        c = Container({**env, **torchrun("podjob", 0)}, {str(ranks): mount["mountPath"]})
        containers.append(c)
        assert c.inner_pid == 1 and c.pid != 1
        doc = json.loads((ranks / "podjob.0.json").read_text())
        assert doc["ranks"][0]["pid"] == 1
        assert doc["ranks"][0]["pid_ns"] == os.stat(f"/proc/{c.pid}/ns/pid").st_ino
        d.wait_for(
            lambda: d.value("gpuwatch_rank_info", job_id="podjob", rank="0", pid=str(c.pid)) == 1.0,
            what="the pod's rank by its host PID",
        )
        _beating(d, "podjob", 3.0)
        ps = _cli(path, "ps")
        assert f"pid {c.pid} (1 in its container)" in ps, ps
        doctor = _cli(path, "doctor", str(c.pid))
        assert f"PID {c.pid} (1 in its container)" in doctor and "rank 0 of job podjob" in doctor
        c.kill()
        t_kill = time.monotonic()
        d.wait_for(
            lambda: d.value("gpuwatch_finding", kind="rank_down", job_id="podjob", rank="0") == 1.0, what="rank_down"
        )
        took = time.monotonic() - t_kill
        [down] = _findings(d, "rank_down")
    finally:
        d.stop()
    # the next cycle sees it (interval 0.5 s); the bound leaves room for a loaded CI machine
    print(f"rank_down {took:.2f} s after the kill")
    assert took < 3.0, took
    assert f"pid {c.pid} (1 in its container)" in down["explanation"]
    assert down["pid"] == str(c.pid)


def test_two_containers_both_pid_1_are_told_apart(world: Path, containers: list[Container]) -> None:
    """Two pods, each rank PID 1 of its own namespace, heartbeats in their private /tmp; and a user
    who copies one pod's namespace and start time into a rank file of their own borrows nothing."""
    ranks = world / "ranks"
    path, cfg = write_config(world, rank_dir=str(ranks))
    binds = {str(ranks): "/run/gpuwatch/ranks"}
    a = Container({**torchrun("pod-a", 0), "GW_HEARTBEAT": "/tmp/a.hb"}, binds)
    containers.append(a)
    b = Container({**torchrun("pod-b", 0), "GW_HEARTBEAT": "/tmp/b.hb"}, binds)
    containers.append(b)
    assert a.inner_pid == b.inner_pid == 1
    assert not Path("/tmp/a.hb").exists()  # each heartbeat is only in its pod's own /tmp
    entry_a = json.loads((ranks / "pod-a.0.json").read_text())["ranks"][0]
    with system_user(USER):
        user_writes(
            USER,
            ranks / "borrow.json",
            json.dumps(
                {
                    "version": 1,
                    "job_id": "borrow",
                    "ranks": [
                        {"rank": 0, "pid": 1, "pid_ns": entry_a["pid_ns"], "start_ticks": entry_a["start_ticks"]}
                    ],
                }
            ),
        )
        d = DaemonProc(path, cfg)
        try:
            d.wait_for(
                lambda: (
                    d.value("gpuwatch_rank_info", job_id="pod-a", pid=str(a.pid)) == 1.0
                    and d.value("gpuwatch_rank_info", job_id="pod-b", pid=str(b.pid)) == 1.0
                ),
                what="both pods' ranks, each by its own host PID",
            )
            _beating(d, "pod-a", 2.0)
            _beating(d, "pod-b", 0.5)
            # heartbeat(step): the step is read in the pod's /tmp too, not in the daemon's
            d.wait_for(
                lambda: (
                    (d.value("gpuwatch_rank_step", job_id="pod-a", rank="0") or 0) > 0
                    and (d.value("gpuwatch_rank_step", job_id="pod-b", rank="0") or 0) > 0
                ),
                what="both pods' steps",
            )
            assert d.value("gpuwatch_rank_info", job_id="borrow") is None
            reasons = [f["explanation"] for f in _findings(d, "bad_rank_file")]
            assert any("borrow.json" in r and "no process is pid 1" in r for r in reasons), reasons
            b.kill()
            d.wait_for(lambda: d.value("gpuwatch_finding", kind="rank_down", job_id="pod-b") == 1.0, what="pod-b down")
            assert d.value("gpuwatch_rank_up", job_id="pod-a", rank="0") == 1.0
            assert d.value("gpuwatch_finding", kind="rank_down", job_id="pod-a") is None
        finally:
            d.stop()


@contextlib.contextmanager
def memory_cgroup(*parts: str, limit: int | None = None) -> Iterator[str]:
    """A real memory cgroup at a path like kubelet's or slurmd's (below a unique top directory),
    removed afterwards; ``limit`` in bytes on the leaf."""
    v1 = Path("/sys/fs/cgroup/memory/cgroup.procs").exists()
    top = Path("/sys/fs/cgroup/memory" if v1 else "/sys/fs/cgroup") / f"gwtrustrank-{uuid.uuid4().hex[:8]}"
    chain = [top]
    for part in parts:
        chain.append(chain[-1] / part)
    for d in chain:
        d.mkdir()
        if not v1 and d != chain[-1]:  # v2: the controller must be enabled down the path
            (d / "cgroup.subtree_control").write_text("+memory")
    if limit is not None:
        (chain[-1] / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(limit))
    try:
        yield str(chain[-1])
    finally:
        for d in reversed(chain):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


@pytest.fixture
def pod_cgroup() -> Iterator[tuple[str, str]]:
    """A memory cgroup at a kubelet-style path (cgroupfs driver), limit 64 MiB."""
    pod_uid = str(uuid.uuid4())
    with memory_cgroup("kubepods", "burstable", f"pod{pod_uid}", "c" * 64, limit=64 << 20) as leaf:
        yield leaf, pod_uid


def test_oom_kill_of_a_containerised_rank_is_attributed_to_it(
    world: Path, containers: list[Container], pod_cgroup: tuple[str, str]
) -> None:
    leaf, pod_uid = pod_cgroup
    ranks = world / "ranks"
    path, cfg = write_config(world, rank_dir=str(ranks), kernel_log="kmsg")
    d = DaemonProc(path, cfg)
    try:
        c = Container(
            {**torchrun("oompod", 0), "GW_WAIT_GO": "1", "GW_HEARTBEAT": "/tmp/hb"},
            {str(ranks): "/run/gpuwatch/ranks"},
            cgroup=leaf,
        )
        containers.append(c)
        d.wait_for(
            lambda: d.value("gpuwatch_oom_kills_total", job_id="oompod", rank="0") == 0.0,
            what="the pod's rank watched, its OOM series at 0",
        )
        assert d.value("gpuwatch_rank_info", job_id="oompod", pid=str(c.pid)) == 1.0
        [rank] = [r for r in _state(d)["ranks"] if r["job_id"] == "oompod"]
        assert rank["ns_pid"] == 1 and rank["container"] == f"Kubernetes pod {pod_uid}"
        doctor = _cli(path, "doctor", str(c.pid))
        assert f"Kubernetes pod {pod_uid}" in doctor, doctor
        c.go()
        assert c.proc.wait(30) != 0
        d.wait_for(
            lambda: d.value("gpuwatch_oom_kills_total", job_id="oompod", rank="0") == 1.0,
            what="the kill counted for the pod's rank",
        )
        d.wait_for(lambda: bool(_findings(d, "rank_oom_killed")), what="the finding")
        [oom] = _findings(d, "rank_oom_killed")
        downs = _findings(d, "rank_down")
        events = Path(cfg["state_dir"]) / "events.jsonl"
        d.wait_for(
            lambda: (
                events.exists()
                and any(
                    json.loads(x).get("kind") == "rank_down" and f"Kubernetes pod {pod_uid}" in x
                    for x in events.read_text().splitlines()
                )
            ),
            what="the rank_down event naming the pod",
        )
    finally:
        d.stop()
    assert oom["job_id"] == "oompod" and oom["pid"] == str(c.pid), oom
    assert f"(pid {c.pid}," in oom["explanation"], oom
    assert oom["explanation"].endswith(f"; rank pid 1 in its container, Kubernetes pod {pod_uid}")
    assert all(f"Kubernetes pod {pod_uid}" in f["explanation"] for f in downs), downs


def test_discovery_and_slurm_tasks_in_containers(world: Path, containers: list[Container]) -> None:
    """A container process that only has torchrun's variables is discovered by its host PID; a
    Slurm task in a container (Apptainer --pid, Docker) registers from SLURM_* variables. The job
    ids are this run's own: discovery sees the whole host, where another suite may run this test."""
    ranks = world / "ranks"
    path, cfg = write_config(world, rank_dir=str(ranks), discovery={"enabled": True, "interval_seconds": 1})
    env_job, slurm_job = f"envpod-{uuid.uuid4().hex[:8]}", str(uuid.uuid4().int % 10**9)
    found = Container({**torchrun(env_job, 0), "GW_REGISTER": "0"})
    containers.append(found)
    with memory_cgroup("slurm", "uid_0", f"job_{slurm_job}", "step_0", "task_0") as task_cgroup:
        slurm = Container(
            {
                "SLURM_JOB_ID": slurm_job,
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NTASKS": "1",
            },
            {str(ranks): "/run/gpuwatch/ranks"},
            cgroup=task_cgroup,
        )
        containers.append(slurm)
        try:
            _discover_both(path, cfg, (env_job, found), (slurm_job, slurm))
        finally:
            slurm.close()


def _discover_both(path: Path, cfg: dict[str, Any], found: tuple[str, Container], slurm: tuple[str, Container]) -> None:
    (env_job, env_c), (slurm_id, slurm_c) = found, slurm
    slurm_job = f"{slurm_id}.0"
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_info", job_id=env_job, pid=str(env_c.pid)) == 1.0
                and d.value("gpuwatch_rank_info", job_id=slurm_job, pid=str(slurm_c.pid)) == 1.0
            ),
            what="the discovered and the Slurm rank by host PID",
            timeout=20,
        )
        by_job = {r["job_id"]: r for r in _state(d)["ranks"]}
        assert by_job[env_job]["ns_pid"] == 1 and by_job[slurm_job]["ns_pid"] == 1
        assert by_job[slurm_job]["container"] == f"Slurm job {slurm_id} step 0"  # its real cgroup
        assert len([r for r in _state(d)["ranks"] if r["job_id"] == slurm_job]) == 1
        _beating(d, slurm_job, 1.0, quiet=(env_job, slurm_job))
    finally:
        d.stop()


def test_check_does_not_call_a_containerised_rank_an_orphan(world: Path, containers: list[Container]) -> None:
    """gpuwatchd check (Slurm prolog) with NVML replayed from the H200 recording, its rank PIDs
    mapped onto the container's host PID (NVML reports host PIDs): the rank is not an offender,
    a real stale holder is."""
    import io

    from gpuwatchd.cli import check
    from gpuwatchd.config.schema import load_config
    from gpuwatchd.sources.nvml import NvmlSource
    from gpuwatchd.sources.nvml_fixture import RecordedNvml

    ranks = world / "ranks"
    c = Container(torchrun("ckpod", 0), {str(ranks): "/run/gpuwatch/ranks"})
    containers.append(c)
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        fixture = REPO / "tests" / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
        lib = RecordedNvml(
            json.loads(fixture.read_text()), pid_map={447: c.pid, 449: c.pid, 450: c.pid, 453: stale.pid}
        )
        cfg_file = world / "check.yaml"
        cfg_file.write_text(f"rank_dir: {ranks}\nnvml:\n  fixture: {fixture}\n")
        inputs = check.default_inputs(load_config(str(cfg_file)), None, 5.0)
        source = NvmlSource(pynvml=lib)
        inputs.read_nvml = lambda: check.read_with_timeout(source, 5.0)
        out = io.StringIO()
        assert check.run_check(inputs, [], as_json=True, out=out) == 1
        offenders = json.loads(out.getvalue())["offenders"]
    finally:
        stale.kill()
        stale.wait(10)
    assert [o["pid"] for o in offenders] == [stale.pid], offenders


def test_an_unresolvable_claim_costs_one_pass_over_proc_per_retry(containers: list[Container]) -> None:
    """A rank file naming a PID that no process of the namespace has: looked for once, then again
    only after retry_seconds; the pod's real rank beside it resolves every time without a pass."""
    from gpuwatchd.model import RankEntry
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.pidns import PidNamespaces
    from gpuwatchd.sources.procfs import ProcfsReader

    c = Container({**torchrun("cost", 0), "GW_REGISTER": "0"})
    containers.append(c)
    procfs = ProcfsReader(HostPaths())
    ns = procfs.pid_ns(c.pid)
    start = procfs.start_ticks(c.pid)
    assert ns is not None and start is not None
    now = [1000.0]
    resolver = PidNamespaces(procfs, retry_seconds=30.0, clock=lambda: now[0])
    good = RankEntry(job_id="cost", rank=0, pid=1, pid_ns=ns, start_ticks=start, owner_uid=0)
    ghost = RankEntry(job_id="ghost", rank=0, pid=77, pid_ns=ns, start_ticks=start, owner_uid=0, path="/r/ghost.json")
    for _ in range(5):
        out, bad = resolver.resolve([good, ghost])
        assert [(e.job_id, e.pid, e.ns_pid) for e in out] == [("cost", c.pid, 1)]
        assert [b.path for b in bad] == ["/r/ghost.json"] and "no process is pid 77" in bad[0].reason
        now[0] += 1.0
    assert resolver.scans == 1
    now[0] += 30.0
    resolver.resolve([good, ghost])
    assert resolver.scans == 2


def test_host_side_registration_of_a_container_process(world: Path, containers: list[Container]) -> None:
    """A prolog on the host registers a container's process by its host PID (`gpuwatchd register
    --pid HOSTPID`): the file carries no pid_ns (the writer is on the host), the PID is taken as
    the host's, and the in-container PID is still shown."""
    from gpuwatchd.paths import HostPaths
    from gpuwatchd.sources.pidns import PidNamespaces
    from gpuwatchd.sources.procfs import ProcfsReader
    from gpuwatchd.sources.rankfiles import RankFileReader, guard_entries

    ranks = world / "ranks"
    c = Container({"GW_REGISTER": "0"})
    containers.append(c)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--rank-dir",
            str(ranks),
            "--job-id",
            "hostreg",
            "--rank",
            "0",
            "--pid",
            str(c.pid),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    [entry] = json.loads((ranks / "hostreg.0.json").read_text())["ranks"]
    assert entry["pid"] == c.pid and "pid_ns" not in entry
    entries, bad = RankFileReader(str(ranks)).scan()
    got, bad = guard_entries(entries, bad, "/proc", PidNamespaces(ProcfsReader(HostPaths())))
    assert bad == [] and [(e.job_id, e.pid, e.ns_pid) for e in got] == [("hostreg", c.pid, 1)]


@pytest.mark.parametrize(
    "cgroup,expected",
    [
        # kubelet, systemd cgroup driver (cgroup v2), as /proc/PID/cgroup shows it
        (
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b8d2c4e_3f7a_4e8b_9a1c_"
            "2d3e4f5a6b7c.slice/cri-containerd-" + "ab" * 32 + ".scope\n",
            "Kubernetes pod 0b8d2c4e-3f7a-4e8b-9a1c-2d3e4f5a6b7c",
        ),
        # kubelet, cgroupfs driver, guaranteed QoS (cgroup v1, several hierarchies)
        (
            "12:memory:/kubepods/pod0b8d2c4e-3f7a-4e8b-9a1c-2d3e4f5a6b7c/" + "cd" * 32 + "\n"
            "11:cpu,cpuacct:/kubepods/pod0b8d2c4e-3f7a-4e8b-9a1c-2d3e4f5a6b7c/" + "cd" * 32 + "\n",
            "Kubernetes pod 0b8d2c4e-3f7a-4e8b-9a1c-2d3e4f5a6b7c",
        ),
        # slurmd, cgroup v2
        ("0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n", "Slurm job 1234 step 0"),
        ("0::/system.slice/slurmstepd.scope/job_1234/step_batch/user/task_0\n", "Slurm job 1234 step batch"),
        ("0::/system.slice/docker-" + "0123456789ab" + "e" * 52 + ".scope\n", "Docker container 0123456789ab"),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", ""),
        ("garbage", ""),
    ],
)
def test_container_identity_from_cgroup_paths(cgroup: str, expected: str) -> None:
    from gpuwatchd.sources.containers import identity

    assert identity(cgroup) == expected
