"""gpuwatchd as users deploy it: a real systemd 252 (Debian 12) booted in private namespaces
(tests/bootsystemd.py), gpuwatchd installed with ``apt-get install ./gpuwatchd_*.deb`` (built
by deploy/debian/build.sh from the wheel ``python -m build`` made: tests/distutil.py), and the
unit checked for what it promises: Type=notify readiness and STATUS=, the sandbox in force (uid,
the three capabilities, NoNewPrivs, seccomp, the cgroup limits), the watchdog fed and enforced,
reload with a good and a bad config, /metrics on loopback, the kernel log from the journal and
from /dev/kmsg with a real memcg OOM kill, DeviceAllow=/dev/kmsg necessary, the NVIDIA device
policy expanded after a late driver (fake nodes, crafted /proc/devices), the journal, an upgrade
to a second build that keeps the state (an OOM kill before it counted once, one during it not
lost), a clean stop, ``apt-get remove`` (stopped, the config kept), ``apt-get purge`` (no file,
user or unit left); then the non-Debian path: the built wheel with ``pip install`` +
``deploy/install.sh``, and ``deploy/uninstall.sh`` leaving nothing.

The tests share one booted container with gpuwatchd installed (the fixture) and run in file order
(purge and the install.sh path last); each sets the config and drop-in it needs, so one can also
run alone (-k). Needs root, cgroup v1, apt (mmdebstrap), dpkg-deb and PyPI the first time (the
rootfs and dependency wheels are cached under /var/cache/gpuwatchd-test-rootfs). About 2.5 minutes
with the cache warm on the 2-core VM (140 s; 92 s before the package, upgrade, purge and wheel
tests).
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import bootsystemd
import distutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
VENV = "/usr/lib/gpuwatchd"  # the .deb's
BIN = f"{VENV}/bin/gpuwatchd"
PIP_VENV = "/opt/gpuwatchd-pip"  # the install.sh path's
UPGRADE_VERSION = distutil.version() + "+1"  # the second build: a Debian version after the first
UNIT = "gpuwatchd.service"
DROPIN = "/etc/systemd/system/gpuwatchd.service.d"
CONFIG = "/etc/gpuwatchd/config.yaml"
STATE = "/var/lib/gpuwatchd/state.json"
# CAP_DAC_READ_SEARCH (2), CAP_SYS_PTRACE (19), CAP_SYSLOG (34)
THREE_CAPS = (1 << 2) | (1 << 19) | (1 << 34)
# Every file of the system but those that change by themselves while it runs or record what was
# installed (dpkg's and apt's databases and logs, the journal, systemd's timestamps), and byte code
# the container's own Python writes under /usr: what install + purge (or install.sh +
# uninstall.sh) must leave as they found it.
SNAPSHOT = (
    "find / -xdev "
    r"\( -path /proc -o -path /sys -o -path /dev -o -path /tmp -o -path /var/tmp -o "
    r"-path /var/log -o -path /var/cache -o -path /var/lib/dpkg -o -path /var/lib/apt -o "
    r"-path /var/lib/systemd -o -path /run/systemd -o -path /run/user -o -path /run/dbus "
    r"-o -path /run/log -o -path /run/lock -o -path /srv/gw -o -path /root -o "
    r"-path '/usr/*/__pycache__' -o -path '/etc/gpuwatchd-test-snapshot*' \) -prune -o "
    # shadow-utils' backups (/etc/passwd- ...) are rewritten on every account change, as
    # on any host: compared by presence, not size
    # (directories by presence too: their size is the file system's business)
    r"\( \( -path '/etc/*-' -o -type d \) -printf '%p %M %u %g\n' \) -o "
    r"-printf '%p %M %u %g %s\n' | sort"
)
ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow")


Box = bootsystemd.BootedSystemd


def _config(kernel_log: str = "journal", listen: str = "0.0.0.0:9863", extra: str = "") -> str:
    return (
        f'web: {{listen_address: "{listen}"}}\ninterval_seconds: 2\nkernel_log: {kernel_log}\n'
        "gil: {enabled: false}\ndiscovery: {enabled: false}\n" + extra
    )


@pytest.fixture(scope="module")
def box() -> Iterator[Box]:
    rootfs = bootsystemd.cached_rootfs()
    share = Path(tempfile.mkdtemp(prefix="gwsystemd-share-"))
    container = None
    try:
        shutil.copytree(bootsystemd.dependency_wheels(), share / "wheels")
        wheel, _ = distutil.build_dist()
        shutil.copy2(wheel, share / "wheels" / wheel.name)
        shutil.copy2(distutil.build_deb(), share)
        shutil.copytree(distutil.source(), share / "src")
        share.chmod(0o755)
        container = bootsystemd.BootedSystemd(rootfs, share)
        container.share = share  # type: ignore[attr-defined]
        container.install_output = _install(container)  # type: ignore[attr-defined]
        yield container
    finally:
        if container is not None:
            container.close()
        shutil.rmtree(share, ignore_errors=True)


def show(box: Box, *props: str) -> dict[str, str]:
    out = box.run(["systemctl", "show", UNIT, "-p", ",".join(props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait(pred: Callable[[], object], timeout: float, what: str, detail: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}" + (f": {detail()}" if detail else ""))


def metrics(box: Box, port: int = 9863) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    res = box.run(["curl", "-sf", "--max-time", "5", f"http://127.0.0.1:{port}/metrics"], check=False)
    if res.returncode != 0:
        return {}
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(res.stdout)
        for s in fam.samples
    }


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
    out = box.run(["journalctl", "-u", UNIT, "-n", "1", "--show-cursor", "--no-pager", "-q"], check=False).stdout
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


def oom_argv(comm: str) -> list[str]:
    """A process named ``comm`` that its memcg's OOM killer kills (systemd-run MemoryMax=40M)."""
    code = (
        "import ctypes\n"
        f"ctypes.CDLL(None).prctl(15, b'{comm}', 0, 0, 0)\n"
        "hog = []\n"
        "while True:\n"
        "    hog.append(b'x' * (1 << 20))\n"
    )
    return [
        "systemd-run",
        "--wait",
        "--quiet",
        "-p",
        "MemoryMax=40M",
        "-p",
        "MemorySwapMax=0",
        "/usr/bin/python3",
        "-c",
        code,
    ]


def oom_kill(box: Box) -> str:
    """A process named ``gwsd-oom-XXXXXX`` killed by its memcg's OOM killer; returns the name."""
    comm = f"gwsd-oom-{uuid.uuid4().hex[:6]}"
    res = box.run(oom_argv(comm), check=False, timeout=60)
    assert res.returncode != 0, res
    return comm


def kills(box: Box, comm: str) -> float | None:
    return sample(box, "gpuwatch_oom_kills_total", comm=comm, killer="kernel")


# --- the tests, in order --------------------------------------------------------------------


def apt(box: Box, *args: str) -> str:
    """``apt-get -y ARGS`` in the container (no network: every dependency is installed already);
    returns what it printed."""
    res = box.run(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", *args], timeout=180)
    return res.stdout + res.stderr


def _install(box: Box) -> str:
    """As a fleet does: ``apt-get install ./gpuwatchd_*.deb`` (after a snapshot of the files and
    accounts, for the purge test). Returns apt-get's output."""
    box.sh(
        f"{SNAPSHOT} > /etc/gpuwatchd-test-snapshot; "
        f"cat {' '.join(ACCOUNT_FILES)} > /etc/gpuwatchd-test-snapshot.accounts"
    )
    [deb] = [p.name for p in box.share.glob("gpuwatchd_*.deb")]  # type: ignore[attr-defined]
    return apt(box, "install", f"/srv/gw/{deb}")


def test_apt_install_enables_starts_and_notify_readiness(box: Box) -> None:
    out = box.install_output  # type: ignore[attr-defined]  # set by the fixture
    print(out)
    assert "Setting up gpuwatchd (" in out, out
    assert (
        box.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "gpuwatchd"]).stdout
        == f"install ok installed {distutil.version()}"
    )
    uid = box.run(["getent", "passwd", "gpuwatchd"]).stdout.strip()
    assert uid.endswith(":/var/lib/gpuwatchd:/usr/sbin/nologin"), uid
    assert int(uid.split(":")[2]) < 1000, uid  # a system user (sysusers.d)
    ranks = box.run(["stat", "-c", "%a %U", "/run/gpuwatch/ranks"]).stdout.split()
    assert ranks == ["1777", "root"], ranks  # tmpfiles.d
    assert box.run(["dpkg-query", "-W", "-f", "${Conffiles}", "gpuwatchd"]).stdout.split()[0] == CONFIG
    # a relative link (../lib/gpuwatchd/bin/gpuwatchd: lintian), to the venv's script
    assert box.run(["readlink", "-f", "/usr/bin/gpuwatchd"]).stdout.strip() == BIN
    assert box.run(["gpuwatchd", "--version"]).stdout.strip() == f"gpuwatchd {distutil.version()}"
    # the unit as packaged: ExecStart at the venv, enabled the Debian way (deb-systemd-helper)
    props = show(box, "FragmentPath", "ExecStart")
    assert props["FragmentPath"] == f"/lib/systemd/system/{UNIT}", props
    assert f"path={BIN} ;" in props["ExecStart"], props
    assert (
        box.run(
            ["test", "-e", f"/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/{UNIT}"], check=False
        ).returncode
        == 0
    )


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
    nspids = [Path(f"/proc/{p}/status").read_text().split("NSpid:")[1].split("\n")[0].split() for p in host_pids]
    assert [pid] == [ns[-1] for ns in nspids], nspids


def test_metrics_on_loopback_and_kernel_log_from_the_journal_with_an_oom_kill(box: Box) -> None:
    restart_with(box, config=_config("journal"))
    wait(
        lambda: sample(box, "gpuwatch_collector_success", collector="kernel_log") == 1.0,
        30,
        "the kernel_log collector (journal) to succeed",
    )
    assert sample(box, "gpuwatch_collector_success", collector="procfs") == 1.0
    # no GPU here: the nvml collector is down, the daemon is up
    assert sample(box, "gpuwatch_collector_success", collector="nvml") == 0.0
    comm = oom_kill(box)
    wait(
        lambda: (sample(box, "gpuwatch_oom_kills_total", comm=comm, killer="kernel") or 0) >= 1,
        30,
        f"the OOM kill of {comm} in /metrics (journal)",
    )


def test_kernel_log_from_dev_kmsg_with_an_oom_kill(box: Box) -> None:
    restart_with(box, config=_config("kmsg"))
    wait(
        lambda: sample(box, "gpuwatch_collector_success", collector="kernel_log") == 1.0,
        30,
        "the kernel_log collector (kmsg) to succeed",
    )
    comm = oom_kill(box)
    wait(
        lambda: (sample(box, "gpuwatch_oom_kills_total", comm=comm, killer="kernel") or 0) >= 1,
        30,
        f"the OOM kill of {comm} in /metrics (kmsg)",
    )


def test_device_allow_kmsg_is_necessary(box: Box) -> None:
    """Without DeviceAllow=/dev/kmsg r the device cgroup refuses /dev/kmsg (EPERM)."""
    restart_with(box, dropin="[Service]\nDeviceAllow=\nDeviceAllow=char-nvidia* rw\n")
    devices = (box.cgroup_dir("devices", f"/system.slice/{UNIT}") / "devices.list").read_text()
    assert "c 1:11 r" not in devices.split("\n"), devices
    wait(
        lambda: "Operation not permitted" in str(collector(box, "kernel_log")["error"]),
        30,
        "the kernel_log collector to fail with EPERM on /dev/kmsg",
    )
    assert sample(box, "gpuwatch_collector_success", collector="kernel_log") == 0.0
    assert sample(box, "gpuwatch_collector_success", collector="procfs") == 1.0
    restart_with(box, dropin=None)
    wait(
        lambda: sample(box, "gpuwatch_collector_success", collector="kernel_log") == 1.0,
        30,
        "kmsg readable again with the unit's rule",
    )


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
    wait(lambda: show(box, "NRestarts")["NRestarts"] != props["NRestarts"], 40, "systemd to restart the stopped daemon")
    wait(lambda: show(box, "ActiveState")["ActiveState"] == "active", 30, "the restarted daemon")
    assert show(box, "MainPID")["MainPID"] != props["MainPID"]
    assert "Watchdog timeout" in box.run(["journalctl", "--no-pager", "-o", "cat", "--after-cursor", mark]).stdout
    restart_with(box, dropin=None)


def _proc_devices_with_nvidia(box: Box) -> str:
    text = box.run(["cat", "/proc/devices"]).stdout
    return text.replace(
        "Character devices:\n", "Character devices:\n195 nvidia-frontend\n236 nvidia-uvm\n511 nvidia-caps\n"
    )


def proc_devices_for(box: Box, pid: str) -> None:
    box.run(["nsenter", "-t", pid, "-m", "mount", "--bind", "/run/gw-proc-devices", "/proc/devices"])


def test_nvidia_devices_registered_after_start_are_recovered_by_one_restart(box: Box) -> None:
    """DeviceAllow=char-nvidia* is expanded when the unit starts. Fake nodes (mknod 195:255,
    195:0, 511:1) and a /proc/devices that lists nvidia only after the start: the daemon sees
    EPERM, says why, exits once (75) for Restart= to re-expand the policy, and then the nodes
    answer ENXIO (allowed, no driver); a drop-in that denies them for good costs no restart loop."""
    box.sh(
        "mknod -m 666 /dev/nvidiactl c 195 255 && mknod -m 666 /dev/nvidia0 c 195 0 && "
        "mkdir -p /dev/nvidia-caps && mknod -m 444 /dev/nvidia-caps/nvidia-cap1 c 511 1"
    )
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
        wait(
            lambda: show(box, "NRestarts")["NRestarts"] != first["NRestarts"],
            45,
            "the daemon to exit for a restart that re-expands DeviceAllow=char-nvidia*",
        )
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
        wait(
            lambda: "still denied after the restart" in journal(box, mark),
            30,
            "the daemon to say the devices are denied for good",
            lambda: (journal(box, mark)[-2000:], collector(box, "nvml")),
        )
        third = show(box, "NRestarts", "MainPID")
        time.sleep(5)
        assert show(box, "NRestarts", "MainPID") == third
        assert show(box, "ActiveState")["ActiveState"] == "active"
    finally:
        box.sh(
            "umount /proc/devices 2>/dev/null; rm -rf /dev/nvidiactl /dev/nvidia0 "
            "/dev/nvidia-caps /run/gw-proc-devices",
            check=False,
        )
        restart_with(box, dropin=None)


def test_journal_shows_the_daemons_events(box: Box) -> None:
    log = journal(box)
    for line in (
        "serving http://0.0.0.0:9863/metrics",
        "configuration reloaded",
        "no_such_key",
        "Exiting with status 75",
        "still denied after the restart",
    ):
        assert line in log, (line, log[-3000:])


def test_upgrade_keeps_the_state_no_kill_twice_none_lost(box: Box) -> None:
    """apt-get install of the next build (same config, edited conffile kept): preinst stops the
    old daemon before the venv is replaced, postinst starts the new one. An OOM kill counted
    before is counted once after; one made while the daemon is stopped is counted once too."""
    config = _config("journal")
    restart_with(box, dropin=None, config=config)
    before = oom_kill(box)
    wait(lambda: kills(box, before) == 1.0, 30, f"the OOM kill of {before} before the upgrade")
    old_pid = show(box, "MainPID")["MainPID"]
    deb = distutil.build_deb(UPGRADE_VERSION)
    shutil.copy2(deb, box.share / deb.name)  # type: ignore[attr-defined]
    during = f"gwsd-oom-{uuid.uuid4().hex[:6]}"
    # waits for preinst's stop, then an OOM kill while the package is being replaced
    write(
        box,
        "/run/gw-during.sh",
        f"while systemctl is-active -q {UNIT}; do sleep 0.05; done\n"
        "date +%s.%N > /run/gw-stopped\n"
        f"{shlex.join(oom_argv(during))}\n"
        "date +%s.%N > /run/gw-killed\n",
    )
    box.sh("setsid -f /bin/sh /run/gw-during.sh </dev/null >/dev/null 2>&1")
    out = apt(box, "install", f"/srv/gw/{deb.name}")
    print(out)
    assert f"Unpacking gpuwatchd ({UPGRADE_VERSION}) over ({distutil.version()})" in out, out
    assert "Setting up gpuwatchd (" + UPGRADE_VERSION + ")" in out, out
    wait(
        lambda: box.run(["test", "-e", "/run/gw-killed"], check=False).returncode == 0,
        60,
        "the OOM kill made during the upgrade",
    )
    props = show(box, "ActiveState", "MainPID", "UnitFileState")
    assert props["ActiveState"] == "active" and props["UnitFileState"] == "enabled", props
    assert props["MainPID"] != old_pid, props
    stopped, killed = (box.run(["cat", f"/run/gw-{f}"]).stdout.strip() for f in ("stopped", "killed"))
    stamp = box.run(
        ["systemctl", "show", UNIT, "-p", "ExecMainStartTimestamp", "--value", "--timestamp=us+utc"]
    ).stdout.strip()
    started = (
        datetime.datetime.strptime(stamp, "%a %Y-%m-%d %H:%M:%S.%f UTC")
        .replace(tzinfo=datetime.timezone.utc)
        .timestamp()
    )
    print(
        f"old daemon stopped at {stopped}, the OOM kill done at {killed}, the new daemon "
        f"started at {started:.2f} (the kill {'before' if float(killed) < started else 'after'} it)"
    )
    wait(
        lambda: sample(box, "gpuwatch_build_info", version=UPGRADE_VERSION) == 1.0, 30, "the new build serving /metrics"
    )
    wait(lambda: kills(box, during) == 1.0, 30, f"the OOM kill of {during} (during the upgrade)", lambda: metrics(box))
    time.sleep(4)  # two more cycles: nothing is counted again
    assert (kills(box, before), kills(box, during)) == (1.0, 1.0), metrics(box)
    print(
        f"after the upgrade: gpuwatch_oom_kills_total{{comm={before!r}}} {kills(box, before)}, "
        f"{{comm={during!r}}} {kills(box, during)}"
    )
    assert box.run(["cat", CONFIG]).stdout == config  # the edited conffile is kept
    status = box.run(["cat", f"/proc/{props['MainPID']}/status"]).stdout
    assert int(re.search(r"^CapEff:\s+(\w+)", status, re.M).group(1), 16) == THREE_CAPS  # type: ignore[union-attr]
    after = oom_kill(box)
    wait(lambda: kills(box, after) == 1.0, 30, f"the OOM kill of {after} after the upgrade")
    box.run(["rm", "-f", "/run/gw-during.sh", "/run/gw-stopped", "/run/gw-killed"])


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


def _unchanged_since_the_snapshot(box: Box) -> None:
    after = box.sh(SNAPSHOT).stdout
    before = box.run(["cat", "/etc/gpuwatchd-test-snapshot"]).stdout
    gone_or_new = sorted(set(before.splitlines()) ^ set(after.splitlines()))
    assert not gone_or_new, "\n".join(gone_or_new)
    accounts = box.sh(f"cat {' '.join(ACCOUNT_FILES)}").stdout
    assert accounts == box.run(["cat", "/etc/gpuwatchd-test-snapshot.accounts"]).stdout
    assert box.run(["systemctl", "cat", UNIT], check=False).returncode != 0
    # (/run/systemd/container holds the test container's name, gpuwatchd-test)
    leftovers = box.sh(
        "grep -rls gpuwatchd /etc /run /var/lib /usr/lib/systemd /usr/lib/tmpfiles.d "
        "/usr/lib/sysusers.d --exclude-dir=dpkg --exclude-dir=apt --exclude=container "
        "--exclude='gpuwatchd-test-snapshot*' 2>/dev/null || true"
    ).stdout.split()
    assert not leftovers, leftovers


def test_apt_remove_stops_the_daemon_and_keeps_the_config(box: Box) -> None:
    box.run(["systemctl", "start", UNIT], timeout=60)
    config = box.run(["cat", CONFIG]).stdout
    out = apt(box, "remove", "gpuwatchd")
    print(out)
    assert "Removing gpuwatchd (" in out, out
    props = show(box, "ActiveState", "LoadState")
    assert props == {"ActiveState": "inactive", "LoadState": "not-found"}, props
    procs = box.cgroup_dir("pids", f"/system.slice/{UNIT}") / "cgroup.procs"
    assert not procs.exists() or not procs.read_text().split()
    assert box.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}", "gpuwatchd"]).stdout.strip() == "rc"
    assert box.run(["cat", CONFIG]).stdout == config
    for path in (VENV, "/usr/bin/gpuwatchd", f"/lib/systemd/system/{UNIT}"):
        assert box.run(["test", "-e", path], check=False).returncode != 0, path


def test_apt_purge_leaves_no_file_user_or_unit(box: Box) -> None:
    out = apt(box, "purge", "gpuwatchd")
    print(out)
    assert "Purging configuration files for gpuwatchd (" in out, out
    assert box.run(["dpkg-query", "-W", "gpuwatchd"], check=False).returncode != 0
    assert box.run(["getent", "passwd", "gpuwatchd"], check=False).returncode != 0
    assert box.run(["getent", "group", "gpuwatchd"], check=False).returncode != 0
    assert not box.sh("find /var/lib/systemd/deb-systemd-helper-enabled /etc/systemd -name 'gpuwatchd*'").stdout.strip()
    _unchanged_since_the_snapshot(box)


def test_install_sh_from_the_wheel_and_uninstall_leaves_nothing(box: Box) -> None:
    """The path for hosts that are not Debian: the built wheel into a venv, deploy/install.sh
    (after the purge, on the same system), then deploy/uninstall.sh."""
    [wheel] = [p.name for p in (box.share / "wheels").glob("gpuwatchd-*.whl")]  # type: ignore[attr-defined]
    box.run(["python3", "-m", "venv", "--system-site-packages", PIP_VENV])
    box.run(
        [
            f"{PIP_VENV}/bin/pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            "/srv/gw/wheels",
            f"/srv/gw/wheels/{wheel}",
        ],
        timeout=180,
    )
    out = box.run(["/srv/gw/src/deploy/install.sh", "--bin", f"{PIP_VENV}/bin/gpuwatchd"], timeout=120).stdout
    assert "installed /etc/systemd/system/gpuwatchd.service" in out, out
    assert "running: systemctl status gpuwatchd" in out, out
    props = show(box, "ActiveState", "ExecStart", "StatusText")
    assert props["ActiveState"] == "active" and f"path={PIP_VENV}/bin/gpuwatchd ;" in props["ExecStart"], props
    write(box, CONFIG, _config("journal"))
    box.run(["systemctl", "restart", UNIT], timeout=60)
    wait(lambda: sample(box, "gpuwatch_collector_success", collector="procfs") == 1.0, 30, "/metrics")
    res = box.run(["/srv/gw/src/deploy/uninstall.sh"], timeout=60)
    assert "done" in res.stdout, res.stdout
    box.run(["rm", "-rf", PIP_VENV])
    _unchanged_since_the_snapshot(box)
