"""deploy/kubernetes: rendered as `kubectl apply -k` would (and compared with `kubectl kustomize`
where kubectl is installed), the DaemonSet checked against what gpuwatchd needs and against the
systemd unit's capability set, the ConfigMap's config loaded with gpuwatchd's own loader."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatchd.config.schema import load_config

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
UNIT = ROOT / "systemd" / "gpuwatchd.service"


def render_kustomization() -> list[dict[str, Any]]:
    """What `kubectl apply -k` applies for this kustomization (which only lists resources and
    sets the namespace), without needing kubectl."""
    k = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    assert set(k) == {"apiVersion", "kind", "namespace", "resources"}, "this covers only those"
    docs = []
    for name in k["resources"]:
        for d in yaml.safe_load_all((KUSTOMIZE / name).read_text()):
            if d and d["kind"] != "Namespace":
                d.setdefault("metadata", {})["namespace"] = k["namespace"]
            if d:
                docs.append(d)
    return docs


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    docs = render_kustomization()
    kubectl = shutil.which("kubectl")
    if kubectl:  # where kubectl exists, its kustomize must agree with the rendering above
        out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        by_kind = {d["kind"]: d for d in yaml.safe_load_all(out.stdout) if d}
        assert by_kind == {d["kind"]: d for d in docs}
    return {d["kind"]: d for d in docs}


def test_renders_every_object(rendered: dict[str, dict[str, Any]]) -> None:
    assert set(rendered) == {"Namespace", "ConfigMap", "DaemonSet", "Service", "PodMonitor"}
    for kind, doc in rendered.items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "gpuwatchd", kind


def _container(rendered: dict[str, dict[str, Any]]) -> dict[str, Any]:
    [c] = rendered["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_pod_sees_the_host_and_has_only_the_three_capabilities(rendered: dict[str, dict[str, Any]]) -> None:
    pod = rendered["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod.get("hostNetwork", False) is False
    assert pod["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == "system-node-critical"
    sc = _container(rendered)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc.get("privileged", False) is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["capabilities"]["drop"] == ["ALL"]
    caps = {f"CAP_{c}" for c in sc["capabilities"]["add"]}
    unit_caps = set()
    for line in UNIT.read_text().splitlines():
        if line.startswith("AmbientCapabilities="):
            unit_caps |= set(line.split("=", 1)[1].split())
    assert caps == unit_caps == {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_SYSLOG"}
    for init in pod["initContainers"]:
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_host_paths_match_the_config(rendered: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    pod = rendered["DaemonSet"]["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {"/dev/kmsg", "/run/gpuwatch/ranks", "/var/lib/gpuwatchd"} <= set(host.values())
    mounts = {m["mountPath"]: m for m in _container(rendered)["volumeMounts"]}
    for m in mounts.values():
        if m["name"] in host:
            assert host[m["name"]] == m["mountPath"], m  # same path inside and outside
    # writable: flight-recorder requests and counted CUDA-OOM event files (read-only, every
    # request failed and each event was counted again each cycle)
    assert not mounts["/run/gpuwatch/ranks"].get("readOnly", False)
    assert not mounts["/var/lib/gpuwatchd"].get("readOnly", False)

    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(rendered["ConfigMap"]["data"]["config.yaml"])
    cfg = load_config(str(cfg_file))
    assert cfg.rank_dir in mounts and cfg.state_dir in mounts
    args = _container(rendered)["args"]
    assert args[:1] == ["run"]
    config_path = Path(args[args.index("--config.file") + 1])
    assert mounts[str(config_path.parent)]["name"] == "config"
    assert config_path.name == "config.yaml"

    port = int(cfg.web.listen_address.rsplit(":", 1)[1])
    [cport] = _container(rendered)["ports"]
    assert cport == {"name": "metrics", "containerPort": port, "protocol": "TCP"}


def test_scrape_objects_point_at_the_metrics_port(rendered: dict[str, dict[str, Any]]) -> None:
    labels = rendered["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    pm = rendered["PodMonitor"]["spec"]
    assert pm["selector"]["matchLabels"].items() <= labels.items()
    # job="gpuwatchd" in any namespace: the pods' name label, not "<namespace>/<PodMonitor>"
    assert labels[pm["jobLabel"]] == "gpuwatchd"
    [ep] = pm["podMetricsEndpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    svc = rendered["Service"]["spec"]
    assert svc["selector"].items() <= labels.items()
    assert svc["ports"][0]["targetPort"] == "metrics"


def test_every_container_runs_the_image_of_this_version(rendered: dict[str, dict[str, Any]]) -> None:
    """The name deploy/image/build.sh tags (tests/test_image.py runs that image under this pod
    spec): a version bump without the manifest's fails here, with no podman needed."""
    from gpuwatchd import __version__

    pod = rendered["DaemonSet"]["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {f"localhost/gpuwatchd:{__version__.replace('+', '-')}"}
