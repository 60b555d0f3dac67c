"""The DaemonSet's image, built from the Containerfile by deploy/image/build.sh (podman build, FROM a
Debian 12 root made by mmdebstrap: no registry; the wheels from a local directory: no index, no
network) and run with podman (runc) under the DaemonSet's own pod spec: the podman flags are derived from
deploy/kubernetes/daemonset.yaml (hostPID, the security context, the limits, the env, the volume
mounts and the args), and a key of the pod spec this test does not enact fails the test, so the
manifest cannot drift from what ran. Its init container runs first, as in a pod.

There it must serve /metrics (in the pod's own network namespace: hostNetwork is false), see a
rank registered from another container (its own PID and mount namespace, the rank directory
shared through the host path) and that rank's real OOM kill in the container's memory cgroup,
read from the host journal the manifest mounts, and pass ``gpuwatchd check``.

NVML: no GPU here; the config (the ConfigMap's, with a 1 s interval) replays a recording of
idle H200s (tests/fixtures/nvml/h200_idle.json) for the daemon and ``gpuwatchd check``.

The host journal: this CI host runs no systemd, so the test runs Debian's systemd-journald
itself, in a private mount namespace, reading the host's /dev/kmsg (the kernel log, as on a node)
and writing where the manifest's journal host paths point. The manifest's host paths are kept
under a private directory of the test (``HOST``) so that runs in parallel share nothing; /proc
(hostPID), /dev/kmsg and /etc/machine-id are the host's own. Not enacted: runtimeClassName nvidia
(no GPU here), nodeSelector, tolerations, priorityClassName. The runtime's rlimits are set below
the host's (runc cannot raise them here: the issue's measurement).

Reproducible: a second build of the same inputs (--no-cache) gives the same layers and the same
image ID; its labels are the OCI ones, from the version, the revision and SOURCE_DATE_EPOCH.

Needs root, podman, runc, mmdebstrap, journald. On the 2-core VM shared with other work: the
build 110 s, the second build 80 s, the pod 30 s, with the Debian root cached
(/var/cache/gpuwatchd-test-rootfs); mmdebstrap adds 2-9 min when it is not.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bootsystemd
import distutil
import pytest
import yaml
from containerutil import RANK_CODE
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
BUILD = ROOT / "deploy" / "image" / "build.sh"
THREE_CAPS = (1 << 2) | (1 << 19) | (1 << 34)  # DAC_READ_SEARCH, SYS_PTRACE, SYSLOG
EPOCH = "1700000000"  # SOURCE_DATE_EPOCH of the builds
# host paths that are the host's own in the test; every other one lives under HOST
REAL_HOST_PATHS = ("/dev/kmsg", "/etc/machine-id")
RLIMITS = ("--ulimit=nofile=1024:1024", "--ulimit=nproc=4096:4096")
POD_KEYS_ENACTED = {
    "hostPID",
    "hostNetwork",
    "containers",
    "initContainers",
    "volumes",
    "automountServiceAccountToken",
    "enableServiceLinks",
    "terminationGracePeriodSeconds",
}
POD_KEYS_NOT_HERE = {"priorityClassName", "runtimeClassName", "nodeSelector", "tolerations"}
SC_KEYS = {
    "runAsUser",
    "runAsGroup",
    "allowPrivilegeEscalation",
    "readOnlyRootFilesystem",
    "privileged",
    "seccompProfile",
    "capabilities",
}
CONTAINER_KEYS = {
    "name",
    "image",
    "command",
    "args",
    "env",
    "ports",
    "securityContext",
    "resources",
    "volumeMounts",
    "livenessProbe",
    "readinessProbe",
}


def _manifest() -> tuple[dict[str, Any], dict[str, str]]:
    ds = yaml.safe_load((KUBE / "daemonset.yaml").read_text())
    cm = yaml.safe_load((KUBE / "configmap.yaml").read_text())
    return ds["spec"]["template"]["spec"], cm["data"]


def _quantity(q: str) -> str:
    """A Kubernetes quantity as podman takes it: 256Mi -> 256m (MiB), 250m CPU -> 0.25."""
    m = re.fullmatch(r"(\d+)(Mi|Gi)", q)
    if m:
        return m.group(1) + {"Mi": "m", "Gi": "g"}[m.group(2)]
    m = re.fullmatch(r"(\d+)m", q)
    assert m, q
    return str(int(m.group(1)) / 1000)


def podman_args(pod: dict[str, Any], container: dict[str, Any], host: Path, configmap_dir: Path) -> list[str]:
    """``podman run`` flags enacting ``container`` of ``pod`` (all but its name, image and args)."""
    assert set(pod) <= POD_KEYS_ENACTED | POD_KEYS_NOT_HERE, set(pod) - POD_KEYS_ENACTED - POD_KEYS_NOT_HERE
    assert set(container) <= CONTAINER_KEYS, set(container) - CONTAINER_KEYS
    args = ["--runtime=runc", *RLIMITS]
    if "command" in container:  # Kubernetes' command replaces the image's ENTRYPOINT
        args.append("--entrypoint=" + json.dumps(container["command"]))
    assert pod["hostPID"] is True
    args.append("--pid=host")
    # the pod's own network namespace; the test scrapes it through nsenter (no CNI on CI)
    assert pod.get("hostNetwork", False) is False
    args.append("--network=none")
    sc = container["securityContext"]
    assert set(sc) <= SC_KEYS, set(sc) - SC_KEYS
    args.append(f"--user={sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}")
    if sc.get("allowPrivilegeEscalation") is False:
        args.append("--security-opt=no-new-privileges")
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    assert sc.get("privileged", False) is False
    # RuntimeDefault: the runtime's default profile, which is podman's when nothing is said
    assert sc.get("seccompProfile", {"type": "RuntimeDefault"}) == {"type": "RuntimeDefault"}
    caps = sc["capabilities"]
    assert caps["drop"] == ["ALL"]
    args.append("--cap-drop=ALL")
    args += [f"--cap-add={c}" for c in caps.get("add", [])]
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        args += [f"--memory={_quantity(limits['memory'])}", f"--memory-swap={_quantity(limits['memory'])}"]
    if "cpu" in limits:
        args.append(f"--cpus={_quantity(limits['cpu'])}")
    args += [f"--env={e['name']}={e['value']}" for e in container.get("env", [])]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        ro = ":ro" if m.get("readOnly") else ""
        if "configMap" in v:
            args.append(f"--volume={configmap_dir}:{m['mountPath']}:ro")
        elif "emptyDir" in v:
            assert v["emptyDir"].get("medium") == "Memory", v
            size = _quantity(v["emptyDir"]["sizeLimit"])
            args.append(f"--tmpfs={m['mountPath']}:rw,size={size},mode=1777")
        else:
            path = v["hostPath"]["path"]
            src = Path(path) if path in REAL_HOST_PATHS else host / path.lstrip("/")
            if v["hostPath"].get("type") == "DirectoryOrCreate":
                src.mkdir(parents=True, exist_ok=True)
            assert src.exists(), f"host path {src} (volume {m['name']}) is missing"
            args.append(f"--volume={src}:{m['mountPath']}{ro}")
    return args


class Podman:
    """podman with a private store under ``dir``, run in ``dir``: conmon writes a file named
    ``oom`` into its working directory when a container is OOM-killed. overlay, not vfs: a build
    makes an intermediate image per instruction, which vfs copies whole (a build took 10 min
    with vfs, 2 min with overlay, on the loaded 2-core VM); ``close`` removes every container,
    so no overlay stays mounted."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.base = [
            "podman",
            f"--root={dir}/storage",
            f"--runroot={dir}/run",
            "--storage-driver=overlay",
            "--events-backend=file",
            "--cgroup-manager=cgroupfs",
        ]

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, input=input, cwd=self.dir
        )
        if check:
            assert res.returncode == 0, f"podman {' '.join(args[:3])} exited {res.returncode}:\n{res.stderr}"
        return res

    def close(self) -> None:
        self("rm", "--force", "--all", "--time=5", check=False)
        self("rmi", "--force", "--all", check=False)


def _base_tar() -> Path:
    """The Debian root of the image, made by ``build.sh --base-only`` once per recipe (cached)."""
    recipe = re.search(r"^make_base\(\).*?^}", BUILD.read_text(), re.M | re.S)
    assert recipe
    key = hashlib.sha256(
        (recipe.group(0) + str(re.findall(r"^(SUITE|PACKAGES)=.*", BUILD.read_text(), re.M))).encode()
    ).hexdigest()[:16]
    tar = bootsystemd.CACHE / f"image-base-{key}.tar"
    bootsystemd.CACHE.mkdir(parents=True, exist_ok=True)
    with open(bootsystemd.CACHE / ".lock-image", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tar.exists():
            tmp = tar.with_suffix(f".{os.getpid()}")
            res = subprocess.run(
                ["bash", str(BUILD), "--base-only", str(tmp)], capture_output=True, text=True, timeout=900
            )
            assert res.returncode == 0, res.stderr[-3000:]
            tmp.rename(tar)
    return tar


class Journald:
    """Debian's systemd-journald, run by the test in a private mount namespace: it reads the
    host's /dev/kmsg and writes the journal, and makes its sockets, where ``host`` keeps the
    manifest's journal host paths."""

    def __init__(self, host: Path) -> None:
        run, sock, var = host / "run/log/journal", host / "run/systemd/journal", host / "var/log/journal"
        for d in (run, sock, var):
            d.mkdir(parents=True, exist_ok=True)
        script = (
            "set -e; mount -t tmpfs gwimage-run /run; mkdir -p /run/systemd/journal /run/log/journal; "
            f'mount --bind "{sock}" /run/systemd/journal; mount --bind "{run}" /run/log/journal; '
            f'mkdir -p /var/log/journal; mount --bind "{var}" /var/log/journal; '
            # volatile storage, as on most nodes (Storage=auto and an empty /var/log/journal
            # would make it persistent; either is mounted into the pod)
            "mount -t tmpfs gwimage-varlog /var/log/journal; "
            "exec /lib/systemd/systemd-journald"
        )
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
        )
        deadline = time.monotonic() + 15
        while not (sock / "socket").exists() or not any(run.glob("*/system.journal")):
            assert self.proc.poll() is None and time.monotonic() < deadline, "journald did not start"
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _wheelhouse(dest: Path) -> Path:
    """The dependencies' wheels and setuptools' (the build backend ``pip wheel`` needs in the
    builder stage), for ``build.sh --find-links``: the image build fetches nothing."""
    dest.mkdir()
    for whl in bootsystemd.dependency_wheels().glob("*.whl"):
        shutil.copy2(whl, dest)
    backend = re.search(r"^requires = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    assert backend
    reqs = [r.strip().strip('"') for r in backend.group(1).split(",")]
    cache = bootsystemd.CACHE / f"build-backend-{hashlib.sha256(' '.join(reqs).encode()).hexdigest()[:16]}"
    with open(bootsystemd.CACHE / ".lock-image", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / ".complete").exists():
            shutil.rmtree(cache, ignore_errors=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--disable-pip-version-check",
                    "--only-binary=:all:",
                    "--dest",
                    str(cache),
                    *reqs,
                ],
                check=True,
                capture_output=True,
                timeout=600,
            )
            (cache / ".complete").touch()
    for whl in cache.glob("*.whl"):
        shutil.copy2(whl, dest)
    return dest


def _build(podman: Podman, wheels: Path, *extra: str) -> tuple[str, float]:
    """deploy/image/build.sh on the test's copy of the tree, FROM the cached Debian root: (the
    image's name, seconds)."""
    t0 = time.monotonic()
    res = subprocess.run(
        [
            "bash",
            str(distutil.source() / "deploy/image/build.sh"),
            "--find-links",
            str(wheels),
            "--base",
            str(_base_tar()),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PODMAN": " ".join(podman.base), "SOURCE_DATE_EPOCH": EPOCH},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1], time.monotonic() - t0


@pytest.fixture(scope="module")
def image_env() -> Iterator[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"gwimage-{os.getpid()}-", dir="/var/tmp"))
    podman = Podman(work)
    journald = None
    try:
        wheels = _wheelhouse(work / "wheels")
        tag, took = _build(podman, wheels)
        print(f"image {tag} built in {took:.1f}s")
        host = work / "host"
        journald = Journald(host)
        yield {"podman": podman, "tag": tag, "host": host, "work": work, "wheels": wheels}
    finally:
        podman.close()
        if journald is not None:
            journald.close()
        shutil.rmtree(work, ignore_errors=True)


def test_manifest_names_the_image_the_build_makes(image_env: dict[str, Any]) -> None:
    pod, _ = _manifest()
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {image_env["tag"]} == {f"localhost/gpuwatchd:{distutil.version()}"}
    inspect = json.loads(image_env["podman"]("image", "inspect", image_env["tag"]).stdout)[0]
    assert inspect["Config"]["Entrypoint"] == ["/usr/lib/gpuwatchd/bin/gpuwatchd"]
    labels = inspect["Config"]["Labels"]
    oci = "org.opencontainers.image."
    assert labels[oci + "version"] == distutil.version()
    assert labels[oci + "created"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(EPOCH)))
    assert inspect["Created"].startswith(labels[oci + "created"][:-1])  # --timestamp
    assert labels[oci + "revision"] == "unknown"  # the test's copy of the tree has no .git
    assert labels[oci + "source"].startswith("https://") and "Apache-2.0" in labels[oci + "licenses"]
    assert labels[oci + "title"] == "gpuwatchd" and labels[oci + "description"]


def test_containerfile_version_is_the_packages(image_env: dict[str, Any]) -> None:
    """The Containerfile's default VERSION (what a plain ``podman build .`` labels) is
    ``__version__``; the builder stage also refuses a wheel of another version."""
    text = (ROOT / "Containerfile").read_text()
    assert re.findall(r"^ARG VERSION=(\S+)$", text, re.M) == [distutil.version()] * 2


def test_two_builds_of_the_same_inputs_give_the_same_layers(image_env: dict[str, Any]) -> None:
    """Reproducible: the same tree, root, wheels and SOURCE_DATE_EPOCH, built again from nothing
    cached, give the same layer digests (the venv's and the config's too) and the same image."""
    podman = image_env["podman"]
    again, took = _build(podman, image_env["wheels"], "--tag", "localhost/gpuwatchd:again", "--", "--no-cache")
    print(f"second build in {took:.1f}s")
    first, second = (json.loads(podman("image", "inspect", t).stdout)[0] for t in (image_env["tag"], again))
    assert len(first["RootFS"]["Layers"]) == 4, first["RootFS"]["Layers"]  # root, apt, venv, config
    assert first["RootFS"]["Layers"] == second["RootFS"]["Layers"]
    assert first["Id"] == second["Id"]


def test_image_holds_the_same_venv_as_the_debian_package(image_env: dict[str, Any]) -> None:
    """deploy/venv.sh makes both: the same files, the same sizes (the image is what the unit
    suite tested, in a pod)."""
    listing = image_env["podman"](
        "run",
        "--rm",
        "--runtime=runc",
        *RLIMITS,
        "--network=none",
        "--entrypoint=/usr/bin/find",
        image_env["tag"],
        "/usr/lib/gpuwatchd",
        "-mindepth",
        "1",
        "-printf",
        "%P %s %y\n",
    ).stdout
    # the image has its byte code compiled at build time, the .deb at postinst
    in_image = {line for line in listing.splitlines() if not line.endswith(" d") and "__pycache__/" not in line}
    deb = subprocess.run(
        ["dpkg-deb", "--contents", str(distutil.build_deb())], capture_output=True, text=True, check=True
    ).stdout
    in_deb = set()
    for line in deb.splitlines():
        mode, _, size, _, _, path, *_ = line.split()
        if path.startswith("./usr/lib/gpuwatchd/") and mode[0] != "d":
            in_deb.add(
                f"{path[len('./usr/lib/gpuwatchd/') :]} {size if mode[0] == '-' else len(line.split()[-1])} "
                f"{'f' if mode[0] == '-' else 'l'}"
            )
    assert in_image == in_deb, sorted(in_image ^ in_deb)[:20]


def _scrape(pid: int, path: str = "/metrics") -> tuple[int, str]:
    res = subprocess.run(
        [
            "nsenter",
            "-t",
            str(pid),
            "-n",
            "curl",
            "-s",
            "-o",
            "/dev/stdout",
            "-w",
            "\n%{http_code}",
            "--max-time",
            "5",
            f"http://127.0.0.1:9863{path}",
        ],
        capture_output=True,
        text=True,
        timeout=15,
    )
    body, _, code = res.stdout.rpartition("\n")
    return int(code or 0), body


def _samples(pid: int) -> list[tuple[str, dict[str, str], float]]:
    code, body = _scrape(pid)
    if code != 200:
        return []
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(body) for s in f.samples]


def _value(pid: int, name: str, **labels: str) -> float | None:
    for n, ls, v in _samples(pid):
        if n == name and labels.items() <= ls.items():
            return v
    return None


def _wait(pred: Callable[[], object], timeout: float, what: str, detail: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}" + (f": {detail()}" if detail else ""))


def test_daemonset_pod_in_podman_serves_sees_a_rank_and_its_oom_kill_and_passes_check(
    image_env: dict[str, Any],
) -> None:
    podman, tag, host, work = (image_env[k] for k in ("podman", "tag", "host", "work"))
    pod, cm = _manifest()
    configmap = work / "configmap"
    configmap.mkdir()
    cfg = yaml.safe_load(cm["config.yaml"])
    # every key as shipped but two: a 1 s interval (5 s shipped) and, with no GPU here, NVML
    # replayed from a recording of 8 idle H200s (the daemon's and `gpuwatchd check`'s)
    cfg["interval_seconds"] = 1
    shutil.copy2(ROOT / "tests/fixtures/nvml/h200_idle.json", configmap / "nvml.json")
    cfg.setdefault("nvml", {})["fixture"] = "/etc/gpuwatchd/nvml.json"
    (configmap / "config.yaml").write_text(yaml.safe_dump(cfg))
    # the init container, as the kubelet runs it before the daemon: the rank dir becomes 1777
    for init in pod["initContainers"]:
        podman(
            "run",
            "--rm",
            "--name",
            f"gwimage-init-{uuid.uuid4().hex[:6]}",
            *podman_args(pod, init, host, configmap),
            tag,
            *init.get("args", []),
        )
    ranks = host / "run/gpuwatch/ranks"
    assert oct(ranks.stat().st_mode & 0o7777) == "0o1777"
    [container] = pod["containers"]
    name = f"gwimage-{uuid.uuid4().hex[:8]}"
    flags = podman_args(pod, container, host, configmap)
    print("podman run", " ".join(flags))
    podman("run", "--detach", "--name", name, *flags, tag, *container["args"])
    try:
        pid = int(podman("inspect", "--format", "{{.State.Pid}}", name).stdout)
        logs = lambda: podman("logs", name, check=False).stderr[-3000:]  # noqa: E731
        _wait(
            lambda: _value(pid, "gpuwatch_collector_success", collector="kernel_log") == 1.0,
            60,
            "/metrics with the kernel log read from the host journal",
            logs,
        )
        status = dict(re.findall(r"^(\w+):\s+(.*)$", Path(f"/proc/{pid}/status").read_text(), re.M))
        for cap in ("CapPrm", "CapEff", "CapBnd"):
            assert int(status[cap], 16) == THREE_CAPS, (cap, status[cap])
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status
        assert status["Uid"].split()[0] == "0"
        assert os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")  # hostPID
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        touch = podman("exec", name, "touch", "/opt/x", check=False)
        assert "Read-only file system" in touch.stderr, touch
        assert _scrape(pid, container["livenessProbe"]["httpGet"]["path"])[0] == 200
        assert _scrape(pid, container["readinessProbe"]["httpGet"]["path"])[0] == 200
        assert _value(pid, "gpuwatch_build_info", version=distutil.version()) == 1.0
        assert _value(pid, "gpuwatch_collector_success", collector="nvml") == 1.0

        # a training pod: its own PID and mount namespace, the node's rank dir, a 64 MiB limit
        job = f"gwimage-{uuid.uuid4().hex[:6]}"
        rank = subprocess.Popen(
            [
                *podman.base,
                "run",
                "--rm",
                "-i",
                "--name",
                f"{job}-r0",
                "--runtime=runc",
                *RLIMITS,
                "--network=none",
                "--user=4242:4242",
                "--memory=64m",
                "--memory-swap=64m",
                f"--volume={ranks}:/run/gpuwatch/ranks",
                "--env=RANK=0",
                "--env=LOCAL_RANK=0",
                "--env=WORLD_SIZE=1",
                f"--env=TORCHELASTIC_RUN_ID={job}",
                "--env=GW_WAIT_GO=1",
                "--env=GW_HEARTBEAT=/tmp/gw.hb",
                "--entrypoint=/usr/lib/gpuwatchd/bin/python",
                tag,
                "-c",
                RANK_CODE,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=work,
        )
        try:
            assert rank.stdout is not None and rank.stdin is not None
            line = rank.stdout.readline().split()
            assert line[:1] == ["ready"], (line, rank.stderr.read() if rank.poll() is not None else "")
            print("rank in its container:", line)
            _wait(
                lambda: _value(pid, "gpuwatch_rank_up", job_id=job, rank="0") == 1.0,
                30,
                f"rank 0 of {job} registered from another container",
                logs,
            )
            check = podman(
                "exec", name, "gpuwatchd", "check", "--config.file", "/etc/gpuwatchd/config.yaml", check=False
            )
            print("gpuwatchd check:", check.returncode, check.stdout, check.stderr)
            rank.stdin.write("g")
            rank.stdin.flush()
            rank.wait(60)
            assert rank.returncode == 137, rank.returncode  # SIGKILL: the OOM killer
            _wait(
                lambda: (_value(pid, "gpuwatch_oom_kills_total", job_id=job) or 0) >= 1,
                30,
                f"the OOM kill of rank 0 of {job}",
                lambda: [s for s in _samples(pid) if "oom" in s[0]],
            )
            kills = [
                (ls, v) for n, ls, v in _samples(pid) if n == "gpuwatch_oom_kills_total" and ls.get("job_id") == job
            ]
            print("oom kills:", kills)
            assert [v for _, v in kills] == [1.0], kills
        finally:
            if rank.poll() is None:
                podman("rm", "--force", f"{job}-r0", check=False)
                rank.wait(30)
            for s in (rank.stdin, rank.stdout, rank.stderr):
                if s is not None:
                    s.close()
        assert check.returncode == 0, (check.stdout, check.stderr)
    finally:
        podman("rm", "--force", "--time=10", name, check=False)
