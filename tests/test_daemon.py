"""End to end through the real daemon process, real rank processes and a real HTTP scrape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from daemonutil import DaemonProc, has_finding, write_config

# Opens fds in steps of 100 up to 900 under a soft limit of 1024, then waits.
FD_CHILD = r"""
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))
fds = []
target = 900 - len(os.listdir('/proc/self/fd'))
while len(fds) < target:
    fds += [os.open('/dev/null', os.O_RDONLY) for _ in range(min(100, target - len(fds)))]
    time.sleep(0.3)
print('ready', flush=True)
time.sleep(120)
"""


def spawn(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )


def register(cfg: dict, job: str, rank: int, pid: int, *extra: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--rank-dir",
            cfg["rank_dir"],
            "--job-id",
            job,
            "--rank",
            str(rank),
            "--pid",
            str(pid),
            *extra,
        ],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    path, cfg = write_config(tmp_path, fds={"min_window_seconds": 1.0})
    d = DaemonProc(path, cfg)
    yield d
    d.stop()


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_fd_rank_is_watched_then_goes_down(daemon: DaemonProc) -> None:
    child = spawn(FD_CHILD)
    try:
        register(daemon.cfg, "llm-7", 3, child.pid, "--local-rank", "3", "--world-size", "16")
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        labels = {"job_id": "llm-7", "rank": "3"}
        daemon.wait_for(
            lambda: daemon.value("gpuwatch_rank_open_fds", **labels) == proc_fds(child.pid),
            what="open fds to match /proc",
        )
        assert daemon.value("gpuwatch_rank_max_fds", **labels) == 1024
        assert daemon.value("gpuwatch_rank_up", **labels) == 1
        assert daemon.value("gpuwatch_rank_info", pid=str(child.pid), world_size="16", local_rank="3") == 1
        daemon.wait_for(lambda: has_finding(daemon, "fd_exhaustion", **labels), what="fd_exhaustion")
    finally:
        child.kill()
        child.wait()
    daemon.wait_for(lambda: daemon.value("gpuwatch_rank_up", job_id="llm-7", rank="3") == 0, what="rank_up 0")
    assert has_finding(daemon, "rank_down", job_id="llm-7", rank="3", severity="page")
    assert daemon.value("gpuwatch_rank_open_fds", job_id="llm-7", rank="3") is None
    assert not has_finding(daemon, "fd_exhaustion", job_id="llm-7", rank="3")


def test_nccl_legacy_and_error_handling_off(daemon: DaemonProc) -> None:
    legacy = spawn("import time; time.sleep(60)", {"NCCL_ASYNC_ERROR_HANDLING": "1"})
    off = spawn("import time; time.sleep(60)", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    good = spawn("import time; time.sleep(60)", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    try:
        register(daemon.cfg, "nccl", 0, legacy.pid)
        register(daemon.cfg, "nccl", 1, off.pid)
        register(daemon.cfg, "nccl", 2, good.pid)
        daemon.wait_for(lambda: has_finding(daemon, "nccl_legacy_env", job_id="nccl", rank="0"), what="nccl_legacy_env")
        daemon.wait_for(
            lambda: has_finding(daemon, "nccl_error_handling_off", job_id="nccl", rank="1"),
            what="nccl_error_handling_off",
        )
        daemon.wait_for(lambda: daemon.value("gpuwatch_rank_up", job_id="nccl", rank="2") == 1, what="rank 2 up")
        assert not has_finding(daemon, "nccl_legacy_env", rank="2")
        assert not has_finding(daemon, "nccl_error_handling_off", rank="2")
        assert not has_finding(daemon, "nccl_legacy_env", rank="1")
        # names only, never values, leave the daemon
        assert "ASYNC_ERROR_HANDLING=1" not in daemon.text()
    finally:
        for p in (legacy, off, good):
            p.kill()
            p.wait()


BAD_FILES: dict[str, bytes] = {
    "truncated.json": b'{"version": 1, "job_id": "x", "ranks": [{"rank": 0, "pid": 1',
    "wrong-types.json": b'{"version": 1, "job_id": 7, "ranks": [{"rank": "zero", "pid": "1"}]}',
    "unicode.json": '{"version": 1, "job_id": "\u202e\u0000\udcff", "ranks": []}'.encode("utf-8", "surrogatepass"),
    "binary.json": bytes(range(256)) * 4,
    "huge.json": b'{"version": 1, "job_id": "' + b"a" * (300 * 1024) + b'"}',
    "deep.json": b"[" * 100000 + b"]" * 100000,
}


def test_malformed_rank_files_never_stop_the_daemon(daemon: DaemonProc, tmp_path: Path) -> None:
    rank_dir = Path(daemon.cfg["rank_dir"])
    for name, data in BAD_FILES.items():
        (rank_dir / name).write_bytes(data)
    (tmp_path / "elsewhere.json").write_text(
        json.dumps({"version": 1, "job_id": "sneaky", "ranks": [{"rank": 0, "pid": os.getpid()}]})
    )
    (rank_dir / "symlink.json").symlink_to(tmp_path / "elsewhere.json")
    os.mkfifo(rank_dir / "fifo.json")
    good = spawn("import time; time.sleep(60)")
    try:
        register(daemon.cfg, "good-job", 0, good.pid)
        daemon.wait_for(
            lambda: daemon.value("gpuwatch_rank_up", job_id="good-job", rank="0") == 1,
            what="good rank beside bad files",
        )
        assert has_finding(daemon, "bad_rank_file")
        assert daemon.value("gpuwatch_rank_up", job_id="sneaky") is None
        state = json.loads((Path(daemon.cfg["state_dir"]) / "state.json").read_text())
        reasons = {
            Path(f["evidence"]["path"]).name: f["evidence"]["reason"]
            for f in state["findings"]
            if f["kind"] == "bad_rank_file"
        }
        assert set(reasons) == {*BAD_FILES, "symlink.json", "fifo.json"}, reasons
        assert "symbolic link" in reasons["symlink.json"]
        assert "not a regular file" in reasons["fifo.json"]
        assert "larger than" in reasons["huge.json"]
        assert "not valid JSON" in reasons["truncated.json"]
        assert "job_id" in reasons["wrong-types.json"]
        assert daemon.proc.poll() is None
    finally:
        good.kill()
        good.wait()


def test_sighup_reload_keeps_old_config_when_new_is_bad(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    d = DaemonProc(path, cfg)
    try:
        original = path.read_text()
        bad = yaml.safe_load(original)  # (gil: is there already: a second one would be refused
        bad["bogus_key"] = 1  # as a duplicate key before its values are looked at)
        bad["gil"] = {**bad["gil"], "rate_hz": "fast"}
        path.write_text(yaml.safe_dump(bad))
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: "reload refused" in d.log(), what="reload refused log line")
        assert "bogus_key: unknown key" in d.log() and "gil.rate_hz" in d.log()
        assert d.proc.poll() is None and "gpuwatch_build_info" in d.text()
        # a valid new config is applied: a new rank_dir is watched
        new_dir = tmp_path / "ranks2"
        new_dir.mkdir()
        path.write_text(original.replace(str(tmp_path / "ranks"), str(new_dir)))
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: "configuration reloaded" in d.log(), what="reload applied")
        sleeper = spawn("import time; time.sleep(30)")
        try:
            register({"rank_dir": str(new_dir)}, "reloaded", 0, sleeper.pid)
            d.wait_for(lambda: d.value("gpuwatch_rank_up", job_id="reloaded") == 1, what="new rank_dir")
        finally:
            sleeper.kill()
            sleeper.wait()
        # sections the subsystems read once at start are named, not silently ignored
        path.write_text(original.replace(str(tmp_path / "ranks"), str(new_dir)) + "stall: {after_seconds: 7}\n")
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: "changes to stall take effect at the next restart" in d.log(), what="restart note")
    finally:
        assert d.stop() == 0


def test_bad_config_at_start_exits_2_naming_every_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("interval_seconds: -1\nweb: {listen_address: nope, colour: red}\nstall: 5\n")
    r = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    for key in ("interval_seconds", "web.listen_address", "web.colour: unknown key", "stall:"):
        assert key in r.stderr, r.stderr


def test_listen_address_flag_overrides_file(tmp_path: Path) -> None:
    from daemonutil import free_port

    path, _ = write_config(tmp_path)
    port = free_port()
    log = open(tmp_path / "flag.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(path), "--web.listen-address", f"[::1]:{port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        import urllib.request

        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=2) as r:
                    assert b"gpuwatch_build_info" in r.read()
                break
            except OSError:
                if time.monotonic() > deadline or p.poll() is not None:
                    raise
                time.sleep(0.1)
    finally:
        p.terminate()
        assert p.wait(10) == 0
        log.close()
