"""gpuwatchd as users deploy it: a real systemd 252 (Debian 12) booted in private namespaces
(tests/bootsystemd.py), gpuwatchd installed with ``pip install`` + ``deploy/install.sh``, and the
unit checked for what it promises: Type=notify readiness and STATUS=, the sandbox in force (uid,
the three capabilities, NoNewPrivs, seccomp, the cgroup limits), the watchdog fed and enforced,
reload with a good and a bad config, /metrics on loopback, the kernel log from the journal and
from /dev/kmsg with a real memcg OOM kill, DeviceAllow=/dev/kmsg necessary, the NVIDIA device
policy expanded after a late driver (fake nodes, crafted /proc/devices), a clean stop, the
journal, and an uninstall that leaves nothing.

The tests share one booted container with gpuwatchd installed (the fixture) and run in file order
(uninstall last); each sets the config and drop-in it needs, so one can also run alone (-k).
Needs root, cgroup v1, apt (mmdebstrap) and PyPI the first time (the rootfs and dependency wheels
are cached under /var/cache/gpuwatchd-test-rootfs). About 2 minutes with the cache warm,
2.5 minutes cold (measured on the 2-core CI machine).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import bootsystemd
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
VENV = "/opt/gpuwatchd"
BIN = f"{VENV}/bin/gpuwatchd"
UNIT = "gpuwatchd.service"
DROPIN = "/etc/systemd/system/gpuwatchd.service.d"
CONFIG = "/etc/gpuwatchd/config.yaml"
STATE = "/var/lib/gpuwatchd/state.json"
# CAP_DAC_READ_SEARCH (2), CAP_SYS_PTRACE (19), CAP_SYSLOG (34)
THREE_CAPS = (1 << 2) | (1 << 19) | (1 << 34)
# Files whose listing changes by themselves while the system runs, not by install/uninstall.
SNAPSHOT = ("find /etc /var/lib /run /usr/local /opt -xdev "
            r"\( -path /run/systemd -o -path /var/lib/systemd -o -path /run/user -o -path "
            r"/run/dbus -o -path /run/log -o -path /opt/gpuwatchd -o -path /var/lib/dpkg -o "
            r"-path /run/lock -o -path '/etc/gpuwatchd-test-snapshot*' \) -prune -o "
            r"-printf '%p %M %u %g\n' | sort")
ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow")


Box = bootsystemd.BootedSystemd


def _config(kernel_log: str = "journal", listen: str = "0.0.0.0:9863", extra: str = "") -> str:
    return (f'web: {{listen_address: "{listen}"}}\ninterval_seconds: 2\nkernel_log: {kernel_log}\n'
            "gil: {enabled: false}\ndiscovery: {enabled: false}\n" + extra)


@pytest.fixture(scope="module")
def box() -> Iterator[Box]:
    rootfs = bootsystemd.cached_rootfs()
    share = Path(tempfile.mkdtemp(prefix="gwsystemd-share-"))
    container = None
    try:
        bootsystemd.build_wheelhouse(ROOT, share / "wheels")
        shutil.copytree(ROOT, share / "src", ignore=shutil.ignore_patterns(
            ".venv", ".venv-*", ".git", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache",
            ".pytest_cache", ".dev", "build"))
        share.chmod(0o755)
        container = bootsystemd.BootedSystemd(rootfs, share)
        container.install_output = _install(container)
        yield container
    finally:
        if container is not None:
            container.close()
        shutil.rmtree(share, ignore_errors=True)


def show(box: Box, *props: str) -> dict[str, str]:
    out = box.run(["systemctl", "show", UNIT, "-p", ",".join(props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait(pred: Callable[[], object], timeout: float, what: str,
         detail: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                         + (f": {detail()}" if detail else ""))


def metrics(box: Box, port: int = 9863) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    res = box.run(["curl", "-sf", "--max-time", "5", f"http://127.0.0.1:{port}/metrics"],
                  check=False)
    if res.returncode != 0:
        return {}
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(res.stdout) for s in fam.samples}


def sample(box: Box, name: str, port: int = 9863, **labels: str) -> float | None:
    for (n, ls), v in metrics(box, port).items():
        if n == name and set(labels.items()) <= ls:
            return v
    return None


def journal(box: Box, since: str = "") -> str:
    args = ["journalctl", "-u", UNIT, "--no-pager", "-o", "cat"]
    if since:
        args += ["--after-cursor", since]
    return box.run(args).stdout


def cursor(box: Box) -> str:
    out = box.run(["journalctl", "-u", UNIT, "-n", "1", "--show-cursor", "--no-pager", "-q"],
                  check=False).stdout
    m = re.search(r"^-- cursor: (.+)$", out, re.M)
    return m.group(1) if m else ""


def write(box: Box, path: str, text: str) -> None:
    box.run(["install", "-D", "-m", "0644", "/dev/stdin", path], input=text)


def collector(box: Box, name: str) -> dict[str, object]:
    state = json.loads(box.run(["cat", STATE]).stdout)
    return next(c for c in state["collectors"] if c["name"] == name)


def restart_with(box: Box, dropin: str | None = None, config: str | None = None) -> str:
    """(Re)start the service with a drop-in and config; returns its new MainPID once ready."""
    if dropin is None:
        box.run(["rm", "-rf", DROPIN])
    else:
        write(box, f"{DROPIN}/test.conf", dropin)
    if config is not None:
        write(box, CONFIG, config)
    box.run(["systemctl", "daemon-reload"])
    box.run(["systemctl", "restart", UNIT], timeout=60)
    props = show(box, "ActiveState", "MainPID")
    assert props["ActiveState"] == "active", props
    return props["MainPID"]


def oom_kill(box: Box) -> str:
    """A process named ``gwsd-oom-XXXXXX`` killed by its memcg's OOM killer (systemd-run
    MemoryMax=40M); returns the name."""
    comm = f"gwsd-oom-{uuid.uuid4().hex[:6]}"
    code = ("import ctypes\n"
            f"ctypes.CDLL(None).prctl(15, b'{comm}', 0, 0, 0)\n"
            "hog = []\n"
            "while True:\n"
            "    hog.append(b'x' * (1 << 20))\n")
    res = box.run(["systemd-run", "--wait", "--quiet", "-p", "MemoryMax=40M", "-p",
                   "MemorySwapMax=0", "/usr/bin/python3", "-c", code], check=False, timeout=60)
    assert res.returncode != 0, res
    return comm


# --- the tests, in order --------------------------------------------------------------------

def _install(box: Box) -> str:
    """As a new user would: a venv, `pip install gpuwatchd`, deploy/install.sh (after a snapshot
    of the files and accounts, for the uninstall test). Returns install.sh's output."""
    box.sh(f"{SNAPSHOT} > /etc/gpuwatchd-test-snapshot; "
           f"cat {' '.join(ACCOUNT_FILES)} > /etc/gpuwatchd-test-snapshot.accounts")
    box.run(["python3", "-m", "venv", "--system-site-packages", VENV])
    box.run([f"{VENV}/bin/pip", "install", "-q", "--no-index", "--find-links", "/srv/gw/wheels",
             "gpuwatchd"], timeout=180)
    return box.run(["/srv/gw/src/deploy/install.sh", "--bin", BIN], timeout=120).stdout


def test_install_sh_as_a_new_user_runs_it_and_notify_readiness(box: Box) -> None:
    out = box.install_output  # set by the fixture
    assert "installed /etc/systemd/system/gpuwatchd.service" in out, out
    assert "running: systemctl status gpuwatchd" in out, out
    # Type=notify: `systemctl start` returned only after READY=1, and STATUS= is the cycle's
    props = show(box, "Type", "ActiveState", "SubState", "StatusText", "NotifyAccess",
                 "UnitFileState", "ExecMainStartTimestampMonotonic",
                 "ActiveEnterTimestampMonotonic")
    assert props["Type"] == "notify" and props["NotifyAccess"] == "main", props
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["UnitFileState"] == "enabled", props
    assert re.fullmatch(r"\d+/\d+ ranks alive, \d+ finding\(s\)", props["StatusText"]), props
    # active only once the daemon said READY=1, after its first cycle (not at exec)
    assert int(props["ActiveEnterTimestampMonotonic"]) > int(props["ExecMainStartTimestampMonotonic"])
    restart_with(box, config=_config("journal"))
    assert "ranks alive" in show(box, "StatusText")["StatusText"]


def test_sandbox_is_really_in_force(box: Box) -> None:
    pid = show(box, "MainPID")["MainPID"]
    status = box.run(["cat", f"/proc/{pid}/status"]).stdout
    fields = dict(re.findall(r"^(\w+):\s+(.*)$", status, re.M))
    uid = box.run(["id", "-u", "gpuwatchd"]).stdout.strip()
    assert fields["Uid"].split() == [uid] * 4, fields["Uid"]
    for cap in ("CapPrm", "CapEff", "CapAmb", "CapBnd"):
        assert int(fields[cap], 16) == THREE_CAPS, (cap, fields[cap])
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", fields
    groups = box.run(["getent", "group", "systemd-journal"]).stdout.split(":")[2]
    assert groups in fields["Groups"].split(), fields["Groups"]
    # the limits, as the kernel holds them in the service's own cgroups
    svc = f"/system.slice/{UNIT}"
    mem = box.cgroup_dir("memory", svc)
    assert (mem / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
    cpu = box.cgroup_dir("cpu", svc)
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "25000"
    assert (cpu / "cpu.cfs_period_us").read_text().strip() == "100000"
    assert (box.cgroup_dir("pids", svc) / "pids.max").read_text().strip() == "128"
    devices = (box.cgroup_dir("devices", svc) / "devices.list").read_text().split("\n")
    assert "c 1:11 r" in devices and "a *:* rwm" not in devices, devices
    host_pids = (mem / "cgroup.procs").read_text().split()  # host PIDs; NSpid: host, container
    nspids = [Path(f"/proc/{p}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
              for p in host_pids]
    assert [pid] == [ns[-1] for ns in nspids], nspids


def test_metrics_on_loopback_and_kernel_log_from_the_journal_with_an_oom_kill(box: Box) -> None:
    restart_with(box, config=_config("journal"))
    wait(lambda: sample(box, "gpuwatch_collector_success", collector="kernel_log") == 1.0, 30,
         "the kernel_log collector (journal) to succeed")
    assert sample(box, "gpuwatch_collector_success", collector="procfs") == 1.0
    # no GPU here: the nvml collector is down, the daemon is up
    assert sample(box, "gpuwatch_collector_success", collector="nvml") == 0.0
    comm = oom_kill(box)
    wait(lambda: (sample(box, "gpuwatch_oom_kills_total", comm=comm, killer="kernel") or 0) >= 1,
         30, f"the OOM kill of {comm} in /metrics (journal)")


def test_kernel_log_from_dev_kmsg_with_an_oom_kill(box: Box) -> None:
    restart_with(box, config=_config("kmsg"))
    wait(lambda: sample(box, "gpuwatch_collector_success", collector="kernel_log") == 1.0, 30,
         "the kernel_log collector (kmsg) to succeed")
    comm = oom_kill(box)
    wait(lambda: (sample(box, "gpuwatch_oom_kills_total", comm=comm, killer="kernel") or 0) >= 1,
         30, f"the OOM kill of {comm} in /metrics (kmsg)")


def test_device_allow_kmsg_is_necessary(box: Box) -> None:
    """Without DeviceAllow=/dev/kmsg r the device cgroup refuses /dev/kmsg (EPERM)."""
    restart_with(box, dropin="[Service]\nDeviceAllow=\nDeviceAllow=char-nvidia* rw\n")
    devices = (box.cgroup_dir("devices", f"/system.slice/{UNIT}") / "devices.list").read_text()
    assert "c 1:11 r" not in devices.split("\n"), devices
    wait(lambda: "Operation not permitted" in str(collector(box, "kernel_log")["error"]), 30,
         "the kernel_log collector to fail with EPERM on /dev/kmsg")
    assert sample(box, "gpuwatch_collector_success", collector="kernel_log") == 0.0
    assert sample(box, "gpuwatch_collector_success", collector="procfs") == 1.0
    restart_with(box, dropin=None)
    wait(lambda: sample(box, "gpuwatch_collector_success", collector="kernel_log") == 1.0, 30,
         "kmsg readable again with the unit's rule")


def test_reload_with_a_good_and_a_bad_config(box: Box) -> None:
    pid = show(box, "MainPID")["MainPID"]
    mark = cursor(box)
    try:
        write(box, CONFIG, _config("kmsg", listen="0.0.0.0:9864"))
        box.run(["systemctl", "reload", UNIT])
        wait(lambda: metrics(box, 9864), 20, "/metrics on the reloaded port 9864")
        wait(lambda: "configuration reloaded" in journal(box, mark), 10, "the reload in the journal")
        # a bad config: the reload fails and names the key; the daemon is not signalled, keeps
        # its config (port 9864, not 9865) and its PID
        write(box, CONFIG, _config("kmsg", listen="0.0.0.0:9865", extra="no_such_key: 1\n"))
        res = box.run(["systemctl", "reload", UNIT], check=False)
        assert res.returncode != 0, res
        time.sleep(3)  # more than one cycle: a signalled daemon would have reloaded by now
        assert metrics(box, 9864) and not metrics(box, 9865)
        props = show(box, "MainPID", "ActiveState")
        assert props == {"MainPID": pid, "ActiveState": "active"}, props
        log = journal(box, mark)
        assert "no_such_key" in log, log[-2000:]
        assert log.count("configuration reloaded") == 1, log[-2000:]
    finally:
        write(box, CONFIG, _config("kmsg"))
        box.run(["systemctl", "reload-or-restart", UNIT])
    wait(lambda: metrics(box), 20, "/metrics back on 9863")


def test_watchdog_is_fed_and_enforced(box: Box) -> None:
    restart_with(box, dropin="[Service]\nWatchdogSec=6s\n")
    props = show(box, "WatchdogUSec", "NRestarts", "MainPID")
    assert props["WatchdogUSec"] == "6s", props
    before = int(show(box, "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"])
    time.sleep(8)  # longer than WatchdogSec: fed, or systemd would have restarted it
    after = show(box, "WatchdogTimestampMonotonic", "NRestarts", "MainPID")
    assert int(after["WatchdogTimestampMonotonic"]) > before, after
    assert (after["NRestarts"], after["MainPID"]) == (props["NRestarts"], props["MainPID"])
    mark = cursor(box)
    box.run(["kill", "-STOP", props["MainPID"]])
    wait(lambda: show(box, "NRestarts")["NRestarts"] != props["NRestarts"], 40,
         "systemd to restart the stopped daemon")
    wait(lambda: show(box, "ActiveState")["ActiveState"] == "active", 30, "the restarted daemon")
    assert show(box, "MainPID")["MainPID"] != props["MainPID"]
    assert "Watchdog timeout" in box.run(["journalctl", "--no-pager", "-o", "cat",
                                          "--after-cursor", mark]).stdout
    restart_with(box, dropin=None)


def _proc_devices_with_nvidia(box: Box) -> str:
    text = box.run(["cat", "/proc/devices"]).stdout
    return text.replace("Character devices:\n",
                        "Character devices:\n195 nvidia-frontend\n236 nvidia-uvm\n511 nvidia-caps\n")


def proc_devices_for(box: Box, pid: str) -> None:
    box.run(["nsenter", "-t", pid, "-m", "mount", "--bind", "/run/gw-proc-devices",
             "/proc/devices"])


def test_nvidia_devices_registered_after_start_are_recovered_by_one_restart(box: Box) -> None:
    """DeviceAllow=char-nvidia* is expanded when the unit starts. Fake nodes (mknod 195:255,
    195:0, 511:1) and a /proc/devices that lists nvidia only after the start: the daemon sees
    EPERM, says why, exits once (75) for Restart= to re-expand the policy, and then the nodes
    answer ENXIO (allowed, no driver); a drop-in that denies them for good costs no restart loop."""
    box.sh("mknod -m 666 /dev/nvidiactl c 195 255 && mknod -m 666 /dev/nvidia0 c 195 0 && "
           "mkdir -p /dev/nvidia-caps && mknod -m 444 /dev/nvidia-caps/nvidia-cap1 c 511 1")
    try:
        restart_with(box)
        wait(lambda: "EPERM" in str(collector(box, "nvml")["error"]), 30, "nvml: EPERM")
        err = str(collector(box, "nvml")["error"])
        assert "no driver in /proc/devices" in err and "/dev/nvidiactl" in err, err
        assert sample(box, "gpuwatch_collector_success", collector="nvml") == 0.0
        first = show(box, "NRestarts", "MainPID")
        # the driver registers its majors now (/proc/devices for everyone, as after modprobe)
        write(box, "/run/gw-proc-devices", _proc_devices_with_nvidia(box))
        box.run(["mount", "--bind", "/run/gw-proc-devices", "/proc/devices"])
        # and in the daemon's: systemd gives the service a procfs instance of its own, which a
        # bind mount in the container's namespace does not reach (the kernel's file changes in
        # every instance at once)
        proc_devices_for(box, first["MainPID"])
        wait(lambda: show(box, "NRestarts")["NRestarts"] != first["NRestarts"], 45,
             "the daemon to exit for a restart that re-expands DeviceAllow=char-nvidia*")
        wait(lambda: show(box, "ActiveState")["ActiveState"] == "active", 30, "restarted")
        log = journal(box)
        assert "Exiting with status 75" in log and "nvidia-frontend" in log, log[-3000:]
        devices = (box.cgroup_dir("devices", f"/system.slice/{UNIT}") / "devices.list").read_text()
        for rule in ("c 195:* rw", "c 236:* rw", "c 511:* rw"):
            assert rule in devices.split("\n"), devices
        second = show(box, "NRestarts", "MainPID")
        wait(lambda: collector(box, "nvml")["error"] not in ("", "not run yet"), 30, "nvml ran")
        time.sleep(3)
        err = str(collector(box, "nvml")["error"])
        assert "EPERM" not in err and "not present" in err, err  # allowed now: ENXIO, no driver
        assert show(box, "NRestarts", "MainPID") == second
        # denied for good (a drop-in): the restart was spent, so no loop; the log says so
        mark = cursor(box)
        pid = restart_with(box, dropin="[Service]\nDeviceAllow=\nDeviceAllow=/dev/kmsg r\n")
        proc_devices_for(box, pid)
        wait(lambda: "still denied after the restart" in journal(box, mark), 30,
             "the daemon to say the devices are denied for good",
             lambda: (journal(box, mark)[-2000:], collector(box, "nvml")))
        third = show(box, "NRestarts", "MainPID")
        time.sleep(5)
        assert show(box, "NRestarts", "MainPID") == third
        assert show(box, "ActiveState")["ActiveState"] == "active"
    finally:
        box.sh("umount /proc/devices 2>/dev/null; rm -rf /dev/nvidiactl /dev/nvidia0 "
               "/dev/nvidia-caps /run/gw-proc-devices", check=False)
        restart_with(box, dropin=None)


def test_journal_shows_the_daemons_events(box: Box) -> None:
    log = journal(box)
    for line in ("serving http://0.0.0.0:9863/metrics", "configuration reloaded",
                 "no_such_key", "Exiting with status 75", "still denied after the restart"):
        assert line in log, (line, log[-3000:])


def test_stop_is_clean(box: Box) -> None:
    t0 = time.monotonic()
    box.run(["systemctl", "stop", UNIT], timeout=30)
    took = time.monotonic() - t0
    props = show(box, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    assert props["ActiveState"] == "inactive" and props["Result"] == "success", props
    assert took < 10, took
    procs = box.cgroup_dir("pids", f"/system.slice/{UNIT}") / "cgroup.procs"
    assert not procs.exists() or not procs.read_text().split()
    assert "timed out. Killing" not in journal(box)  # systemd's words when SIGTERM was not enough


def test_uninstall_leaves_nothing(box: Box) -> None:
    res = box.run(["/srv/gw/src/deploy/uninstall.sh"], timeout=60)
    assert "done" in res.stdout, res.stdout
    after = box.sh(SNAPSHOT).stdout
    before = box.run(["cat", "/etc/gpuwatchd-test-snapshot"]).stdout
    gone_or_new = sorted(set(before.splitlines()) ^ set(after.splitlines()))
    assert not gone_or_new, gone_or_new
    accounts = box.sh(f"cat {' '.join(ACCOUNT_FILES)}").stdout
    assert accounts == box.run(["cat", "/etc/gpuwatchd-test-snapshot.accounts"]).stdout
    assert box.run(["systemctl", "cat", UNIT], check=False).returncode != 0
    leftovers = box.sh("grep -rls gpuwatchd /etc /run /var/lib --exclude-dir=systemd "
                       "--exclude='gpuwatchd-test-snapshot*' || true").stdout.split()
    assert not leftovers, leftovers
