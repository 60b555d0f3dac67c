"""The Debian package that deploy/debian/build.sh makes from the wheel (tests/distutil.py), read
with dpkg-deb on the host, without installing it: its control fields, files and conffile, the
maintainer scripts (debhelper's snippets, valid sh), md5sums, the unit as packaged, and the venv
it ships: relocated to /usr/lib/gpuwatchd (no path of the build directory left) and holding every
dependency itself, not borrowing one from the build host's Debian packages. Installing, upgrading
and purging it under a booted systemd: tests/test_systemd_boot.py. A few seconds once built.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import distutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = "usr/lib/gpuwatchd"


@pytest.fixture(scope="module")
def deb() -> Path:
    return distutil.build_deb()


@pytest.fixture(scope="module")
def tree(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("deb")
    subprocess.run(["dpkg-deb", "--raw-extract", str(deb), str(out)], check=True)
    yield out


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), name], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_control_fields(deb: Path) -> None:
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert deb.name == f"gpuwatchd_{distutil.version()}_{arch}.deb"
    assert _field(deb, "Package") == "gpuwatchd"
    assert _field(deb, "Version") == distutil.version()
    assert _field(deb, "Architecture") == arch
    depends = {d.split()[0] for d in _field(deb, "Depends").split(", ")}
    assert {"python3.11", "python3-systemd", "libudev1", "systemd", "init-system-helpers",
            "passwd"} == depends


def test_files_owners_and_conffile(deb: Path, tree: Path) -> None:
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    assert listing and all(line.split()[1] == "root/root" for line in listing), listing[:5]
    paths = {line.split()[5].lstrip(".").rstrip("/") for line in listing}
    for p in ("/lib/systemd/system/gpuwatchd.service", "/usr/lib/tmpfiles.d/gpuwatchd.conf",
              "/usr/lib/sysusers.d/gpuwatchd.conf", "/etc/gpuwatchd/config.yaml", "/usr/bin/gpuwatchd",
              f"/{VENV}/bin/gpuwatchd", f"/{VENV}/bin/py-spy", "/usr/share/doc/gpuwatchd/copyright"):
        assert p in paths, p
    # Debian Policy 9.1.2: nothing in /opt or /usr/local (dpkg would also remove /opt on purge)
    assert not [p for p in paths if p.startswith(("/opt", "/usr/local", "/var", "/run", "/home"))]
    assert (tree / "DEBIAN/conffiles").read_text().split() == ["/etc/gpuwatchd/config.yaml"]
    assert (tree / "etc/gpuwatchd/config.yaml").read_text() == (ROOT / "config.example.yaml").read_text()
    res = subprocess.run(["md5sum", "--check", "--quiet", str(tree / "DEBIAN/md5sums")], cwd=tree,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_unit_as_packaged(tree: Path) -> None:
    packaged = (tree / "lib/systemd/system/gpuwatchd.service").read_text()
    source = (ROOT / "systemd/gpuwatchd.service").read_text()
    assert packaged == source.replace("/usr/local/bin/gpuwatchd ", f"/{VENV}/bin/gpuwatchd ")
    assert f"ExecStart=/{VENV}/bin/gpuwatchd run --config.file /etc/gpuwatchd/config.yaml" in packaged
    for name in ("tmpfiles", "sysusers"):
        assert (tree / f"usr/lib/{name}.d/gpuwatchd.conf").read_text() == \
            (ROOT / f"systemd/gpuwatchd.{name}.conf").read_text()


def test_maintainer_scripts_are_debhelpers_snippets(tree: Path) -> None:
    scripts = {s: (tree / "DEBIAN" / s).read_text() for s in ("preinst", "postinst", "prerm", "postrm")}
    for name, text in scripts.items():
        assert subprocess.run(["sh", "-n", str(tree / "DEBIAN" / name)]).returncode == 0, name
        assert "# Automatically added by dh_" in text and "#UNITFILE" not in text, name
    post = scripts["postinst"]
    order = [post.index(s) for s in ("systemd-sysusers", "systemd-tmpfiles", "deb-systemd-helper enable",
                                     "deb-systemd-invoke start")]
    assert order == sorted(order), order
    assert 'deb-systemd-invoke stop gpuwatchd.service' in scripts["preinst"]  # stop before an upgrade
    assert '"$1" = remove' in scripts["prerm"] and "deb-systemd-invoke stop" in scripts["prerm"]
    assert "deb-systemd-helper purge gpuwatchd.service" in scripts["postrm"]
    assert "userdel gpuwatchd" in scripts["postrm"]


def test_venv_is_relocated_and_holds_every_dependency(tree: Path) -> None:
    venv = tree / VENV
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg and "home = /usr/bin" in cfg, cfg
    assert (venv / "bin/python3").readlink() == Path("python3.11")
    assert (venv / "bin/python3.11").readlink() == Path("/usr/bin/python3.11")
    assert (venv / "bin/gpuwatchd").read_text().splitlines()[0] == f"#!/{VENV}/bin/python"
    # no file names where it was built
    leaked = subprocess.run(["grep", "-rlIF", str(distutil.work_dir()), str(venv)],
                            capture_output=True, text=True).stdout.split()
    assert leaked == [], leaked
    assert not list(venv.glob("lib/python3.11/site-packages/pip")), "pip is left in the venv"
    # every dependency from the venv itself (a python3-yaml on the build host once satisfied
    # PyYAML and left it out: the package then failed on a node without python3-yaml)
    code = ("import gpuwatchd, yaml, h11, pyudev, pynvml, bcrypt\n"
            "for m in (gpuwatchd, yaml, h11, pyudev, pynvml, bcrypt): print(m.__file__)\n")
    res = subprocess.run([str(venv / "bin/python3"), "-c", code], capture_output=True, text=True,
                         cwd=tree, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    site = f"{venv}/lib/python3.11/site-packages/"
    outside = [f for f in res.stdout.split() if not f.startswith(site)]
    assert outside == [], outside
    # byte code compiled for the installed paths, checked by hash (never rewritten at run time)
    pyc = next(venv.glob("lib/python3.11/site-packages/gpuwatchd/__pycache__/__init__.cpython-311.pyc"))
    flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
    assert flags == 0b11, flags  # hash-based, checked
    assert re.search(rb"/usr/lib/gpuwatchd/lib/python3\.11/site-packages/gpuwatchd/__init__\.py",
                     pyc.read_bytes())
