from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwatchd.findings import nccl_env
from gpuwatchd.paths import HostPaths
from gpuwatchd.sources.procfs import ProcfsReader

R = ProcfsReader(HostPaths())


def test_reads_a_real_process_like_ps() -> None:
    # a reader made now: its boot time (/proc/stat btime, read once) moves with the wall clock,
    # and the module's reader is as old as the test session (CI: 7 s apart after a clock step)
    me = ProcfsReader(HostPaths()).read_process(os.getpid())
    assert me is not None
    assert me.pid == os.getpid() and me.ppid == os.getppid() and me.uid == os.geteuid()
    assert me.open_fds == len(os.listdir("/proc/self/fd")) - 1  # listdir's own fd is gone again
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert (me.max_fds_soft, me.max_fds_hard) == (soft, None if hard == resource.RLIM_INFINITY else hard)
    assert me.threads >= 1 and me.rss_bytes > 1 << 20 and me.cpu_seconds > 0
    import psutil

    assert abs(me.start_time - psutil.Process().create_time()) < 0.05
    assert me.state in "RS"


def test_fd_count_is_o1_stat_size_where_supported() -> None:
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os,time; fs=[os.open('/dev/null', 0) for _ in range(300)]; print('ok', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        listed = len(os.listdir(f"/proc/{p.pid}/fd"))
        assert R.fd_count(p.pid) == listed
        # Linux >= 6.2 reports the count as the directory size: that is what makes it O(1)
        if tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 2):
            assert os.stat(f"/proc/{p.pid}/fd").st_size == listed
    finally:
        p.kill()
        p.wait()


def test_descendants_and_zombie_and_vanished() -> None:
    code = (
        "import subprocess, sys, time\n"
        "a = subprocess.Popen([sys.executable, '-c', 'import subprocess,sys,time; "
        'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]); time.sleep(30)\'])\n'
        "z = subprocess.Popen(['true'])\n"
        "print(a.pid, z.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        a, z = (int(x) for x in p.stdout.readline().split())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(R.descendants(p.pid)) < 3:
            time.sleep(0.05)
        kids = R.descendants(p.pid)
        assert a in kids and z in kids and len(kids) == 3
        zombie = R.read_process(z)
        assert zombie is not None and zombie.state == "Z"
    finally:
        for pid in R.descendants(p.pid):
            os.kill(pid, signal.SIGKILL)
        p.kill()
        p.wait()
    assert R.read_process(p.pid) is None
    assert R.descendants(p.pid) == []
    assert R.read_process(2**22 + 1) is None


def test_environ_flags_names_only() -> None:
    """procfs reads the values of the names it is asked for (findings/nccl_env.py's), the rule
    module makes names of them."""
    env = {**os.environ, "NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "SECRET": "hunter2"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 5
        values = R.environ_values(p.pid, nccl_env.WATCHED_VARS)
        while values is None and time.monotonic() < deadline:  # empty for a moment while exec runs
            time.sleep(0.01)
            values = R.environ_values(p.pid, nccl_env.WATCHED_VARS)
        assert values is not None and "SECRET" not in values
        flags = nccl_env.env_flags(values)
        assert flags == ("NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING=0")
    finally:
        p.kill()
        p.wait()


def test_recorded_proc_tree_with_hostile_comm(tmp_path: Path) -> None:
    """A /proc copy (the root is a constructor argument): a comm with spaces and parentheses,
    a truncated stat file, and garbage limits all read safely."""
    root = tmp_path / "proc"
    (root / "100" / "fd").mkdir(parents=True)
    (root / "101").mkdir()
    (root / "stat").write_text("cpu  1 2 3\nbtime 1700000000\n")
    # recorded from a real process (python3 renamed with prctl), fields verbatim after the comm
    (root / "100" / "stat").write_text(
        "100 (evil) (name ) S 1 100 100 0 -1 4194560 1219 0 0 0 150 50 0 0 20 0 7 0 5000 "
        "31555584 2048 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 1 0 0 0 0 0\n"
    )
    (root / "100" / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max open files            1024                 unlimited            files     \n"
    )
    for i in range(5):
        (root / "100" / "fd" / str(i)).touch()
    (root / "101" / "stat").write_text("101 (trunc")
    shutil.copy("/proc/self/limits", root / "101" / "limits")
    r = ProcfsReader(HostPaths(procfs=str(root)))
    p = r.read_process(100)
    assert p is not None
    assert p.comm == "evil) (name " and p.ppid == 1 and p.threads == 7 and p.start_ticks == 5000
    assert p.cpu_seconds == 2.0 and p.rss_bytes == 2048 * os.sysconf("SC_PAGE_SIZE")
    assert p.start_time == 1700000000 + 5000 / os.sysconf("SC_CLK_TCK")
    assert (p.open_fds, p.max_fds_soft, p.max_fds_hard) == (5, 1024, None)
    assert r.read_process(101) is None
    assert r.read_process(102) is None
