#!/bin/bash
# Build gpuwatchd_VERSION_ARCH.deb from a built wheel, with Debian's own tools (dpkg-deb).
#
#   python3 -m build --wheel --outdir dist .          # or: pip wheel --no-deps -w dist .
#   deploy/debian/build.sh --wheel dist/gpuwatchd-*.whl --out dist
#   apt-get install ./dist/gpuwatchd_*.deb
#
# What is in the package, and why a venv rather than python3-* dependencies:
# docs/packaging.md. In short: a venv in /usr/lib/gpuwatchd made with Debian's own python3.11
# (deploy/venv.sh; it sees Debian's python3-systemd), holding gpuwatchd's wheel and the wheels
# of its dependencies (py-spy and nvidia-ml-py are not in Debian); the unit, tmpfiles.d and
# sysusers.d files from systemd/; /etc/gpuwatchd/config.yaml as a conffile; maintainer scripts
# holding debhelper's own dh_installsysusers, dh_installtmpfiles and dh_installsystemd snippets
# (deploy/debian/{preinst,postinst,prerm,postrm}). lintian-clean (tests/test_deb.py runs it): no
# byte code shipped (postinst compiles it, prerm removes it), the wheels' binaries stripped
# (deploy/venv.sh), Depends from dpkg-shlibdeps, gpuwatchd(1) generated from the CLI's parser
# (deploy/debian/manpage.py), a DEP-5 copyright file listing every distribution the venv holds
# from its metadata (deploy/debian/copyright.py), and deploy/debian/lintian-overrides for the
# deliberate rest, each with its reason.
#
# Options:
#   --wheel FILE       gpuwatchd's wheel (required)
#   --find-links DIR   take the dependencies' wheels from DIR only (no index: offline builds, CI)
#   --out DIR          where the .deb goes (default: the current directory)
#   --python PATH      the Debian interpreter the venv is made with (default /usr/bin/python3)
# Prints the path of the .deb on its last line. Needs dpkg-dev (dpkg-deb, dpkg-shlibdeps),
# binutils (strip) and python3-venv; not root (dpkg-deb --root-owner-group).
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEEL= LINKS= OUT=. PY=/usr/bin/python3
die() { echo "deploy/debian/build.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) WHEEL=${2:?}; shift 2 ;;
        --find-links) LINKS=${2:?}; shift 2 ;;
        --out) OUT=${2:?}; shift 2 ;;
        --python) PY=${2:?}; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[ -f "$WHEEL" ] || die "--wheel FILE is required (build one with: python3 -m build --wheel)"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found (apt-get install dpkg-dev)"
WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)

# The wheel's version (PEP 440) as a Debian version: pre-releases sort before the release
# (0.2.0rc1 -> 0.2.0~rc1), a local version after it (0.1.0+1 stays 0.1.0+1).
PEP440=$(basename "$WHEEL" | cut -d- -f2)
VERSION=$(echo "$PEP440" | sed -E 's/^([0-9.]+)\.?((a|b|rc|dev)[0-9]*)/\1~\2/')
ARCH=$(dpkg --print-architecture)

DEST=/usr/lib/gpuwatchd
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
P="$TMP/debian/gpuwatchd"  # where dpkg-shlibdeps expects a package's files
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(stat -c %Y "$WHEEL")}

# 1. the venv (deploy/venv.sh: the same files as in the image, less the byte code)
PYVER=$(bash "$SRC/deploy/venv.sh" --wheel "$WHEEL" ${LINKS:+--find-links "$LINKS"} --python "$PY" \
    --root "$P" --no-byte-code)
SITE="$P$DEST/lib/python$PYVER/site-packages"

# 2. the systemd files, with the unit pointing at the venv's console script
install -d "$P/lib/systemd/system" "$P/usr/lib/tmpfiles.d" "$P/usr/lib/sysusers.d" "$P/usr/bin" \
    "$P/etc/gpuwatchd" "$P/usr/share/doc/gpuwatchd" "$P/usr/share/man/man1" \
    "$P/usr/share/lintian/overrides" "$P/DEBIAN"
sed -e "s#^ExecStart=/usr/local/bin/gpuwatchd #ExecStart=$DEST/bin/gpuwatchd #" \
    -e "s#^ExecReload=/usr/local/bin/gpuwatchd #ExecReload=$DEST/bin/gpuwatchd #" \
    "$SRC/systemd/gpuwatchd.service" > "$P/lib/systemd/system/gpuwatchd.service"
grep -q "^ExecStart=$DEST/bin/gpuwatchd run " "$P/lib/systemd/system/gpuwatchd.service" \
    || die "could not set ExecStart"
install -m 0644 "$SRC/systemd/gpuwatchd.tmpfiles.conf" "$P/usr/lib/tmpfiles.d/gpuwatchd.conf"
install -m 0644 "$SRC/systemd/gpuwatchd.sysusers.conf" "$P/usr/lib/sysusers.d/gpuwatchd.conf"
install -m 0644 "$SRC/config.example.yaml" "$P/etc/gpuwatchd/config.yaml"
ln -s "../lib/gpuwatchd/bin/gpuwatchd" "$P/usr/bin/gpuwatchd"
"$PY" "$SRC/deploy/debian/copyright.py" "$P$DEST" > "$P/usr/share/doc/gpuwatchd/copyright"
# the manual page from the CLI's parser, importing the venv's gpuwatchd (no byte code written)
PYTHONPATH="$SITE" PYTHONDONTWRITEBYTECODE=1 "$PY" -S "$SRC/deploy/debian/manpage.py" \
    | gzip -9n > "$P/usr/share/man/man1/gpuwatchd.1.gz"
install -m 0644 "$SRC/deploy/debian/lintian-overrides" "$P/usr/share/lintian/overrides/gpuwatchd"
printf 'gpuwatchd (%s) unstable; urgency=medium\n\n  * Built from the wheel %s.\n\n -- gpuwatchd maintainers <maintainers@gpuwatchd.invalid>  %s\n' \
    "$VERSION" "$(basename "$WHEEL")" "$(date -R -d "@$(stat -c %Y "$WHEEL")")" \
    | gzip -9n > "$P/usr/share/doc/gpuwatchd/changelog.gz"

# 3. control files
for s in preinst postinst prerm postrm; do
    install -m 0755 "$SRC/deploy/debian/$s" "$P/DEBIAN/$s"
done
echo /etc/gpuwatchd/config.yaml > "$P/DEBIAN/conffiles"
(cd "$P" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z \
    | xargs -0 md5sum) > "$P/DEBIAN/md5sums"
# the libraries the wheels' binaries link (libc6, libgcc-s1), as dh_shlibdeps finds them
printf 'Source: gpuwatchd\n\nPackage: gpuwatchd\nArchitecture: any\n' > "$TMP/debian/control"
SHLIBS=$(cd "$TMP" && find "debian/gpuwatchd$DEST" -type f \( -name '*.so' -o -perm -u+x \) \
    -exec sh -c 'head -c 4 "$1" | grep -q ELF' _ {} \; -print | sort | sed 's/^/-e/' \
    | xargs dpkg-shlibdeps -O 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$SHLIBS" ] || die "dpkg-shlibdeps found no library dependency"
cat > "$P/DEBIAN/control" <<CONTROL
Package: gpuwatchd
Version: $VERSION
Architecture: $ARCH
Maintainer: gpuwatchd maintainers <maintainers@gpuwatchd.invalid>
Installed-Size: $(du -sk --exclude=DEBIAN "$P" | cut -f1)
Depends: python$PYVER, python3-systemd, libudev1, systemd (>= 247), init-system-helpers (>= 1.54~), passwd, $SHLIBS
Section: admin
Priority: optional
Homepage: https://github.com/gpuwatchd/gpuwatchd
Description: per-node monitor of GPU training ranks for Prometheus
 gpuwatchd joins NVML, /proc, the kernel log and py-spy evidence by (job, rank):
 GPU memory per rank, OOM kills, the GIL, stalled and dead ranks, stale
 processes on GPU memory. It runs as the hardened systemd unit gpuwatchd.service
 (its own system user, three capabilities) and serves /metrics on port 9863.
 .
 A Python $PYVER venv in $DEST holds gpuwatchd $PEP440 and the
 wheels of its dependencies.
CONTROL
deb="$OUT/gpuwatchd_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zxz -z6 --build "$P" "$deb" >/dev/null
echo "$deb"
