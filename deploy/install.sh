#!/bin/bash
# Install gpuwatchd as a systemd service on a node that is not Debian 12 (there: apt-get install
# ./gpuwatchd_*.deb, docs/packaging.md). Run as root after installing the built wheel into a venv:
#
#   python3 -m build --wheel --outdir dist .       # the wheel (no package index holds it)
#   python3 -m venv /opt/gpuwatchd && /opt/gpuwatchd/bin/pip install dist/gpuwatchd-*.whl
#   deploy/install.sh --bin /opt/gpuwatchd/bin/gpuwatchd
#
# Installs the hardened unit (systemd/gpuwatchd.service, ExecStart pointed at the installed
# console script), the sysusers.d entry and the `gpuwatchd` system user, the tmpfiles.d entry and
# the rank directory /run/gpuwatch/ranks (1777), and /etc/gpuwatchd/config.yaml from
# config.example.yaml when no config exists. Running it again changes nothing that is already in
# place (an edited config is never overwritten); the service is restarted only when the unit
# changed. deploy/uninstall.sh removes all of it.
#
# Verified under a booted systemd 252 (Debian 12) by tests/test_systemd_boot.py, as a new user
# runs it; what is verified where, and what is not: docs/security.md section 8.
#
# Options:
#   --root DIR   install into DIR instead of / (images, tests); never touches the running system
#   --bin PATH   the gpuwatchd executable (default: `command -v gpuwatchd`)
#   --no-start   do not enable/start the service
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=/
BIN=
START=1

die() { echo "install.sh: $*" >&2; exit 2; }
say() { echo "gpuwatchd install: $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=${2:?--root needs a directory}; shift 2 ;;
        --root=*) ROOT=${1#--root=}; shift ;;
        --bin) BIN=${2:?--bin needs a path}; shift 2 ;;
        --bin=*) BIN=${1#--bin=}; shift ;;
        --no-start) START=0; shift ;;
        -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

[ -d "$ROOT" ] || die "--root $ROOT is not a directory"
ROOT=$(cd "$ROOT" && pwd)
R=${ROOT%/}  # "" for the real root, so "$R/etc" is always right
if [ -z "$R" ] && [ "$(id -u)" != 0 ]; then
    die "run as root (or use --root DIR)"
fi
for f in systemd/gpuwatchd.service systemd/gpuwatchd.tmpfiles.conf \
         systemd/gpuwatchd.sysusers.conf config.example.yaml; do
    [ -f "$SRC/$f" ] || die "missing $SRC/$f (run from a gpuwatchd source tree)"
done

if [ -z "$BIN" ]; then
    BIN=$(command -v gpuwatchd || true)
    [ -n "$BIN" ] || die "gpuwatchd is not on PATH: pip install the built wheel first, or pass --bin PATH"
fi
case "$BIN" in /*) ;; *) die "--bin must be an absolute path, got $BIN" ;; esac
[ -x "$R$BIN" ] || [ -x "$BIN" ] || die "$BIN is not executable"

MANIFEST_DIR="$R/etc/gpuwatchd"
MANIFEST="$MANIFEST_DIR/.install-manifest"
CHANGED=0

# Directories and files this script creates where nothing was before are remembered, so that
# uninstall.sh removes exactly those and never something that was there before (e.g.
# /etc/tmpfiles.d, /etc/passwd).
CREATED=()
note_missing_dirs() {
    local p=$1
    while [ ! -d "$p" ]; do
        CREATED+=("dir ${p#"$R"}")
        p=$(dirname "$p")
    done
}
make_dir() {
    [ -d "$1" ] && return 0
    note_missing_dirs "$1"
    install -d -m 0755 "$1"
}

put() {  # put MODE SOURCE DEST: install when absent or different
    local mode=$1 src=$2 dest=$3
    if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
        say "unchanged ${dest#"$R"}"
        return 0
    fi
    make_dir "$(dirname "$dest")"
    install -m "$mode" "$src" "$dest.tmp.$$"
    mv -f "$dest.tmp.$$" "$dest"
    say "installed ${dest#"$R"}"
    CHANGED=1
}

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# 1. unit, with ExecStart and ExecReload pointing at the installed console script
sed -e "s#^ExecStart=/usr/local/bin/gpuwatchd #ExecStart=$BIN #" \
    -e "s#^ExecReload=/usr/local/bin/gpuwatchd #ExecReload=$BIN #" \
    "$SRC/systemd/gpuwatchd.service" > "$TMP/gpuwatchd.service"
grep -q "^ExecStart=$BIN run " "$TMP/gpuwatchd.service" || die "could not set ExecStart"
grep -q "^ExecReload=$BIN config check " "$TMP/gpuwatchd.service" || die "could not set ExecReload"
put 0644 "$TMP/gpuwatchd.service" "$R/etc/systemd/system/gpuwatchd.service"
UNIT_CHANGED=$CHANGED
put 0644 "$SRC/systemd/gpuwatchd.tmpfiles.conf" "$R/etc/tmpfiles.d/gpuwatchd.conf"
put 0644 "$SRC/systemd/gpuwatchd.sysusers.conf" "$R/etc/sysusers.d/gpuwatchd.conf"

# 2. config: never overwrite an existing one
if [ -e "$R/etc/gpuwatchd/config.yaml" ]; then
    say "kept existing /etc/gpuwatchd/config.yaml"
else
    put 0644 "$SRC/config.example.yaml" "$R/etc/gpuwatchd/config.yaml"
fi

# 3. system user (sysusers.d does nothing when it exists)
make_dir "$R/etc"
for f in passwd group shadow gshadow .pwd.lock; do
    [ -e "$R/etc/$f" ] || CREATED+=("file /etc/$f")
done
if command -v systemd-sysusers >/dev/null; then
    systemd-sysusers --root="$ROOT" "$R/etc/sysusers.d/gpuwatchd.conf" 2>&1 \
        | sed 's/^/gpuwatchd install: /'
elif ! grep -q '^gpuwatchd:' "$R/etc/passwd" 2>/dev/null; then
    useradd --root "$ROOT" --system --no-create-home --home-dir /var/lib/gpuwatchd \
        --shell /usr/sbin/nologin --user-group gpuwatchd
    say "created user gpuwatchd"
fi
grep -q '^systemd-journal:' "$R/etc/group" 2>/dev/null || \
    say "WARNING: group systemd-journal does not exist; the unit's SupplementaryGroups= will" \
        "fail. Create it or remove that line with 'systemctl edit gpuwatchd'."

# 4. rank directory
note_missing_dirs "$R/run/gpuwatch/ranks"
if command -v systemd-tmpfiles >/dev/null; then
    systemd-tmpfiles --root="$ROOT" --create "$R/etc/tmpfiles.d/gpuwatchd.conf"
else
    install -d -m 0755 "$R/run/gpuwatch"
    install -d -m 1777 "$R/run/gpuwatch/ranks"
fi

# 5. remember what was created (merged with an earlier run's list)
if [ ${#CREATED[@]} -gt 0 ]; then
    make_dir "$MANIFEST_DIR"
    { if [ -f "$MANIFEST" ]; then cat "$MANIFEST"; fi; printf '%s\n' "${CREATED[@]}"; } \
        | sort -u > "$TMP/manifest"
    if ! cmp -s "$TMP/manifest" "$MANIFEST"; then
        install -m 0644 "$TMP/manifest" "$MANIFEST"
    fi
fi

# 6. start (only on the live system, and only when systemd runs it)
if [ -n "$R" ]; then
    say "installed into $ROOT; nothing started"
elif [ ! -d /run/systemd/system ]; then
    say "systemd is not running here; start later with: systemctl enable --now gpuwatchd"
else
    systemctl daemon-reload
    if [ "$START" = 1 ]; then
        systemctl enable gpuwatchd.service
        if [ "$UNIT_CHANGED" = 1 ] && systemctl is-active --quiet gpuwatchd.service; then
            systemctl restart gpuwatchd.service
        else
            systemctl start gpuwatchd.service
        fi
        say "running: systemctl status gpuwatchd; curl -s localhost:9863/metrics | head"
    fi
fi
