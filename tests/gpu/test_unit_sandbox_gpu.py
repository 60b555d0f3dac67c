"""The daemon on a real GPU node inside the unit's sandbox, without systemd (issue 12, item 6).

As systemd/gpuwatchd.service runs it, as far as can be done without systemd: an unprivileged uid
holding only the unit's three capabilities (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH, CAP_SYSLOG:
ambient, inheritable and bounding set, via setpriv), NoNewPrivileges, the unit's seccomp allow
list and MemoryDenyWriteExecute= (tests/sandboxutil.py). With the real driver it must read NVML
(devices and another user's GPU process), sample a torch rank of another uid with py-spy, and
read /dev/kmsg. Prints a ``PASS ...`` line with its numbers (quoted in docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sandboxutil

REPO = Path(__file__).resolve().parents[2]
DAEMON_UID = 61231  # numeric uids: no account needed, no other user's files
RANK_UID = 61232
CAPS = "-all,+sys_ptrace,+dac_read_search,+syslog"
THREE_CAPS = (1 << 2) | (1 << 19) | (1 << 34)

RANK = """
import threading, time, torch
block = torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")
block.fill_(1)
torch.cuda.synchronize()
def spin():
    while True:
        sum(range(10000))
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def _pyspy() -> str:
    for cand in [shutil.which("py-spy"), *(str(Path(p) / "bin" / "py-spy") for p in sys.path)]:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise AssertionError("py-spy not found on PATH or next to sys.path entries")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def world() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gwsystemd-gpu-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _smi_mib(pid: int) -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for line in out.strip().splitlines():
        p, mib = (x.strip() for x in line.split(","))
        if int(p) == pid:
            return int(mib)
    raise AssertionError(f"nvidia-smi does not list pid {pid}: {out}")


def test_daemon_in_the_units_sandbox_reads_nvml_pyspy_and_kmsg(world: Path) -> None:
    (world / "ranks").mkdir(mode=0o1777)
    (world / "ranks").chmod(0o1777)
    state = world / "state"
    state.mkdir()
    os.chown(state, DAEMON_UID, DAEMON_UID)
    home = world / "home"
    home.mkdir()
    os.chown(home, RANK_UID, RANK_UID)
    port = _free_port()
    cfg = world / "config.yaml"
    cfg.write_text(
        f'web: {{listen_address: "127.0.0.1:{port}"}}\ninterval_seconds: 1\n'
        f"rank_dir: {world / 'ranks'}\nstate_dir: {state}\nkernel_log: kmsg\n"
        f"gil: {{enabled: true, interval_seconds: 2, duration_seconds: 1, pyspy_path: {_pyspy()}}}\n"
        "discovery: {enabled: true, interval_seconds: 1}\n"
    )
    cfg.chmod(0o644)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
    }
    rank = daemon = None
    try:
        rank = subprocess.Popen(
            ["setpriv", f"--reuid={RANK_UID}", f"--regid={RANK_UID}", "--clear-groups", sys.executable, "-c", RANK],
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(home),
            env={**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "sandboxjob"},
        )
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        inner = sandboxutil.sandboxed([sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)])
        inner[0] = sys.executable  # the seccomp installer: this interpreter, wherever it is
        daemon = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={DAEMON_UID}",
                f"--regid={DAEMON_UID}",
                "--clear-groups",
                f"--inh-caps={CAPS}",
                f"--ambient-caps={CAPS}",
                f"--bounding-set={CAPS}",
                "--no-new-privs",
                *inner,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd="/",
            env={**env, "HOME": "/nonexistent"},
        )
        want = {
            "nvml": re.compile(r'gpuwatch_collector_success\{collector="nvml"\} 1\.0'),
            "kernel_log": re.compile(r'gpuwatch_collector_success\{collector="kernel_log"\} 1\.0'),
            "rank_up": re.compile(r'gpuwatch_rank_up\{job_id="sandboxjob",rank="0"\} 1\.0'),
            "gil": re.compile(
                r'gpuwatch_rank_gil_samples_total\{job_id="sandboxjob",rank="0"\} '
                r"([1-9][0-9.e+]*)"
            ),
            "rank_gpu": re.compile(
                r'gpuwatch_rank_gpu_memory_bytes\{[^}]*job_id="sandboxjob"'
                r"[^}]*\} ([0-9.e+]+)"
            ),
        }
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline:
            assert daemon.poll() is None, daemon.communicate()[0][-3000:]
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r,
            ):
                text = r.read().decode()
            if all(w.search(text) for w in want.values()):
                break
            time.sleep(1)
        status = Path(f"/proc/{daemon.pid}/status").read_text()
        fields = dict(re.findall(r"^(\w+):\s+(.*)$", status, re.M))
        found = {k: bool(w.search(text)) for k, w in want.items()}
        print("sandbox:", {k: fields.get(k) for k in ("Uid", "CapEff", "CapAmb", "CapBnd", "NoNewPrivs", "Seccomp")})
        print("found:", found)
        print(
            "\n".join(line for line in text.splitlines() if "collector_success" in line or "sandboxjob" in line)[:4000]
        )
        assert fields["Uid"].split()[0] == str(DAEMON_UID)
        assert int(fields["CapEff"], 16) == THREE_CAPS and int(fields["CapBnd"], 16) == THREE_CAPS
        assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"
        assert all(found.values()), (found, text[-3000:])
        gil = want["gil"].search(text)
        rank_gpu = want["rank_gpu"].search(text)
        assert gil and rank_gpu
        smi = _smi_mib(rank.pid)
        ours = float(rank_gpu.group(1)) / (1 << 20)
        assert abs(ours - smi) <= max(2.0, 0.01 * smi), (ours, smi)
        print(
            f"PASS sandboxed daemon (uid {DAEMON_UID}, caps {fields['CapEff']}, seccomp 2, "
            f"MDWE): nvml up, rank GPU memory {ours:.0f} MiB vs nvidia-smi {smi} MiB, "
            f"py-spy samples {float(gil.group(1)):.0f}, kernel_log (kmsg) up"
        )
    finally:
        for p in (daemon, rank):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        if daemon is not None and daemon.stdout is not None:
            print("daemon log tail:\n" + daemon.stdout.read()[-3000:])
