"""deploy/install.sh and deploy/uninstall.sh, run for real against temporary roots (--root) with
the real systemd-sysusers, systemd-tmpfiles, userdel and groupdel: install twice changes nothing,
uninstall leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "deploy" / "install.sh"
UNINSTALL = ROOT / "deploy" / "uninstall.sh"
BIN = Path(sys.executable).parent / "gpuwatchd"  # the venv running the tests
ACCOUNT_FILES = ("passwd", "group", "shadow", "gshadow")
# shadow-utils (userdel, groupdel) rewrite their backup copies ("passwd-") on every change, as on
# any host; their contents are the tools' business, their presence is compared like every file.
BACKUPS = tuple(f"etc/{name}-" for name in ACCOUNT_FILES)


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every path under root -> (mode, uid, gid, sha256 of the content for files)."""
    out: dict[str, tuple[int, int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            digest = ""
            if stat.S_ISREG(st.st_mode) and rel not in BACKUPS:
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[rel] = (st.st_mode, st.st_uid, st.st_gid, digest)
    return out


def _run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )


@pytest.fixture
def host_like_root(tmp_path: Path) -> Path:
    """A root that looks like a node's: account files, the usual /etc/systemd and tmpfiles.d."""
    root = tmp_path / "root-helper7"
    for d in ("etc/systemd/system", "etc/tmpfiles.d", "var/lib", "run", "usr/local/bin"):
        (root / d).mkdir(parents=True)
    for name in (*ACCOUNT_FILES, ".pwd.lock", "login.defs"):
        shutil.copy2(f"/etc/{name}", root / "etc" / name)
    for name in ACCOUNT_FILES:
        shutil.copy2(f"/etc/{name}", root / "etc" / f"{name}-")
    return root


def test_install_twice_is_idempotent_and_uninstall_leaves_nothing(host_like_root: Path) -> None:
    root = host_like_root
    before = _snapshot(root)

    first = _run(INSTALL, "--root", str(root), "--bin", str(BIN))
    assert first.returncode == 0, first.stderr + first.stdout
    after_first = _snapshot(root)
    second = _run(INSTALL, "--root", str(root), "--bin", str(BIN))
    assert second.returncode == 0, second.stderr + second.stdout
    assert _snapshot(root) == after_first
    assert "installed" not in second.stdout.replace("installed into", "")
    assert "Creating" not in second.stdout

    unit = (root / "etc/systemd/system/gpuwatchd.service").read_text()
    assert f"ExecStart={BIN} run --config.file /etc/gpuwatchd/config.yaml" in unit
    assert (root / "etc/gpuwatchd/config.yaml").read_text() == (ROOT / "config.example.yaml").read_text()
    ranks = (root / "run/gpuwatch/ranks").stat()
    assert stat.S_IMODE(ranks.st_mode) == 0o1777 and ranks.st_uid == 0
    entry = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("gpuwatchd:"))
    assert entry.endswith(":/var/lib/gpuwatchd:/usr/sbin/nologin")
    assert any(line.startswith("gpuwatchd:") for line in (root / "etc/group").read_text().splitlines())
    # The host's own users are untouched.
    assert (root / "etc/passwd").read_text().startswith(Path("/etc/passwd").read_text())
    assert "WARNING" not in first.stdout  # the copied /etc/group has systemd-journal

    # The daemon ran once and left state behind; uninstall removes that too.
    (root / "var/lib/gpuwatchd").mkdir()
    (root / "var/lib/gpuwatchd/state.json").write_text("{}")
    (root / "run/gpuwatch/ranks/job.0.json").write_text("{}")

    out = _run(UNINSTALL, "--root", str(root))
    assert out.returncode == 0, out.stderr + out.stdout
    assert _snapshot(root) == before
    again = _run(UNINSTALL, "--root", str(root))
    assert again.returncode == 0, again.stderr
    assert _snapshot(root) == before


def test_install_into_an_empty_root_and_uninstall_to_empty(tmp_path: Path) -> None:
    root = tmp_path / "empty-helper7"
    root.mkdir()
    out = _run(INSTALL, "--root", str(root), "--bin", str(BIN))
    assert out.returncode == 0, out.stderr
    # No systemd-journal group in an empty root: said loudly, since the unit needs it.
    assert "WARNING: group systemd-journal does not exist" in out.stdout
    assert (root / "etc/passwd").read_text().startswith("gpuwatchd:")
    out = _run(UNINSTALL, "--root", str(root))
    assert out.returncode == 0, out.stderr
    assert list(root.iterdir()) == []


def test_an_edited_config_survives_reinstall_and_keep_config(host_like_root: Path) -> None:
    root = host_like_root
    assert _run(INSTALL, "--root", str(root), "--bin", str(BIN)).returncode == 0
    cfg = root / "etc/gpuwatchd/config.yaml"
    cfg.write_text("interval_seconds: 10\n")
    out = _run(INSTALL, "--root", str(root), "--bin", str(BIN))
    assert out.returncode == 0 and "kept existing /etc/gpuwatchd/config.yaml" in out.stdout
    assert cfg.read_text() == "interval_seconds: 10\n"
    assert _run(UNINSTALL, "--root", str(root), "--keep-config").returncode == 0
    assert cfg.read_text() == "interval_seconds: 10\n"
    assert not (root / "etc/systemd/system/gpuwatchd.service").exists()
    assert "gpuwatchd:" not in (root / "etc/passwd").read_text()


def test_install_refuses_bad_arguments(tmp_path: Path) -> None:
    out = _run(INSTALL, "--root", str(tmp_path), "--bin", "relative/gpuwatchd")
    assert out.returncode == 2 and "absolute path" in out.stderr
    out = _run(INSTALL, "--root", str(tmp_path), "--bin", "/nonexistent/gpuwatchd")
    assert out.returncode == 2 and "not executable" in out.stderr
    out = _run(INSTALL, "--root", str(tmp_path / "missing"), "--bin", str(BIN))
    assert out.returncode == 2 and "not a directory" in out.stderr
    out = _run(INSTALL, "--frobnicate")
    assert out.returncode == 2 and "unknown option" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_installed_unit_verifies(host_like_root: Path) -> None:
    """The unit as installed (ExecStart rewritten to the real console script) is clean."""
    assert _run(INSTALL, "--root", str(host_like_root), "--bin", str(BIN)).returncode == 0
    unit = host_like_root / "etc/systemd/system/gpuwatchd.service"
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, cwd=unit.parent
    )
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
