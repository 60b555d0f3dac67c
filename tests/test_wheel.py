"""The wheel and sdist that ``python -m build`` makes (tests/distutil.py), checked as an index and a
user see them: the metadata validated by ``packaging`` (the library pip and twine read it with),
every file of the package in the wheel, the sdist complete enough to build the wheel and the
Debian package, and the wheel installed into a fresh venv outside the checkout (another working
directory, no PYTHONPATH, dependencies from wheels only) where ``gpuwatchd --version`` runs, the
rank-file schema is found as package data and ``gpuwatchd run`` serves /metrics on loopback.

Runs with Debian 12's python3 (3.11) like the deploy tests; about 25 s cold (the build), a few
seconds once the dependency wheels are cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import bootsystemd
import distutil
import pytest
from daemonutil import free_port
from packaging.metadata import Metadata
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "/usr/bin/python3"  # Debian 12's: the dependency wheels are built for it


def _git_files(under: str) -> list[str]:
    """Tracked and untracked (not ignored) files under ``under``: what a commit would ship."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", under],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(p for p in out.split() if (ROOT / p).is_file())


def test_metadata_is_ready_for_an_index() -> None:
    wheel, sdist = distutil.build_dist()
    with zipfile.ZipFile(wheel) as z:
        info = f"gpuwatchd-{distutil.version()}.dist-info"
        raw = z.read(f"{info}/METADATA")
        names = set(z.namelist())
    meta = Metadata.from_email(raw, validate=True)  # raises on any invalid field
    assert meta.name == "gpuwatchd" and str(meta.version) == distutil.version()
    assert str(meta.license_expression) == "Apache-2.0"
    assert meta.license_files == ["LICENSE"] and f"{info}/licenses/LICENSE" in names
    assert str(meta.requires_python) == ">=3.10"
    classifiers = set(meta.classifiers or [])
    for v in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {v}" in classifiers, v
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert {"Homepage", "Source", "Issues"} <= set(meta.project_urls or {})
    assert meta.description_content_type == "text/markdown"
    assert meta.description and meta.description.startswith("# gpuwatchd"), meta.description[:80]
    # the console script
    with zipfile.ZipFile(wheel) as z:
        assert "gpuwatchd = gpuwatchd.cli:main" in z.read(f"{info}/entry_points.txt").decode()
    # a pure wheel: one wheel for every Python and architecture
    assert wheel.name == f"gpuwatchd-{distutil.version()}-py3-none-any.whl"
    assert sdist.name == f"gpuwatchd-{distutil.version()}.tar.gz"


def test_every_file_of_the_package_is_in_the_wheel() -> None:
    """Package data included by rule, not by list: a data file added under gpuwatchd/ (a schema,
    a .pth launcher) that the wheel misses fails here."""
    wheel, _ = distutil.build_dist()
    with zipfile.ZipFile(wheel) as z:
        shipped = sorted(n for n in z.namelist() if not n.startswith("gpuwatchd-"))
    expected = [p for p in _git_files("gpuwatchd") if "__pycache__" not in p]
    assert [p for p in expected if p not in shipped] == []
    assert "gpuwatchd/rank/rankfile.schema.json" in shipped and "gpuwatchd/py.typed" in shipped
    strays = [n for n in shipped if n.split("/")[0] != "gpuwatchd" and not n.endswith(".pth")]
    assert strays == [], strays  # nothing but the package (and a top-level .pth, if one is added)


def test_sdist_holds_what_the_packages_are_built_from() -> None:
    _, sdist = distutil.build_dist()
    top = f"gpuwatchd-{distutil.version()}/"
    with tarfile.open(sdist) as t:
        names = {n[len(top) :] for n in t.getnames() if n.startswith(top)}
    needed = {
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "config.example.yaml",
        "MANIFEST.in",
        "gpuwatchd/rank/rankfile.schema.json",
        "deploy/install.sh",
        "deploy/debian/build.sh",
        "deploy/debian/postinst",
        "deploy/debian/copyright.py",
        "deploy/debian/manpage.py",
        "deploy/debian/lintian-overrides",
        "deploy/image/build.sh",
        "Containerfile",
        ".dockerignore",
        "tools/build_client.py",
        "client/pyproject.toml",
        "client/README.md",
    }
    needed |= set(_git_files("systemd"))
    assert needed - names == set()


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv outside the checkout with the built wheel installed, from wheels only."""
    wheel, _ = distutil.build_dist()
    home = tmp_path_factory.mktemp("wheel-user")
    env = _clean_env(home)
    subprocess.run([PYTHON, "-m", "venv", str(home / "venv")], check=True, cwd=home, env=env)
    res = subprocess.run(
        [
            str(home / "venv" / "bin" / "pip"),
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(bootsystemd.dependency_wheels()),
            str(wheel),
        ],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    yield home


def _clean_env(home: Path) -> dict[str, str]:
    return {"PATH": f"{home}/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def _run(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), cwd=home, env=_clean_env(home), capture_output=True, text=True, timeout=60)


def test_installed_wheel_version_and_package_data_outside_the_checkout(venv: Path) -> None:
    res = _run(venv, "gpuwatchd", "--version")
    assert res.returncode == 0 and res.stdout.strip() == f"gpuwatchd {distutil.version()}", res
    code = (
        "import gpuwatchd, importlib.resources, json\n"
        "schema = importlib.resources.files('gpuwatchd.rank').joinpath('rankfile.schema.json')\n"
        "print(gpuwatchd.__file__)\n"
        "print(json.loads(schema.read_text())['$id'])\n"
    )
    res = _run(venv, "python", "-c", code)
    assert res.returncode == 0, res.stderr
    where, schema_id = res.stdout.split()
    assert where.startswith(f"{venv}/venv/lib/") and not where.startswith(str(ROOT)), where
    assert schema_id.endswith("rankfile.schema.json"), schema_id
    assert json.loads((ROOT / "gpuwatchd/rank/rankfile.schema.json").read_text())["$id"] == schema_id


def test_installed_wheel_serves_metrics(venv: Path) -> None:
    port = free_port()
    (venv / "ranks").mkdir(exist_ok=True)
    cfg = venv / "config.yaml"
    cfg.write_text(
        f'web: {{listen_address: "127.0.0.1:{port}"}}\ninterval_seconds: 0.5\n'
        f"rank_dir: {venv}/ranks\nstate_dir: {venv}/state\nkernel_log: off\n"
        "gil: {enabled: false}\nnvml: {enabled: false}\ndiscovery: {enabled: false}\n"
    )
    log = open(venv / "run.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        ["gpuwatchd", "run", "--config.file", str(cfg)],
        cwd=venv,
        env=_clean_env(venv),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        samples: dict[tuple[str, str], float] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                samples = {
                    (s.name, json.dumps(s.labels, sort_keys=True)): s.value
                    for f in text_string_to_metric_families(body)
                    for s in f.samples
                }
                if samples.get(("gpuwatch_collector_success", '{"collector": "procfs"}')) == 1.0:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert samples.get(("gpuwatch_collector_success", '{"collector": "procfs"}')) == 1.0, (
            venv / "run.log"
        ).read_text()[-2000:]
        assert samples[("gpuwatch_build_info", json.dumps({"version": distutil.version()}))] == 1.0
        exe = os.readlink(f"/proc/{proc.pid}/exe")
        assert exe.startswith("/usr/bin/python3"), exe
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
