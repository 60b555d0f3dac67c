"""Build the ``gpuwatchd-client`` wheel: the modules that run inside a training process (the rank
API, the zero-code heartbeat, ``python -m gpuwatchd.rank.run``) and nothing else, from this tree.

    python3 tools/build_client.py --outdir dist

Copies ``CLIENT_FILES`` and ``client/`` (pyproject.toml, README.md) with the repository's setup.py
(which puts the heartbeat ``.pth`` at the top of site-packages) and LICENSE into a temporary
project, and runs ``python -m build --wheel`` on it (needs the ``build`` package, and an index or
``PIP_FIND_LINKS`` for setuptools in its isolated build environment). docs/packaging.md says why
this is a second distribution; tests/test_client_dist.py installs the wheel alone in a bare venv.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Every module a training process imports (``gpuwatchd.__init__`` loads the rank API lazily), and
# the data they read. A module added to this set must import only the standard library and these:
# the test imports every one in a venv that holds this wheel alone.
CLIENT_FILES = (
    "gpuwatchd/__init__.py",
    "gpuwatchd/py.typed",
    "gpuwatchd/model/__init__.py",
    "gpuwatchd/model/collectives.py",
    "gpuwatchd/model/nccl_ras.py",
    "gpuwatchd/rank/__init__.py",
    "gpuwatchd/rank/api.py",
    "gpuwatchd/rank/rankfile.py",
    "gpuwatchd/rank/rankdir.py",
    "gpuwatchd/rank/rankfile.schema.json",
    "gpuwatchd/rank/cuda_oom.py",
    "gpuwatchd/rank/flight_recorder.py",
    "gpuwatchd/rank/autobeat.py",
    "gpuwatchd/rank/run.py",
    "gpuwatchd/rank/gpuwatchd-heartbeat.pth",
)


def stage(dest: Path) -> Path:
    """The client's project tree under ``dest``."""
    for rel in CLIENT_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / "client" / name, dest / name)
    for name in ("setup.py", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def build(outdir: Path) -> Path:
    """Build the wheel into ``outdir``; returns its path."""
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gwclient-") as tmp:
        src = stage(Path(tmp) / "src")
        res = subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(src)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if res.returncode != 0:
            raise SystemExit(f"python -m build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    [wheel] = sorted(outdir.glob("gpuwatchd_client-*.whl"), key=lambda p: p.stat().st_mtime)[-1:]
    return wheel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outdir", type=Path, default=REPO / "dist")
    print(build(p.parse_args().outdir))


if __name__ == "__main__":
    main()
