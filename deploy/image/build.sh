#!/bin/bash
# Build the DaemonSet's image (deploy/kubernetes/daemonset.yaml) from Debian packages and
# gpuwatchd's wheel only: a Debian 12 root made by mmdebstrap, the venv /usr/lib/gpuwatchd that the
# Debian package holds too (deploy/venv.sh), imported with podman. No base image of any registry.
#
#   python3 -m build --wheel --outdir dist .
#   deploy/image/build.sh --wheel dist/gpuwatchd-*.whl          # -> ghcr.io/gpuwatchd/gpuwatchd:VERSION
#   podman push ghcr.io/gpuwatchd/gpuwatchd:VERSION docker://REGISTRY/gpuwatchd:VERSION
#
# The image: ENTRYPOINT /usr/lib/gpuwatchd/bin/gpuwatchd, CMD run --config.file
# /etc/gpuwatchd/config.yaml (the DaemonSet's args), python3 on PATH (its init container), uid 0
# (the DaemonSet drops every capability but three: deploy/kubernetes/README.md). Its packages:
# Debian's essential set plus python3, python3-systemd (the host journal) and libudev1.
# tests/test_image.py builds it and runs it under the DaemonSet's security context.
#
# Options:
#   --wheel FILE       gpuwatchd's wheel (required unless --base-only)
#   --find-links DIR   the dependencies' wheels from DIR only (no index)
#   --tag NAME         image name (default ghcr.io/gpuwatchd/gpuwatchd:VERSION, "+" as "-")
#   --base TAR         reuse a root made by --base-only (the same recipe) instead of mmdebstrap
#   --base-only TAR    only make the Debian root (mmdebstrap) into TAR, and stop
#   --mirror URL       Debian mirror for mmdebstrap (default: mmdebstrap's, from the host's apt)
# Environment: PODMAN (default "podman"; e.g. "podman --root DIR" for a private store),
# SOURCE_DATE_EPOCH (file times of the root; default: the wheel's mtime).
# Needs root (mmdebstrap, podman), mmdebstrap, podman, python3-venv of the same Debian release.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SUITE=bookworm
PACKAGES=python3,python3-systemd,libudev1
WHEEL= LINKS= TAG= BASE= BASE_ONLY= MIRROR=
PODMAN=${PODMAN:-podman}
die() { echo "deploy/image/build.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) WHEEL=${2:?}; shift 2 ;;
        --find-links) LINKS=${2:?}; shift 2 ;;
        --tag) TAG=${2:?}; shift 2 ;;
        --base) BASE=${2:?}; shift 2 ;;
        --base-only) BASE_ONLY=${2:?}; shift 2 ;;
        --mirror) MIRROR=${2:?}; shift 2 ;;
        -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

make_base() {  # the Debian root, as a tar; nothing of gpuwatchd in it
    command -v mmdebstrap >/dev/null || die "mmdebstrap not found (apt-get install mmdebstrap)"
    # no docs, man pages or locales (--dpkgopt): nothing runs them; apt's lists and caches go too
    mmdebstrap --quiet --variant=essential --include="$PACKAGES" --format=tar \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -f "$1"/etc/machine-id "$1"/etc/hostname "$1"/etc/resolv.conf' \
        --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
        "$SUITE" "$1" ${MIRROR:+"$MIRROR"}
}

if [ -n "$BASE_ONLY" ]; then
    make_base "$BASE_ONLY"
    exit 0
fi

[ -f "$WHEEL" ] || die "--wheel FILE is required (build one with: python3 -m build --wheel)"
PEP440=$(basename "$WHEEL" | cut -d- -f2)
TAG=${TAG:-ghcr.io/gpuwatchd/gpuwatchd:${PEP440//+/-}}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(stat -c %Y "$WHEEL")}

if [ -z "$BASE" ]; then
    make_base "$TMP/base.tar"
    BASE="$TMP/base.tar"
fi
# the venv is made with this host's python3 for the image's: the same Debian release, checked
tar -tf "$BASE" ./usr/bin/python3.11 >/dev/null 2>&1 || die "the root has no /usr/bin/python3.11"
[ -x /usr/bin/python3.11 ] || die "this host has no /usr/bin/python3.11 (build on Debian 12)"

S="$TMP/stage"
bash "$SRC/deploy/venv.sh" --wheel "$WHEEL" ${LINKS:+--find-links "$LINKS"} \
    --python /usr/bin/python3.11 --root "$S" >/dev/null
install -d -m 0755 "$S/etc/gpuwatchd" "$S/run/gpuwatch" "$S/var/lib/gpuwatchd"
install -d -m 1777 "$S/run/gpuwatch/ranks"
install -m 0644 "$SRC/config.example.yaml" "$S/etc/gpuwatchd/config.yaml"
cp "$BASE" "$TMP/image.tar"
tar -C "$S" --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
    -rf "$TMP/image.tar" ./usr/lib/gpuwatchd ./etc/gpuwatchd ./run/gpuwatch ./var/lib/gpuwatchd

$PODMAN import --quiet \
    --change 'ENTRYPOINT ["/usr/lib/gpuwatchd/bin/gpuwatchd"]' \
    --change 'CMD ["run", "--config.file", "/etc/gpuwatchd/config.yaml"]' \
    --change 'ENV PATH=/usr/lib/gpuwatchd/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'EXPOSE 9863/tcp' \
    --change "LABEL org.opencontainers.image.title=gpuwatchd" \
    --change "LABEL org.opencontainers.image.version=$PEP440" \
    --change "LABEL org.opencontainers.image.licenses=Apache-2.0" \
    --change "LABEL org.opencontainers.image.source=https://github.com/gpuwatchd/gpuwatchd" \
    "$TMP/image.tar" "$TAG" >/dev/null
echo "$TAG"
