"""What fleets install, built the way a release builds it, once per test run: the wheel and the
sdist (``python -m build``), the Debian package (``deploy/debian/build.sh``) and the DaemonSet's
image (``deploy/image/build.sh``), for tests/test_wheel.py, tests/test_systemd_boot.py and
tests/test_image.py; and the training images' ``gpuwatchd-client`` wheel
(``tools/build_client.py``) for tests/test_autobeat.py.

Each is built from a copy of the working tree (``python -m build`` writes ``*.egg-info`` where it
runs), optionally with another ``__version__`` (the upgrade test's second build). Builds are kept
for the life of the test process (a temporary directory removed at exit); the dependencies' wheels
and the Debian roots are cached across runs under /var/cache/gpuwatchd-test-rootfs, as the boot
test caches its rootfs. Needs: the dev extra's ``build`` (and an index for setuptools, which
``python -m build`` installs into its isolated build environment), dpkg-deb, python3-venv;
mmdebstrap and podman for the image.
"""

from __future__ import annotations

import atexit
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import bootsystemd

REPO = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(
    ".venv",
    ".venv-*",
    ".git",
    "__pycache__",
    "build",
    "dist",
    "*.egg-info",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".dev",
    ".whl",
    ".gl",
    ".before",
)
_WORK = Path(tempfile.mkdtemp(prefix="gwdist-"))
atexit.register(shutil.rmtree, _WORK, True)
_built: dict[tuple[str, str], Path] = {}


def version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"', (REPO / "gpuwatchd" / "__init__.py").read_text(), re.M)
    assert m, "no __version__ in gpuwatchd/__init__.py"
    return m.group(1)


def source(ver: str | None = None) -> Path:
    """A copy of the working tree, with ``__version__ = ver`` when given."""
    key = ("src", ver or "")
    if key not in _built:
        dest = _WORK / f"src-{ver or 'tree'}"
        shutil.copytree(REPO, dest, ignore=IGNORE)
        if ver:
            init = dest / "gpuwatchd" / "__init__.py"
            text = init.read_text()
            init.write_text(re.sub(r'^__version__ = "[^"]+"', f'__version__ = "{ver}"', text, count=1, flags=re.M))
        _built[key] = dest
    return _built[key]


def build_dist(ver: str | None = None) -> tuple[Path, Path]:
    """(wheel, sdist) by ``python -m build`` (the sdist first, the wheel from the sdist)."""
    key = ("dist", ver or "")
    if key not in _built:
        out = _WORK / f"dist-{ver or 'tree'}"
        res = subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(out), str(source(ver))],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, f"python -m build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        _built[key] = out
    out = _built[key]
    [wheel] = out.glob("gpuwatchd-*.whl")
    [sdist] = out.glob("gpuwatchd-*.tar.gz")
    return wheel, sdist


def build_client() -> Path:
    """gpuwatchd-client's wheel by ``tools/build_client.py`` (``python -m build``) from a copy of
    the working tree: the rank side alone, for training images (docs/packaging.md)."""
    key = ("client", "")
    if key not in _built:
        out = _WORK / "client"
        res = subprocess.run(
            [sys.executable, str(source() / "tools" / "build_client.py"), "--outdir", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, f"tools/build_client.py failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        [_built[key]] = out.glob("gpuwatchd_client-*.whl")
    return _built[key]


def build_deb(ver: str | None = None) -> Path:
    """gpuwatchd_VERSION_ARCH.deb by deploy/debian/build.sh from the wheel of ``build_dist``,
    with the dependencies' wheels from the cache (no index)."""
    key = ("deb", ver or "")
    if key not in _built:
        wheel, _ = build_dist(ver)
        out = _WORK / f"deb-{ver or 'tree'}"
        res = subprocess.run(
            [
                "bash",
                str(source(ver) / "deploy" / "debian" / "build.sh"),
                "--wheel",
                str(wheel),
                "--find-links",
                str(bootsystemd.dependency_wheels()),
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, f"deploy/debian/build.sh failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        _built[key] = Path(res.stdout.strip().splitlines()[-1])
    return _built[key]


def work_dir() -> Path:
    return _WORK
