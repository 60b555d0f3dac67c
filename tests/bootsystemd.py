"""Boot a real systemd (Debian 12, systemd 252) in private namespaces, for tests/test_systemd_boot.py.

How (what it verifies: docs/security.md section 8): a Debian 12 minbase rootfs built
once with ``mmdebstrap`` (apt) and cached under ``/var/cache/gpuwatchd-test-rootfs/<hash of the
recipe>``; each boot mounts a fresh overlay on it (nothing written reaches the cache). A launcher
moves itself into a child cgroup of its own in every v1 hierarchy (so systemd's memory, CPU, task
and device limits are really enforced, by the host kernel), then ``unshare --fork --pid --mount
--uts --ipc --net --cgroup``, mounts proc, a read-only sysfs, the cgroup hierarchies *writable*,
a private /dev (null, zero, full, random, urandom, tty, kmsg), pivots into the overlay and execs
``/lib/systemd/systemd``. Commands go in with ``nsenter -t <PID 1> -a``. The network namespace has
only its own loopback.

Clean-up is by PID and cgroup only: the container's PID 1 is the launcher's child; whatever is
left in the child cgroups after power-off is killed by the PIDs listed in their ``cgroup.procs``,
then the cgroups are removed depth first. Never by process name.

Needs: root, cgroup v1 hierarchies at /sys/fs/cgroup (this host's hybrid layout), apt (installs
mmdebstrap when missing), ``unshare``/``nsenter`` (util-linux), overlayfs, and what is installed
in it built on the host (the container has no network): gpuwatchd's .deb or wheel
(tests/distutil.py) and its dependencies' wheels (``dependency_wheels``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

SUITE = "bookworm"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-venv",
    "python3-systemd",
    "procps",
    "curl",
    "util-linux",
    "iproute2",
)
# Units that wait for a terminal or for udev, which this container has no use for.
MASKED = (
    "getty@tty1.service",
    "console-getty.service",
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-networkd-wait-online.service",
)
RECIPE_VERSION = "1"
CACHE = Path(os.environ.get("GPUWATCHD_TEST_ROOTFS_CACHE", "/var/cache/gpuwatchd-test-rootfs"))
ROOTFS_PYTHON = (3, 11)  # Debian 12's python3: the wheelhouse must match it
CONTAINER = "gpuwatchd-test"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PREFIX = "gwsystemd-boot"
REPO = Path(__file__).resolve().parent.parent


def _recipe_key() -> str:
    text = "\n".join([RECIPE_VERSION, SUITE, *PACKAGES, *MASKED])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_mmdebstrap() -> str:
    """mmdebstrap's path; installed with apt when missing (scripts/test lists it too)."""
    found = shutil.which("mmdebstrap")
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "mmdebstrap"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True)
        subprocess.run(install, env=env, check=True, capture_output=True)
    found = shutil.which("mmdebstrap")
    assert found, "apt-get installed mmdebstrap but it is not on PATH"
    return found


def cached_rootfs() -> Path:
    """The pristine rootfs directory for this recipe, built once (about 30 s plus downloads)."""
    target = CACHE / f"rootfs-{_recipe_key()}"
    with _locked(CACHE / ".lock"):
        if (target / "etc" / "os-release").exists():
            return target
        tmp = CACHE / f".build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [
            ensure_mmdebstrap(),
            "--variant=minbase",
            "--include=" + ",".join(PACKAGES),
            '--customize-hook=chroot "$1" systemctl mask ' + " ".join(MASKED),
            # no hostname lookup of the host's name, no machine-id clash between boots
            '--customize-hook=rm -f "$1"/etc/machine-id; : > "$1"/etc/machine-id',
            SUITE,
            str(tmp),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"mmdebstrap failed ({res.returncode}):\n{res.stderr[-3000:]}")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def dependency_wheels() -> Path:
    """The wheels of gpuwatchd's [project] dependencies for the container's Python (Debian 12:
    3.11), in a directory cached per dependency list (``pip --no-index --find-links`` it)."""
    pyproject = (REPO / "pyproject.toml").read_text()
    deps_key = hashlib.sha256(pyproject.split("[project.optional-dependencies]")[0].encode())
    deps_cache = CACHE / f"wheels-{deps_key.hexdigest()[:16]}-cp{ROOTFS_PYTHON[0]}{ROOTFS_PYTHON[1]}"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    with _locked(CACHE / ".lock-wheels"):
        if not (deps_cache / ".complete").exists():
            shutil.rmtree(deps_cache, ignore_errors=True)
            deps_cache.mkdir(parents=True)
            reqs = _dependencies(pyproject)
            if sys.version_info[:2] == ROOTFS_PYTHON:
                subprocess.run(
                    [*pip, "wheel", "--wheel-dir", str(deps_cache), *reqs], check=True, capture_output=True, timeout=600
                )
            else:
                v = "".join(map(str, ROOTFS_PYTHON))
                subprocess.run(
                    [
                        *pip,
                        "download",
                        "--dest",
                        str(deps_cache),
                        "--only-binary=:all:",
                        "--python-version",
                        v,
                        "--implementation",
                        "cp",
                        "--platform",
                        "manylinux2014_x86_64",
                        "--platform",
                        "manylinux_2_17_x86_64",
                        "--platform",
                        "linux_x86_64",
                        *reqs,
                    ],
                    check=True,
                    capture_output=True,
                    timeout=600,
                )
            (deps_cache / ".complete").touch()
    return deps_cache


def build_wheelhouse(source: Path, dest: Path) -> Path:
    """``dependency_wheels()`` plus a wheel of ``source`` (``pip wheel``, from a copy: setuptools
    writes build/ and *.egg-info where it builds) in ``dest``. The packaging tests install what
    ``python -m build`` made instead (tests/distutil.py)."""
    dest.mkdir(parents=True, exist_ok=True)
    for whl in dependency_wheels().glob("*.whl"):
        shutil.copy2(whl, dest / whl.name)
    build = tempfile.mkdtemp(prefix=f"{PREFIX}-src-")
    try:
        shutil.copytree(
            source,
            build,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(
                ".venv",
                ".venv-*",
                ".git",
                "__pycache__",
                "build",
                "*.egg-info",
                ".mypy_cache",
                ".ruff_cache",
                ".pytest_cache",
                ".dev",
            ),
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--disable-pip-version-check",
                "-q",
                "wheel",
                "--no-deps",
                "--wheel-dir",
                str(dest),
                build,
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return dest


def _dependencies(pyproject: str) -> list[str]:
    """[project] dependencies (tomllib is Python >= 3.11 only; the list is plain strings)."""
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    assert block, "no dependencies = [...] in pyproject.toml"
    return re.findall(r'"([^"]+)"', block.group(1))


# --- cgroups ----------------------------------------------------------------------------------


def _hierarchies() -> dict[str, Path]:
    """The v1/v2 hierarchy of each line of /proc/self/cgroup -> our cgroup's directory in it."""
    known = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()[1:]}
    mounts: dict[str, tuple[Path, str]] = {}  # hierarchy -> (mount point, its root in it)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if rfields[0] == "cgroup2":
            mounts["0"] = (Path(fields[4]), fields[3])
        elif rfields[0] == "cgroup":  # super options: controllers, name=..., and others (xattr)
            opts = [o for o in rfields[2].split(",") if o in known or o.startswith("name=")]
            mounts[",".join(sorted(opts))] = (Path(fields[4]), fields[3])
    out: dict[str, Path] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        key = "0" if hid == "0" else ",".join(sorted(controllers.split(",")))
        if key in mounts:
            point, root = mounts[key]
            rel = os.path.relpath(path, root)
            out[controllers or "unified"] = point if rel == "." else point / rel
    return out


def make_cgroups(name: str) -> list[Path]:
    """A child cgroup ``name`` of ours in every hierarchy (cpuset: copy cpus/mems first)."""
    made: list[Path] = []
    for controllers, base in _hierarchies().items():
        child = base / name
        child.mkdir()
        made.append(child)
        if "cpuset" in controllers.split(","):
            for f in ("cpuset.cpus", "cpuset.mems"):
                (child / f).write_text((base / f).read_text())
    return made


def _procs(cg: Path) -> list[int]:
    pids: list[int] = []
    for d, _, files in os.walk(cg):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(d, "cgroup.procs").read_text().split()]
    return pids


def remove_cgroups(cgroups: Sequence[Path], timeout: float = 20.0) -> None:
    """Kill what is left in our cgroups (by the PIDs they list), then rmdir depth first."""
    deadline = time.monotonic() + timeout
    while True:
        pids = sorted({p for cg in cgroups if cg.exists() for p in _procs(cg)})
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    for cg in cgroups:
        if not cg.exists():
            continue
        for d, _, _ in sorted(os.walk(cg), key=lambda t: -len(t[0])):
            with contextlib.suppress(OSError):
                os.rmdir(d)


def reap_stale() -> None:
    """Leftovers of a boot whose test process died without cleaning up (SIGKILL, a crashed CI
    job): our own cgroups and work directories (``gwsystemd-boot-<pid>-...``) whose <pid> is gone.
    What still runs in such a cgroup is killed by the PIDs it lists."""
    owner = re.compile(rf"{re.escape(PREFIX)}-(\d+)-[0-9a-f]{{8}}\Z")

    def dead(name: str) -> bool:
        m = owner.match(name)
        return bool(m) and not os.path.exists(f"/proc/{m.group(1)}")

    stale: dict[str, list[Path]] = {}
    for base in _hierarchies().values():
        with contextlib.suppress(OSError):
            for child in base.iterdir():
                if child.is_dir() and dead(child.name):
                    stale.setdefault(child.name, []).append(child)
    for cgroups in stale.values():
        remove_cgroups(cgroups)
    for work in Path("/var/tmp").glob(f"{PREFIX}-*"):
        if dead(work.name.rsplit("-", 1)[0]) and work.is_dir():
            shutil.rmtree(work, ignore_errors=True)


# --- the container ----------------------------------------------------------------------------

_SETUP = r"""
set -eu
R=$1; LOWER=$2; WORK=$3; SHARE=$4; shift 4
mount --make-rprivate /
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$WORK/upper,workdir=$WORK/work" "$R"
mkdir -p "$R/srv/gw" "$R/oldroot"
mount --bind "$SHARE" "$R/srv/gw"
mount -o remount,bind,ro "$R/srv/gw"
mount -t proc proc "$R/proc"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs "$R/sys/fs/cgroup"
for spec in "$@"; do          # "controllers" (v1), "name=systemd", "unified" (cgroup2)
    case "$spec" in
        unified) mkdir -p "$R/sys/fs/cgroup/unified"
                 mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup/unified" ;;
        name=systemd) mkdir -p "$R/sys/fs/cgroup/systemd"
                 mount -t cgroup -o nosuid,nodev,noexec,none,name=systemd cgroup "$R/sys/fs/cgroup/systemd" ;;
        *) mkdir -p "$R/sys/fs/cgroup/$spec"
           mount -t cgroup -o "nosuid,nodev,noexec,$spec" cgroup "$R/sys/fs/cgroup/$spec"
           if [ "${spec#*,}" != "$spec" ]; then
               for c in $(echo "$spec" | tr , ' '); do ln -s "$spec" "$R/sys/fs/cgroup/$c"; done
           fi ;;
    esac
done
mount -t tmpfs -o mode=755,nosuid tmpfs "$R/dev"
mknod -m 666 "$R/dev/null" c 1 3; mknod -m 666 "$R/dev/zero" c 1 5
mknod -m 666 "$R/dev/full" c 1 7; mknod -m 666 "$R/dev/random" c 1 8
mknod -m 666 "$R/dev/urandom" c 1 9; mknod -m 666 "$R/dev/tty" c 5 0
mknod -m 644 "$R/dev/kmsg" c 1 11
mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"
mount -t mqueue mqueue "$R/dev/mqueue"
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs "$R/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/tmp"
ip link set lo up
hostname gpuwatchd-test
cd "$R"
pivot_root . oldroot
# shared like a host's / (systemd itself does this only outside containers), so that mounts made
# later (the test's /proc/devices) reach the services' PrivateMounts= namespaces
exec /usr/bin/env -i container=gpuwatchd-test PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh -c 'umount -l /oldroot && rmdir /oldroot && mount --make-rshared / &&
                exec /lib/systemd/systemd --log-target=journal'
"""


class BootedSystemd:
    """One booted container. ``run()``/``sh()`` execute inside it; ``close()`` powers it off."""

    def __init__(self, rootfs: Path, share: Path, boot_timeout: float = 90.0) -> None:
        reap_stale()
        self.name = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.work = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir="/var/tmp"))
        (self.work / "upper").mkdir()
        (self.work / "work").mkdir()
        (self.work / "root").mkdir()
        # the launcher's and setup script's output (systemd itself logs to the container's journal)
        self.console = open(self.work / "console.log", "wb")  # noqa: SIM115 - closed in close()
        self.cgroups = make_cgroups(self.name)
        specs = list(_hierarchies())  # what to mount inside: v1 controllers, name=systemd, unified
        join = " ".join(shlex.quote(str(cg / "cgroup.procs")) for cg in self.cgroups)
        launcher = (
            f'for f in {join}; do echo $$ > "$f"; done; exec unshare --fork --pid '
            "--mount --uts --ipc --net --cgroup --propagation private -- /bin/bash -c "
            f'{shlex.quote(_SETUP)} setup "$@"'
        )
        self.launcher = subprocess.Popen(
            [
                "/bin/bash",
                "-c",
                launcher,
                "launch",
                str(self.work / "root"),
                str(rootfs),
                str(self.work),
                str(share),
                *specs,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid1 = 0
        try:
            self.pid1 = self._find_pid1(30.0)
            self._wait_running(boot_timeout)
        except BaseException:
            self.close()
            raise

    def _find_pid1(self, timeout: float) -> int:
        """PID 1 of the container: the child of ``unshare --fork`` once it runs systemd."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.launcher.poll() is not None:
                raise RuntimeError(f"container launcher exited {self.launcher.returncode}:\n" + self.console_text())
            kids = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children")
            with contextlib.suppress(OSError):
                for pid in kids.read_text().split():
                    exe = os.readlink(f"/proc/{pid}/exe")
                    if exe.endswith("/systemd"):
                        return int(pid)
            time.sleep(0.1)
        raise RuntimeError("systemd did not start in the container:\n" + self.console_text())

    def _wait_running(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:  # the manager's socket appears a moment after exec
            res = self.run(
                ["systemctl", "is-system-running", "--wait"], check=False, timeout=max(1.0, deadline - time.monotonic())
            )
            state = res.stdout.strip()
            # "offline" also while PID 1 has exec'd systemd but not yet made /run/systemd/system
            # (seen once under load): keep asking until the deadline
            if (state and state != "offline") or time.monotonic() > deadline or self.launcher.poll() is not None:
                break
            time.sleep(0.2)
        if state not in ("running", "degraded"):
            raise RuntimeError(f"system state {state!r} ({res.stderr.strip()}):\n{self.console_text()}")
        if state == "degraded":  # say which unit, but go on: gpuwatchd is what is tested
            failed = self.run(["systemctl", "--failed", "--no-legend"], check=False).stdout
            print(f"container degraded: {failed}", file=sys.stderr)

    def console_text(self) -> str:
        with contextlib.suppress(OSError):
            return (self.work / "console.log").read_text(errors="replace")[-4000:]
        return ""

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the container (all its namespaces, as root)."""
        cmd = [
            "nsenter",
            "-t",
            str(self.pid1),
            "-a",
            "--",
            "/usr/bin/env",
            "-i",
            f"PATH={PATH}",
            "LANG=C.UTF-8",
            "SYSTEMD_PAGER=",
            "SYSTEMD_COLORS=0",
            *argv,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
        if check and res.returncode != 0:
            raise AssertionError(
                f"{shlex.join(argv)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            )
        return res

    def sh(self, script: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return self.run(["/bin/bash", "-c", script], **kw)  # type: ignore[arg-type]

    def path(self, inside: str) -> Path:
        """A path in the container's file system, from the host (through PID 1's root)."""
        return Path(f"/proc/{self.pid1}/root") / inside.lstrip("/")

    def cgroup_dir(self, controller: str, inside: str) -> Path:
        """The host directory of the container's cgroup ``inside`` (e.g. /system.slice/x)."""
        for controllers, cg in zip(_hierarchies(), self.cgroups, strict=True):
            if controller in controllers.split(","):
                return cg / inside.lstrip("/")
        raise KeyError(controller)

    def close(self) -> None:
        if self.pid1 and self.launcher.poll() is None:
            with contextlib.suppress(Exception):
                self.run(["systemctl", "--no-block", "poweroff"], check=False, timeout=20)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.launcher.wait(30)
        if self.launcher.poll() is None and self.pid1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGKILL)  # PID 1 of a PID namespace: all of it ends
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.launcher.wait(15)
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait(5)
        remove_cgroups(self.cgroups)
        self.console.close()
        shutil.rmtree(self.work, ignore_errors=True)
