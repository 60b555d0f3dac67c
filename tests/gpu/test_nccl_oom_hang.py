"""The seeds' central story, for real: one rank OOM-killed, its peer hung in all_reduce (marker gpu).

A two-rank job is launched as two nodes would launch it: two torchrun agents (``--nnodes 2``,
one worker each, static rendezvous on loopback). One agent for both ranks would not do: its
monitor (every 0.1 s) kills the surviving worker as soon as one fails, so the survivor never
hangs; across nodes nobody does that, and the survivors wait in their next collective. The
training script (two_rank_train.py) registers each rank with ``gpuwatchd.register_rank()`` and
calls ``gpuwatchd.heartbeat(step)``; both ranks share cuda:0 with the gloo backend (NCCL refuses
two ranks on one GPU; the script says why its forked helper keeps gloo waiting like NCCL would).

The real daemon (``python -m gpuwatchd run``, kernel log from /dev/kmsg, py-spy stall dumps, NVML
on a GPU) watches. The test moves rank 1 into a memory cgroup and lets it leak host memory until
the kernel OOM-kills it, then measures on /metrics, scraped every 50 ms:

1. OOM kill (pidfd of rank 1 readable) -> ``rank_oom_killed`` for rank 1 with its RSS;
2. rank 0's last heartbeat + ``stall.after_seconds`` -> ``rank_stalled`` for rank 0, its stack in
   all_reduce, rank 1 named as the suspect;
3. the process group's timeout ends rank 0 (pidfd readable) -> its ``rank_exit`` event, "exited
   with code 1 ... after rank 1 failed: ended after it", and no second page: what pages is decided
   for the job's first failure on the node only (docs/runbooks.md, "Rank exits"), rank 1's OOM
   kill, still paged.

Each must arrive within one daemon cycle (plus scheduling slack). The same job with the legacy
``NCCL_ASYNC_ERROR_HANDLING`` instead of ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` raises
``nccl_legacy_env`` for both ranks (and the first run, with the current name, does not).

``GPUWATCH_TEST_DEVICE=cpu`` runs the ranks on CPU tensors (development without a GPU; the skip
rule of tests/gpu still applies under pytest).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))

from daemonutil import DaemonProc, free_port, write_config  # noqa: E402
from kernel_oom_helpers import MemCgroup  # noqa: E402

from gpuwatchd.events.log import read_events  # noqa: E402
from gpuwatchd.model.events import Event  # noqa: E402

DEVICE = os.environ.get("GPUWATCH_TEST_DEVICE", "cuda")
INTERVAL = 0.5  # daemon cycle
AFTER = 2.0  # stall.after_seconds
PG_TIMEOUT = 12.0  # init_process_group(timeout=...): how long rank 0 waits in all_reduce
SLACK = 0.5  # scheduling on a loaded host, on top of one cycle
LIMIT = 192 << 20  # memory cgroup limit for rank 1 (charged from the move on)
LEGACY = "NCCL_ASYNC_ERROR_HANDLING"
CURRENT = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def enable_memory_controller() -> None:
    """cgroup v2: the root must delegate the memory controller before a child has memory.max."""
    root = "/sys/fs/cgroup"
    if os.path.exists(os.path.join(root, "memory", "cgroup.procs")):
        return  # v1
    ctl = os.path.join(root, "cgroup.subtree_control")
    with open(ctl) as f:
        if "memory" in f.read().split():
            return
    with open(ctl, "w") as f:
        f.write("+memory")


class ExitWatch:
    """When a process (not our child: torchrun's worker) exits, from its pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.at: float | None = None
        self._fd = os.pidfd_open(pid)
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        select.select([self._fd], [], [])
        self.at = time.time()
        os.close(self._fd)


class Job:
    """Two torchrun agents (node 0 and node 1), one rank each."""

    def __init__(self, tmp: Path, job_id: str, rank_dir: str, env_var: str) -> None:
        self.tmp, self.job_id, self.rank_dir = tmp, job_id, rank_dir
        self.out = tmp / f"{job_id}.out"
        self.out.mkdir()
        self.trigger = tmp / f"{job_id}.leak"
        env = {k: v for k, v in os.environ.items() if k not in (LEGACY, CURRENT)}
        env.update(
            {
                env_var: "1",
                "GPUWATCH_RANK_DIR": rank_dir,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "PYTHONUNBUFFERED": "1",
            }
        )
        port = str(free_port())
        self.agents: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        for node in (0, 1):
            log = tmp / f"{job_id}.node{node}.log"
            self.logs.append(log)
            with open(log, "wb") as f:
                self.agents.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--nnodes",
                            "2",
                            "--node-rank",
                            str(node),
                            "--nproc-per-node",
                            "1",
                            "--rdzv-backend",
                            "static",
                            "--rdzv-id",
                            job_id,
                            "--master-addr",
                            "127.0.0.1",
                            "--master-port",
                            port,
                            "--max-restarts",
                            "0",
                            "--monitor-interval",
                            "0.1",
                            str(HERE / "two_rank_train.py"),
                            "--device",
                            DEVICE,
                            "--timeout-seconds",
                            str(PG_TIMEOUT),
                            "--leak-rank",
                            "1",
                            "--leak-when",
                            str(self.trigger),
                            "--out",
                            str(self.out),
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=str(tmp),
                        start_new_session=True,
                    )
                )

    def log(self) -> str:
        return "\n".join(f"--- node {i} ---\n" + p.read_text(errors="replace")[-4000:] for i, p in enumerate(self.logs))

    def pid(self, rank: int) -> int:
        doc = json.loads((Path(self.rank_dir) / f"{self.job_id}.{rank}.json").read_text())
        return int(doc["ranks"][0]["pid"])

    def steps(self, rank: int) -> int:
        try:
            return int((self.out / f"{rank}.step").read_text())
        except (OSError, ValueError):
            return -1

    def close(self) -> None:
        pids = []  # workers run in their own sessions; helpers outlive a killed rank
        for rank in (0, 1):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids.append(self.pid(rank))
            with contextlib.suppress(OSError, ValueError):
                pids.append(int((self.out / f"{rank}.helper").read_text()))
        for pid in pids:
            kill_ours(pid)
        for agent in self.agents:
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(30)


def kill_ours(pid: int) -> None:
    """SIGKILL ``pid`` only while it still runs our training script (no reused PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"two_rank_train.py" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def wait_until(pred: Callable[[], bool], timeout: float, what: str, job: Job, d: DaemonProc) -> float:
    """Poll every 50 ms; the wall-clock time at which ``pred`` first held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.time()
        time.sleep(0.05)
    raise AssertionError(
        f"timed out waiting for {what}\njob log:\n{job.log()}\ndaemon log:\n{d.log()[-4000:]}\nmetrics:\n{d.text()}"
    )


def exit_event(d: DaemonProc, job_id: str, rank: int) -> Event | None:
    """The rank's ``rank_exit`` event, read as ``gpuwatchd events`` reads the log (a line torn by
    the daemon's append in progress is skipped), or None."""
    log = str(Path(d.cfg["state_dir"]) / "events.jsonl")
    return next(
        (e for e in read_events(log) if e.kind == "rank_exit" and e.job_id == job_id and e.rank == str(rank)), None
    )


def finding(d: DaemonProc, kind: str, job_id: str, rank: int) -> dict[str, Any] | None:
    state = json.loads((Path(d.cfg["state_dir"]) / "state.json").read_text())
    for f in state["findings"]:
        if f["kind"] == kind and f["job_id"] == job_id and f["rank"] == str(rank):
            return dict(f)
    return None


def on_metrics(d: DaemonProc, kind: str, job_id: str, rank: int) -> bool:
    return d.value("gpuwatch_finding", kind=kind, job_id=job_id, rank=str(rank)) == 1.0


@contextlib.contextmanager
def daemon(tmp: Path) -> Iterator[DaemonProc]:
    cfg_path, cfg = write_config(
        tmp,
        interval_seconds=INTERVAL,
        kernel_log="kmsg",
        stall={"after_seconds": AFTER},
        nvml={"enabled": DEVICE == "cuda"},
    )
    d = DaemonProc(cfg_path, cfg)
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


def start_job(tmp: Path, d: DaemonProc, job_id: str, env_var: str) -> Job:
    job = Job(tmp, job_id, d.cfg["rank_dir"], env_var)
    wait_until(
        lambda: (
            all(d.value("gpuwatch_rank_up", job_id=job_id, rank=str(r)) == 1.0 for r in (0, 1))
            and min(job.steps(0), job.steps(1)) >= 5
        ),
        180,
        "both ranks registered, up and training",
        job,
        d,
    )
    return job


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_oom_killed_rank_its_peer_hangs_in_all_reduce_then_times_out(tmp_path: Path) -> None:
    job_id = "llm-7"
    enable_memory_controller()
    cg = MemCgroup("h8nccl", limit_bytes=LIMIT)
    with daemon(tmp_path) as d:
        job = start_job(tmp_path, d, job_id, CURRENT)
        try:
            pid0, pid1 = job.pid(0), job.pid(1)
            for r in (0, 1):
                assert not on_metrics(d, "nccl_legacy_env", job_id, r)
            with open(os.path.join(cg.path, "cgroup.procs"), "w") as f:
                f.write(str(pid1))  # where Slurm / the kubelet would have started it
            exit0, exit1 = ExitWatch(pid0), ExitWatch(pid1)
            last_rss = [0]

            def sample_rss() -> None:
                while exit1.at is None:
                    with contextlib.suppress(OSError, ValueError):
                        last_rss[0] = max(last_rss[0], vm_rss(pid1))
                    time.sleep(0.01)

            threading.Thread(target=sample_rss, daemon=True).start()
            job.trigger.write_text("leak\n")

            # 1. the kernel kills rank 1
            wait_until(lambda: exit1.at is not None, 60, "rank 1 to be OOM-killed", job, d)
            t_oom = wait_until(
                lambda: on_metrics(d, "rank_oom_killed", job_id, 1), 10, "rank_oom_killed on /metrics", job, d
            )
            assert exit1.at is not None
            lat_oom = t_oom - exit1.at
            assert cg.oom_kills() == 1
            assert d.value("gpuwatch_oom_kills_total", job_id=job_id, rank="1") == 1.0
            oom = finding(d, "rank_oom_killed", job_id, 1)
            assert oom is not None and oom["pid"] == str(pid1)
            rss = oom["evidence"]["rss_bytes"]
            assert isinstance(rss, int) and rss >= 0.9 * last_rss[0] > 0, (rss, last_rss)
            assert oom["evidence"]["memcg"].endswith(cg.name)
            assert oom["evidence"]["peers_alive"] == 1
            assert "1 peers alive" in oom["explanation"]
            print(
                f"\nPASS rank_oom_killed: rank 1 pid {pid1} killed at {exit1.at:.3f}, on /metrics "
                f"{lat_oom * 1e3:.0f} ms later (cycle {INTERVAL * 1e3:.0f} ms); kernel RSS "
                f"{rss / 2**20:.0f} MiB (last VmRSS seen {last_rss[0] / 2**20:.0f} MiB)\n"
                f"     finding: {oom['explanation']}",
                flush=True,
            )
            assert lat_oom <= INTERVAL + SLACK

            # 2. rank 0 waits in all_reduce: no heartbeat for after_seconds -> rank_stalled
            t_stall = wait_until(
                lambda: on_metrics(d, "rank_stalled", job_id, 0), 30, "rank_stalled for rank 0", job, d
            )
            assert exit0.at is None, "rank 0 ended before it was seen stalled"
            hb = os.stat(Path(d.cfg["rank_dir"]) / f"{job_id}.0.hb").st_mtime
            lat_stall = t_stall - (hb + AFTER)
            stall = finding(d, "rank_stalled", job_id, 0)
            assert stall is not None and stall["pid"] == str(pid0)
            ev = stall["evidence"]
            assert ev["method"] == "heartbeat" and ev["suspect_ranks"] == [1], ev
            assert (
                ev["stuck_frames"][0].startswith("all_reduce (") and "distributed_c10d.py" in ev["stuck_frames"][0]
            ), ev["stuck_frames"]
            assert any(fr.startswith("train_step (two_rank_train.py:") for fr in ev["stuck_frames"])
            assert f"suspect: rank 1 (pid {pid1}) dead" in stall["explanation"]
            assert d.value("gpuwatch_rank_stalled", job_id=job_id, rank="0") == 1.0
            print(
                f"PASS rank_stalled: rank 0 pid {pid0} last heartbeat {hb:.3f}, stalled from "
                f"{hb + AFTER:.3f} (after {AFTER:.1f} s), on /metrics {lat_stall * 1e3:.0f} ms "
                f"later; {t_stall - exit1.at:.2f} s after the kill\n"
                f"     finding: {stall['explanation']}",
                flush=True,
            )
            assert -0.05 <= lat_stall <= INTERVAL + SLACK

            # 3. the process group's timeout ends rank 0 -> its exit, named after rank 1's; no page
            wait_until(lambda: exit0.at is not None, PG_TIMEOUT + 30, "rank 0 to time out", job, d)
            t_exit = wait_until(lambda: exit_event(d, job_id, 0) is not None, 10, "rank 0's rank_exit event", job, d)
            assert exit0.at is not None
            lat_exit = t_exit - exit0.at
            hung = exit0.at - exit1.at
            assert PG_TIMEOUT - 1 <= hung <= PG_TIMEOUT + 10, hung  # it waited, not failed at once
            ev0 = exit_event(d, job_id, 0)
            assert ev0 is not None and ev0.fields["cause"] == "exit_nonzero", ev0
            assert ev0.fields["first_rank"] == 1 and "after rank 1 failed: ended after it" in ev0.summary, ev0
            wait_until(
                lambda: (
                    d.value("gpuwatch_rank_up", job_id=job_id, rank="0") == 0.0
                    and not on_metrics(d, "rank_stalled", job_id, 0)
                ),
                INTERVAL + SLACK,
                "rank 0 down and no longer stalled",
                job,
                d,
            )
            assert d.value("gpuwatch_rank_exits_total", cause="exit_nonzero", job_id=job_id, rank="0") == 1.0
            # past the launcher's teardown grace: rank 0 never pages, rank 1's page stays
            quiet_until = time.monotonic() + 10.0 + 2 * INTERVAL
            while time.monotonic() < quiet_until:
                assert not on_metrics(d, "rank_down", job_id, 0), finding(d, "rank_down", job_id, 0)
                time.sleep(0.1)
            assert on_metrics(d, "rank_oom_killed", job_id, 1)
            assert job.agents[0].wait(30) != 0
            node0 = job.logs[0].read_text(errors="replace")
            assert "Timed out" in node0 or "timed out" in node0, node0[-3000:]
            print(
                f"PASS rank 0 exit: rank 0 pid {pid0} ended {hung:.2f} s after the kill "
                f"(process group timeout {PG_TIMEOUT:.0f} s), its event {lat_exit * 1e3:.0f} ms "
                f"later, no page of its own\n     event: {ev0.summary}",
                flush=True,
            )
            assert lat_exit <= INTERVAL + SLACK
        finally:
            job.close()
            cg.remove()


def test_same_job_with_the_legacy_variable_raises_nccl_legacy_env(tmp_path: Path) -> None:
    job_id = "llm-7-legacy"
    with daemon(tmp_path) as d:
        job = start_job(tmp_path, d, job_id, LEGACY)
        try:
            t0 = time.time()
            lines = []
            for r in (0, 1):
                wait_until(
                    functools.partial(on_metrics, d, "nccl_legacy_env", job_id, r),
                    10,
                    f"nccl_legacy_env for rank {r}",
                    job,
                    d,
                )
                f = finding(d, "nccl_legacy_env", job_id, r)
                assert f is not None and f["evidence"]["variables"] == [LEGACY]
                assert f"{LEGACY} (use {CURRENT})" in f["explanation"]
                assert not on_metrics(d, "nccl_error_handling_off", job_id, r)
                lines.append(f"     finding: {f['explanation']}")
            print(
                f"\nPASS nccl_legacy_env on both ranks ({time.time() - t0:.2f} s after both were "
                "up)\n" + "\n".join(lines),
                flush=True,
            )
        finally:
            job.close()
