#!/bin/bash
# Build the DaemonSet's image (deploy/kubernetes/daemonset.yaml) from the Containerfile, with
# podman, reproducibly: the labels' version, revision and creation
# time, SOURCE_DATE_EPOCH, and --timestamp, so the same inputs give the same layers.
#
#   deploy/image/build.sh                                  # -> localhost/gpuwatchd:VERSION
#   podman push localhost/gpuwatchd:VERSION docker://REGISTRY/gpuwatchd:VERSION
#   deploy/image/build.sh --platform linux/arm64           # GH200/GB200 nodes (QEMU binfmt on amd64)
#
# The Containerfile builds FROM docker.io/library/debian:12-slim; --local-base builds FROM a
# Debian 12 root made here by mmdebstrap instead (root, no registry: CI and air-gapped hosts).
# The build context is a copy of the source tree (no .git, .venv or build output).
#
# Options:
#   --tag NAME         image name (default localhost/gpuwatchd:VERSION, "+" as "-")
#   --platform P       the image's platform (default: this host's)
#   --find-links DIR   setuptools' and the dependencies' wheels from DIR only (no index)
#   --local-base       make the Debian 12 root with mmdebstrap and build FROM it
#   --base TAR         build FROM a root made by --base-only (the same recipe)
#   --base-only TAR    only make the Debian root (mmdebstrap) into TAR, and stop
#   --mirror URL       Debian mirror for mmdebstrap (default: mmdebstrap's, from the host's apt)
#   -- ARGS            further arguments of `podman build` (e.g. --no-cache)
# Environment: PODMAN (default "podman"; e.g. "podman --root DIR" for a private store),
# SOURCE_DATE_EPOCH (default: the last commit's time, else gpuwatchd/__init__.py's mtime).
# Prints the image's name on its last line. Needs podman (or buildah); mmdebstrap and root for
# --local-base / --base-only.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SUITE=bookworm
# the root both stages build from: the builder's packages and the final stage's
PACKAGES=python3,python3-venv,python3-systemd,libudev1,binutils
TAG= PLATFORM= LINKS= LOCAL_BASE= BASE= BASE_ONLY= MIRROR=
EXTRA=()
PODMAN=${PODMAN:-podman}
die() { echo "deploy/image/build.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG=${2:?}; shift 2 ;;
        --platform) PLATFORM=${2:?}; shift 2 ;;
        --find-links) LINKS=${2:?}; shift 2 ;;
        --local-base) LOCAL_BASE=1; shift ;;
        --base) BASE=${2:?}; shift 2 ;;
        --base-only) BASE_ONLY=${2:?}; shift 2 ;;
        --mirror) MIRROR=${2:?}; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

make_base() {  # the Debian root, as a tar; nothing of gpuwatchd in it
    command -v mmdebstrap >/dev/null || die "mmdebstrap not found (apt-get install mmdebstrap)"
    # no docs but the copyright files, no man pages or locales (--dpkgopt): nothing runs them;
    # apt's lists and caches go too
    mmdebstrap --quiet --variant=essential --include="$PACKAGES" --format=tar \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -f "$1"/etc/machine-id "$1"/etc/hostname "$1"/etc/resolv.conf' \
        --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
        ${PLATFORM:+--architectures="${PLATFORM#linux/}"} "$SUITE" "$1" ${MIRROR:+"$MIRROR"}
}

if [ -n "$BASE_ONLY" ]; then
    make_base "$BASE_ONLY"
    exit 0
fi

VERSION=$(sed -n 's/^__version__ = "\([^"]*\)"$/\1/p' "$SRC/gpuwatchd/__init__.py")
[ -n "$VERSION" ] || die "no __version__ in gpuwatchd/__init__.py"
TAG=${TAG:-localhost/gpuwatchd:${VERSION//+/-}}
REVISION=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
    SOURCE_DATE_EPOCH=$(git -C "$SRC" log -1 --format=%ct 2>/dev/null || stat -c %Y "$SRC/gpuwatchd/__init__.py")
fi
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)

CTX="$TMP/context"
mkdir "$CTX"
tar -C "$SRC" --exclude-vcs --exclude='./.venv*' --exclude='__pycache__' --exclude='*.egg-info' \
    --exclude=./build --exclude=./dist --exclude=./.mypy_cache --exclude=./.ruff_cache \
    --exclude=./.pytest_cache -cf - . | tar -C "$CTX" -xf -
args=(--timestamp "$SOURCE_DATE_EPOCH" --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH"
      --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" --build-arg "CREATED=$CREATED")
if [ -n "$LINKS" ]; then
    mkdir "$CTX/.wheelhouse"
    cp "$LINKS"/*.whl "$CTX/.wheelhouse/"
    args+=(--build-arg WHEELHOUSE=.wheelhouse)
fi
if [ -n "$LOCAL_BASE" ] && [ -z "$BASE" ]; then
    make_base "$TMP/base.tar"
    BASE="$TMP/base.tar"
fi
if [ -n "$BASE" ]; then
    # one root for both stages; its name is the tar's digest, so a new root is a new name
    name="localhost/gpuwatchd-base:$(sha256sum "$BASE" | cut -c1-16)"
    $PODMAN image exists "$name" 2>/dev/null || $PODMAN import --quiet "$BASE" "$name" >/dev/null
    args+=(--build-arg "BASE=$name" --build-arg "BUILDER_BASE=$name")
fi
# with the wheels and the root given, nothing is fetched: the build runs without a network
if [ -n "$LINKS" ] && [ -n "$BASE" ]; then args+=(--network=none); fi
$PODMAN build ${PLATFORM:+--platform "$PLATFORM"} "${args[@]}" -t "$TAG" \
    -f "$CTX/Containerfile" "${EXTRA[@]}" "$CTX" >&2
echo "$TAG"
