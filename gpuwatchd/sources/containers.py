"""Who a containerised process is, from its cgroup path alone (no API call, no label cardinality).

Reads the text of ``/proc/PID/cgroup`` (one small read, cached per process by the caller) and
recognises the paths that kubelet, slurmd and container engines create:

- Kubernetes, cgroupfs driver: ``/kubepods/burstable/pod<UID>/<container>``; systemd driver:
  ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<UID with _>.slice/...``
- Slurm (cgroup v1 ``/slurm/uid_U/job_J/step_S/...``, v2 ``.../slurmstepd.scope/job_J/step_S/...``)
- Docker (``/docker/<id>``, ``docker-<id>.scope``) and Podman (``libpod-<id>.scope``)

The pod's namespace and name are not in the cgroup path; learning them needs the API server,
which the daemon does not call, so the pod UID is what is shown
(``kubectl get pods -A -o custom-columns=UID:.metadata.uid,NS:.metadata.namespace,NAME:.metadata.name``
maps it). Shell equivalent: ``cat /proc/PID/cgroup``.
"""

from __future__ import annotations

import re

_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(r"kubepods\b.*?pod(" + _UUID + r")")
_SLURM = re.compile(r"(?:^|/)(?:slurm|slurmstepd\.scope)/(?:uid_\d+/)?job_(\d{1,12})(?:/step_([A-Za-z0-9_]{1,24}))?")
_DOCKER = re.compile(r"(?:/docker/|docker-)([0-9a-f]{12})[0-9a-f]{52}")
_PODMAN = re.compile(r"libpod-([0-9a-f]{12})[0-9a-f]{52}")
# identity() of a process in a Kubernetes pod: this, then the pod's UID
KUBERNETES_POD = "Kubernetes pod "


def identity(cgroup_text: str | None) -> str:
    """A short description ("Kubernetes pod UID", "Slurm job 1234 step 0", "Docker container
    ID12") of the container a process runs in, or "" when its cgroup path names none."""
    if not cgroup_text:
        return ""
    paths = [line.split(":", 2)[2] for line in cgroup_text.splitlines() if line.count(":") >= 2]
    for path in paths:
        m = _POD.search(path)
        if m:
            return KUBERNETES_POD + m.group(1).replace("_", "-")
    for path in paths:
        m = _SLURM.search(path)
        if m:
            return f"Slurm job {m.group(1)}" + (f" step {m.group(2)}" if m.group(2) else "")
    for path in paths:
        m = _DOCKER.search(path)
        if m:
            return f"Docker container {m.group(1)}"
        m = _PODMAN.search(path)
        if m:
            return f"Podman container {m.group(1)}"
    return ""


def pod_uid(container: str) -> str:
    """The pod UID in an ``identity()`` ("" when the process runs in no Kubernetes pod): the
    ``uid`` label that kube-state-metrics' ``kube_pod_info`` carries too."""
    return container[len(KUBERNETES_POD) :] if container.startswith(KUBERNETES_POD) else ""
