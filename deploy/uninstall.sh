#!/bin/bash
# Remove everything deploy/install.sh put on this node: the service (stopped and disabled), unit,
# tmpfiles.d and sysusers.d entries, the gpuwatchd user and group, /etc/gpuwatchd, the rank
# directory /run/gpuwatch and the state directory /var/lib/gpuwatchd, and the directories and
# account files install.sh created where nothing was before (its manifest). The Python package
# itself stays: `pip uninstall gpuwatchd` removes it.
#
# Verified under a booted systemd 252 (Debian 12) by tests/test_systemd_boot.py, as a new user
# runs it; what is verified where, and what is not: docs/security.md section 8.
#
# Options:
#   --root DIR      uninstall from DIR instead of / (images, tests)
#   --keep-config   keep /etc/gpuwatchd (config.yaml, web-config, certificates)
set -euo pipefail

ROOT=/
KEEP_CONFIG=0

die() { echo "uninstall.sh: $*" >&2; exit 2; }
say() { echo "gpuwatchd uninstall: $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=${2:?--root needs a directory}; shift 2 ;;
        --root=*) ROOT=${1#--root=}; shift ;;
        --keep-config) KEEP_CONFIG=1; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

[ -d "$ROOT" ] || die "--root $ROOT is not a directory"
ROOT=$(cd "$ROOT" && pwd)
R=${ROOT%/}
if [ -z "$R" ] && [ "$(id -u)" != 0 ]; then
    die "run as root (or use --root DIR)"
fi

MANIFEST="$R/etc/gpuwatchd/.install-manifest"
MANIFEST_LINES=()
if [ -f "$MANIFEST" ]; then
    mapfile -t MANIFEST_LINES < "$MANIFEST"
fi

# 1. stop the service on the live system
if [ -z "$R" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now gpuwatchd.service 2>/dev/null || true
fi

# 2. files and directories that belong to gpuwatchd alone
gone() { if [ -e "$1" ] || [ -L "$1" ]; then rm -rf -- "$1"; say "removed ${1#"$R"}"; fi; }
gone "$R/etc/systemd/system/gpuwatchd.service"
gone "$R/etc/systemd/system/gpuwatchd.service.d"
gone "$R/etc/systemd/system/multi-user.target.wants/gpuwatchd.service"
gone "$R/etc/tmpfiles.d/gpuwatchd.conf"
gone "$R/etc/sysusers.d/gpuwatchd.conf"
gone "$R/run/gpuwatch"
gone "$R/var/lib/gpuwatchd"
gone "$R/var/lib/private/gpuwatchd"
if [ "$KEEP_CONFIG" = 1 ]; then
    rm -f -- "$MANIFEST"
    say "kept /etc/gpuwatchd"
else
    gone "$R/etc/gpuwatchd"
fi

# 3. the system user and its group
if grep -q '^gpuwatchd:' "$R/etc/passwd" 2>/dev/null; then
    userdel --root "$ROOT" gpuwatchd
    say "removed user gpuwatchd"
fi
if grep -q '^gpuwatchd:' "$R/etc/group" 2>/dev/null; then
    groupdel --root "$ROOT" gpuwatchd
    say "removed group gpuwatchd"
fi
# userdel and systemd-sysusers keep the previous account files as passwd-, shadow-, ...: drop
# the gpuwatchd entries there too (in place: the backups keep their owner and mode), so that
# no trace of the account remains (found by tests/test_systemd_boot.py).
for f in passwd group shadow gshadow; do
    b="$R/etc/$f-"
    if [ -f "$b" ] && grep -q '^gpuwatchd:' "$b"; then
        kept=$(grep -v '^gpuwatchd:' "$b" || true)
        printf '%s\n' "$kept" | sed '/^$/d' > "$b"
        say "removed gpuwatchd from /etc/$f-"
    fi
done

# 4. what install.sh created where nothing was before: files first, then directories, deepest
#    first, and only when empty (something else may have moved in since).
for line in "${MANIFEST_LINES[@]}"; do
    case "$line" in
        "file "*)
            f="$R${line#file }"
            case "$f" in
                */etc/passwd|*/etc/group|*/etc/shadow|*/etc/gshadow)
                    # Created by sysusers for our user alone: remove once it holds nothing else.
                    if [ -f "$f" ] && [ ! -s "$f" ]; then rm -f -- "$f" "$f-"; fi ;;
                *) rm -f -- "$f" ;;
            esac ;;
    esac
done
for line in "${MANIFEST_LINES[@]}"; do
    case "$line" in "dir "*) echo "${line#dir }" ;; esac
done | awk '{ print length($0) " " $0 }' | sort -rn | cut -d' ' -f2- | while read -r d; do
    if [ -d "$R$d" ]; then rmdir -- "$R$d" 2>/dev/null || true; fi
done

if [ -z "$R" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
say "done (the Python package stays: pip uninstall gpuwatchd)"
