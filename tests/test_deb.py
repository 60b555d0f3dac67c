"""The Debian package that deploy/debian/build.sh makes from the wheel (tests/distutil.py), read
with dpkg-deb on the host, without installing it: its control fields, files and conffile, the
maintainer scripts (debhelper's snippets, valid sh), md5sums, the unit as packaged, and the venv
it ships: relocated to /usr/lib/gpuwatchd (no path of the build directory left) and holding every
dependency itself, not borrowing one from the build host's Debian packages; lintian on it (no
error or warning beyond deploy/debian/lintian-overrides), its manual page and copyright file.
Installing, upgrading and purging it under a booted systemd: tests/test_systemd_boot.py; its
maintainer scripts against accounts that existed before it (dpkg in a chroot on an overlay of the
same Debian 12 root, so this host's accounts are never touched) here. Once built, lintian 30-40 s
and the three dpkg runs 11-20 s on the 2-core VM shared with other work.
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import bootsystemd
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
    # the venv's interpreter link is relative (../../../bin/python3.11): here it finds the
    # host's, as installed it finds the system's
    (out / "usr/bin/python3.11").symlink_to("/usr/bin/python3.11")
    yield out


def _field(deb: Path, name: str) -> str:
    return subprocess.run(
        ["dpkg-deb", "--field", str(deb), name], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_control_fields(deb: Path) -> None:
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    assert deb.name == f"gpuwatchd_{distutil.version()}_{arch}.deb"
    assert _field(deb, "Package") == "gpuwatchd"
    assert _field(deb, "Version") == distutil.version()
    assert _field(deb, "Architecture") == arch
    depends = {d.split()[0] for d in _field(deb, "Depends").split(", ")}
    # libc6 and libgcc-s1: the wheels' compiled extensions (dpkg-shlibdeps)
    assert {
        "python3.11",
        "python3-systemd",
        "libudev1",
        "systemd",
        "init-system-helpers",
        "passwd",
        "libc6",
        "libgcc-s1",
    } == depends


def test_files_owners_and_conffile(deb: Path, tree: Path) -> None:
    listing = subprocess.run(
        ["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert listing and all(line.split()[1] == "root/root" for line in listing), listing[:5]
    paths = {line.split()[5].lstrip(".").rstrip("/") for line in listing}
    for p in (
        "/lib/systemd/system/gpuwatchd.service",
        "/usr/lib/tmpfiles.d/gpuwatchd.conf",
        "/usr/lib/sysusers.d/gpuwatchd.conf",
        "/etc/gpuwatchd/config.yaml",
        "/usr/bin/gpuwatchd",
        f"/{VENV}/bin/gpuwatchd",
        f"/{VENV}/bin/py-spy",
        "/usr/share/doc/gpuwatchd/copyright",
    ):
        assert p in paths, p
    # Debian Policy 9.1.2: nothing in /opt or /usr/local (dpkg would also remove /opt on purge)
    assert not [p for p in paths if p.startswith(("/opt", "/usr/local", "/var", "/run", "/home"))]
    assert (tree / "DEBIAN/conffiles").read_text().split() == ["/etc/gpuwatchd/config.yaml"]
    assert (tree / "etc/gpuwatchd/config.yaml").read_text() == (ROOT / "config.example.yaml").read_text()
    res = subprocess.run(
        ["md5sum", "--check", "--quiet", str(tree / "DEBIAN/md5sums")], cwd=tree, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_unit_as_packaged(tree: Path) -> None:
    packaged = (tree / "lib/systemd/system/gpuwatchd.service").read_text()
    source = (ROOT / "systemd/gpuwatchd.service").read_text()
    assert packaged == source.replace("/usr/local/bin/gpuwatchd ", f"/{VENV}/bin/gpuwatchd ")
    assert f"ExecStart=/{VENV}/bin/gpuwatchd run --config.file /etc/gpuwatchd/config.yaml" in packaged
    for name in ("tmpfiles", "sysusers"):
        assert (tree / f"usr/lib/{name}.d/gpuwatchd.conf").read_text() == (
            ROOT / f"systemd/gpuwatchd.{name}.conf"
        ).read_text()


def test_maintainer_scripts_are_debhelpers_snippets(tree: Path) -> None:
    scripts = {s: (tree / "DEBIAN" / s).read_text() for s in ("preinst", "postinst", "prerm", "postrm")}
    for name, text in scripts.items():
        assert subprocess.run(["sh", "-n", str(tree / "DEBIAN" / name)]).returncode == 0, name
        assert "# Automatically added by dh_" in text and "#UNITFILE" not in text, name
    post = scripts["postinst"]
    order = [
        post.index(s)
        for s in ("systemd-sysusers", "systemd-tmpfiles", "deb-systemd-helper enable", "deb-systemd-invoke start")
    ]
    assert order == sorted(order), order
    assert "deb-systemd-invoke stop gpuwatchd.service" in scripts["preinst"]  # stop before an upgrade
    assert '"$1" = remove' in scripts["prerm"] and "deb-systemd-invoke stop" in scripts["prerm"]
    assert "deb-systemd-helper purge gpuwatchd.service" in scripts["postrm"]
    assert "userdel gpuwatchd" in scripts["postrm"]


def test_venv_is_relocated_and_holds_every_dependency(tree: Path) -> None:
    venv = tree / VENV
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg and "home = /usr/bin" in cfg, cfg
    assert (venv / "bin/python3").readlink() == Path("python3.11")
    # relative, inside /usr (lintian: absolute-symlink-in-top-level-folder)
    assert (venv / "bin/python3.11").readlink() == Path("../../../bin/python3.11")
    assert (venv / "bin/gpuwatchd").read_text().splitlines()[0] == f"#!/{VENV}/bin/python"
    # no file names where it was built
    leaked = subprocess.run(
        ["grep", "-rlIF", str(distutil.work_dir()), str(venv)], capture_output=True, text=True
    ).stdout.split()
    assert leaked == [], leaked
    assert not list(venv.glob("lib/python3.11/site-packages/pip")), "pip is left in the venv"
    # every dependency from the venv itself (a python3-yaml on the build host once satisfied
    # PyYAML and left it out: the package then failed on a node without python3-yaml)
    code = (
        "import gpuwatchd, yaml, h11, pyudev, pynvml, bcrypt\n"
        "for m in (gpuwatchd, yaml, h11, pyudev, pynvml, bcrypt): print(m.__file__)\n"
    )
    res = subprocess.run(
        [str(venv / "bin/python3"), "-c", code],
        capture_output=True,
        text=True,
        cwd=tree,
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert res.returncode == 0, res.stderr
    site = f"{venv}/lib/python3.11/site-packages/"
    outside = [f for f in res.stdout.split() if not f.startswith(site)]
    assert outside == [], outside
    # no byte code shipped: postinst compiles it where installed (test_maintainer_scripts_...)
    assert not list(venv.rglob("__pycache__")), list(venv.rglob("__pycache__"))[:3]


def test_lintian_reports_nothing_beyond_the_overrides(deb: Path) -> None:
    """lintian as Debian runs it: no error or warning tag the overrides file does not justify
    (was 27 error and 7 warning lines: byte code, unstripped binaries, no libc dependency, a
    copyright file naming Apache-2.0 only, no manual page)."""
    assert shutil.which("lintian"), "lintian is missing (scripts/test installs it)"
    res = subprocess.run(
        ["lintian", "--tag-display-limit", "0", "--fail-on", "error,warning", str(deb)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    tags = [ln for ln in res.stdout.splitlines() if re.match(r"[EW]: ", ln)]
    assert tags == [] and res.returncode == 0, (res.returncode, tags, res.stderr[-2000:])
    overrides = (ROOT / "deploy/debian/lintian-overrides").read_text().split("\n\n")[1:]
    for block in overrides:  # each override follows the comment that justifies it
        lines = block.strip().splitlines()
        assert (
            lines[-1].startswith("gpuwatchd: ") and len(lines) >= 2 and all(ln.startswith("# ") for ln in lines[:-1])
        ), block


def test_manual_page_has_every_subcommand(tree: Path) -> None:
    import gpuwatchd.cli

    page = gzip.decompress((tree / "usr/share/man/man1/gpuwatchd.1.gz").read_bytes()).decode()
    assert page.startswith(".TH GPUWATCHD 1 ") and f'"gpuwatchd {distutil.version()}"' in page
    parser = gpuwatchd.cli.build_parser()
    [sub] = [a for a in parser._actions if a.choices and a.dest == "command"]
    assert sub.choices
    for name in sub.choices:
        assert f'.SS "gpuwatchd {name}"'.replace("-", "\\-") in page, name
    rendered = subprocess.run(
        ["man", "--warnings", "-l", "-"],
        input=page,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "MANWIDTH": "100", "LC_ALL": "C.UTF-8"},
    )
    assert rendered.returncode == 0 and "--web.listen-address" in rendered.stdout.replace("\u2010", "-"), (
        rendered.stderr
    )
    assert rendered.stderr == "", rendered.stderr


def test_manual_page_says_what_each_exit_code_means(tree: Path) -> None:
    """man-pages(7)'s EXIT STATUS, from the CLI's own table (the --help epilog shows the same): the
    codes are the contract scripts rely on (docs/cli.md), and the page said none of them."""
    from gpuwatchd.cli.common import EXIT_MEANINGS

    page = gzip.decompress((tree / "usr/share/man/man1/gpuwatchd.1.gz").read_bytes()).decode()
    rendered = subprocess.run(
        ["man", "-l", "-"],
        input=page,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "MANWIDTH": "200", "LC_ALL": "C"},
        check=True,
    ).stdout
    section = rendered.split("\nEXIT STATUS\n", 1)[1].split("\nFILES\n", 1)[0]
    for code, meaning in EXIT_MEANINGS:
        assert re.search(rf"^ +{code} +{re.escape(meaning[:1].upper() + meaning[1:])}\.$", section, re.M), (
            code,
            section,
        )
    assert "exits 75" in section


def test_copyright_lists_every_distribution_in_the_venv(tree: Path) -> None:
    text = (tree / "usr/share/doc/gpuwatchd/copyright").read_text()
    assert text.startswith("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
    paragraphs = text.split("\n\n")
    dists = sorted(tree.glob(f"{VENV}/lib/python3.11/site-packages/*.dist-info"))
    assert len(dists) >= 7, dists
    for dist in dists:
        [para] = [p for p in paragraphs if f"/{dist.name}/*" in p.split("\n")[0]]
        license = re.search(r"^License: (.+)$", para, re.M)
        assert license, para
        # a license without its full text in /usr/share/common-licenses has it in the file
        assert re.search(rf"^License: {re.escape(license.group(1))}\n ", text, re.M), license.group(1)
    assert {"Expat", "LGPL-2.1+", "BSD-3-clause", "Apache-2.0"} <= set(re.findall(r"^License: (\S+)", text, re.M))
    assert "libyaml" in text and "Statically linked into it (py-spy" in text


def _in_a_chroot(deb: Path, script: str) -> dict[str, str]:
    """``script`` (sh -e) run as root by chroot in a private overlay of the booted-systemd test's
    Debian 12 root (nothing reaches the cached root, nor this host's accounts), with the package at
    /tmp/gpuwatchd.deb. No systemd runs there, so postinst enables the unit without starting it,
    as in an image build. Returns the ``KEY=value`` lines it printed."""
    rootfs = bootsystemd.cached_rootfs()
    work = Path(tempfile.mkdtemp(prefix="gwdeb-chroot-", dir="/var/tmp"))
    try:
        for d in ("upper", "work", "root"):
            (work / d).mkdir()
        (work / "script").write_text(script)
        outer = (
            f"set -e; mount -t overlay gwdeb -o lowerdir={rootfs},upperdir={work}/upper,"
            f"workdir={work}/work {work}/root; mount -t proc proc {work}/root/proc; "
            f"mount -t tmpfs gwdeb-run {work}/root/run; cp {deb} {work}/root/tmp/gpuwatchd.deb; "
            f"cp {work}/script {work}/root/tmp/script; exec chroot {work}/root /bin/sh -e /tmp/script"
        )
        res = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "sh", "-c", outer],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": bootsystemd.PATH, "LC_ALL": "C"},
        )
        assert res.returncode == 0, (res.returncode, res.stdout[-3000:], res.stderr[-3000:])
        return dict(ln.split("=", 1) for ln in res.stdout.splitlines() if re.match(r"[A-Z_]+=", ln))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_maintainer_scripts_make_and_purge_only_their_own_account_and_state(deb: Path) -> None:
    """dpkg runs the package's maintainer scripts three times, on three systems:
    - a login account named gpuwatchd exists: the install stops in preinst, naming it, with nothing
      unpacked, and a purge leaves the account and its home alone (it adopted the account, and
      purge deleted it with its group and home, before);
    - a system account gpuwatchd and a /var/lib/gpuwatchd made by someone else exist: the package
      runs as that account, and purge keeps both;
    - neither exists: the package makes both, compiles its byte code (checked by hash), and purge
      removes the user, the group, the state directory and its own record, and nothing else."""
    login = _in_a_chroot(
        deb,
        """
useradd --create-home --home-dir /home/gpuwatchd --shell /bin/bash --uid 1500 gpuwatchd
echo mine > /home/gpuwatchd/notes
if dpkg -i /tmp/gpuwatchd.deb > /tmp/out 2>&1; then echo INSTALL=ok; else echo INSTALL=failed; fi
echo "SAID=$(grep -m1 'gpuwatchd: the account gpuwatchd exists' /tmp/out || true)"
echo "STATUS=$(dpkg-query -W -f '${db:Status-Abbrev}' gpuwatchd 2>/dev/null || echo none)"
echo "VENV=$(test -e /usr/lib/gpuwatchd && echo present || echo absent)"
dpkg --purge gpuwatchd > /dev/null 2>&1 || true
echo "ACCOUNT=$(getent passwd gpuwatchd)"
echo "GROUP=$(getent group gpuwatchd | cut -d: -f1)"
echo "NOTES=$(cat /home/gpuwatchd/notes)"
""",
    )
    assert login["INSTALL"] == "failed", login
    assert "(uid 1500, shell /bin/bash) and is not a system account" in login["SAID"], login
    # not installed (dpkg-query's second letter; "in": install was asked), nothing unpacked
    assert (login["STATUS"] == "none" or login["STATUS"][1:2] == "n") and login["VENV"] == "absent", login
    assert login["ACCOUNT"] == "gpuwatchd:x:1500:1500::/home/gpuwatchd:/bin/bash", login
    assert login["GROUP"] == "gpuwatchd" and login["NOTES"] == "mine", login

    theirs = _in_a_chroot(
        deb,
        """
useradd --system --no-create-home --home-dir /var/lib/gpuwatchd --shell /usr/sbin/nologin gpuwatchd
mkdir -p /var/lib/gpuwatchd && echo theirs > /var/lib/gpuwatchd/kept
before=$(getent passwd gpuwatchd)
dpkg -i /tmp/gpuwatchd.deb > /tmp/out 2>&1 || { cat /tmp/out; exit 1; }
echo "SAME_ACCOUNT=$([ "$(getent passwd gpuwatchd)" = "$before" ] && echo yes || echo no)"
echo "RECORD=$(tr '\n' ' ' < /var/lib/gpuwatchd-package/created)"
dpkg --purge gpuwatchd > /tmp/out 2>&1 || { cat /tmp/out; exit 1; }
echo "ACCOUNT=$(getent passwd gpuwatchd | cut -d: -f1,7)"
echo "GROUP=$(getent group gpuwatchd | cut -d: -f1)"
echo "KEPT=$(cat /var/lib/gpuwatchd/kept)"
echo "RECORD_AFTER=$(test -e /var/lib/gpuwatchd-package && echo present || echo absent)"
""",
    )
    assert theirs["SAME_ACCOUNT"] == "yes" and theirs["RECORD"].strip() == "", theirs
    assert theirs["ACCOUNT"] == "gpuwatchd:/usr/sbin/nologin" and theirs["GROUP"] == "gpuwatchd", theirs
    assert theirs["KEPT"] == "theirs" and theirs["RECORD_AFTER"] == "absent", theirs

    fresh = _in_a_chroot(
        deb,
        """
find / -xdev -path /proc -prune -o -path /tmp -prune -o -path /var/lib/dpkg -prune -o -path /var/log -prune \
    -o -path /var/cache -prune -o -print | sort > /tmp/before
dpkg -i /tmp/gpuwatchd.deb > /tmp/out 2>&1 || { cat /tmp/out; exit 1; }
echo "ACCOUNT=$(getent passwd gpuwatchd | cut -d: -f1,6,7)"
echo "UID=$(id -u gpuwatchd)"
echo "RECORD=$(tr '\n' ' ' < /var/lib/gpuwatchd-package/created)"
pyc=$(ls /usr/lib/gpuwatchd/lib/python3.11/site-packages/gpuwatchd/__pycache__/__init__.cpython-311.pyc)
echo "PYC_FLAGS=$(od -An -tu1 -j4 -N1 "$pyc" | tr -d ' ')"
install -d -o gpuwatchd -g gpuwatchd -m 0750 /var/lib/gpuwatchd   # as the unit's StateDirectory=
echo counters > /var/lib/gpuwatchd/state.json
dpkg --purge gpuwatchd > /tmp/out 2>&1 || { cat /tmp/out; exit 1; }
echo "ACCOUNT_AFTER=$(getent passwd gpuwatchd || true)"
echo "GROUP_AFTER=$(getent group gpuwatchd || true)"
echo "BACKUPS=$(grep -l '^gpuwatchd:' /etc/passwd- /etc/group- /etc/shadow- /etc/gshadow- 2>/dev/null || true)"
find / -xdev -path /proc -prune -o -path /tmp -prune -o -path /var/lib/dpkg -prune -o -path /var/log -prune \
    -o -path /var/cache -prune -o -print | sort > /tmp/after
echo "CHANGED=$(diff /tmp/before /tmp/after | grep '^[<>]' | tr '\n' ' ' || true)"
""",
    )
    assert fresh["ACCOUNT"] == "gpuwatchd:/var/lib/gpuwatchd:/usr/sbin/nologin" and int(fresh["UID"]) < 1000, fresh
    assert fresh["RECORD"].split() == ["user", "group", "state"], fresh
    assert fresh["PYC_FLAGS"] == "3", fresh  # hash-based, checked: never rewritten at run time
    assert fresh["ACCOUNT_AFTER"] == "" and fresh["GROUP_AFTER"] == "" and fresh["BACKUPS"] == "", fresh
    assert fresh["CHANGED"].strip() == "", fresh
