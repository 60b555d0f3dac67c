#!/bin/bash
# Make /usr/lib/gpuwatchd (a Python venv holding gpuwatchd's wheel and its dependencies' wheels) under
# a staging root, for the Debian package (deploy/debian/build.sh) and the image
# (deploy/image/build.sh): both install exactly these files.
#
#   deploy/venv.sh --wheel dist/gpuwatchd-*.whl --root STAGE [--find-links DIR] [--python PATH]
#
# The venv is made with Debian's interpreter (default /usr/bin/python3, resolved to
# /usr/bin/python3.X, the path the venv links to: compiled wheels are per Python version) where it
# will not live, then moved: every path naming the staging root is rewritten (scripts' #!,
# pyvenv.cfg), the byte code is compiled again for the installed paths (checked-hash: valid
# whatever the files' times, so nothing is written at run time under ProtectSystem=strict;
# --no-byte-code leaves none: the Debian package compiles it in postinst), pip and setuptools are
# removed (nothing installs into it later), the interpreter link is relative, and the wheels'
# ELF files are stripped of their symbols (strip --strip-unneeded, as dh_strip does: 4.1 of
# 11.5 MB), and every RECORD line gets the hash and size of the file as installed (pip's check
# holds; the venv is the same wherever it was staged). pip runs without the system's
# site-packages (a python3-yaml on the build host would satisfy PyYAML and leave it out); the
# venv sees them afterwards, for Debian's python3-systemd (the journal source).
#   --find-links DIR   dependencies' wheels from DIR only (no index: offline builds, CI)
#   --no-byte-code     no __pycache__ (the Debian package's postinst compiles it where installed)
# Byte code and stripping are deterministic (PYTHONHASHSEED=0: frozensets of strings are marshalled
# in hash order), so the same wheels give the same files. Needs strip (binutils).
# Prints the Python version (3.X) the venv is for.
set -euo pipefail

WHEEL= LINKS= ROOT= PY=/usr/bin/python3 DEST=/usr/lib/gpuwatchd BYTECODE=1
die() { echo "deploy/venv.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) WHEEL=${2:?}; shift 2 ;;
        --find-links) LINKS=${2:?}; shift 2 ;;
        --root) ROOT=${2:?}; shift 2 ;;
        --python) PY=${2:?}; shift 2 ;;
        --no-byte-code) BYTECODE=; shift ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[ -f "$WHEEL" ] || die "--wheel FILE is required (build one with: python3 -m build --wheel)"
[ -n "$ROOT" ] || die "--root STAGE is required"
mkdir -p "$ROOT"; ROOT=$(cd "$ROOT" && pwd)
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYTHON="/usr/bin/python$PYVER"
[ -x "$PYTHON" ] || die "$PYTHON not found"
command -v strip >/dev/null || die "strip not found (apt-get install binutils)"
V="$ROOT$DEST"
[ ! -e "$V" ] || die "$V exists already"

"$PYTHON" -m venv "$V"
pipargs=(--disable-pip-version-check --no-warn-script-location -q)
if [ -n "$LINKS" ]; then pipargs+=(--no-index --find-links "$LINKS"); fi
"$V/bin/python" -m pip install "${pipargs[@]}" --no-compile "$WHEEL" >&2
"$V/bin/python" -m pip uninstall -q -y pip setuptools >/dev/null
sed -i 's/^include-system-site-packages = false$/include-system-site-packages = true/' "$V/pyvenv.cfg"
grep -q '^include-system-site-packages = true$' "$V/pyvenv.cfg" || die "could not set pyvenv.cfg"
rm -rf "$V"/lib/python*/site-packages/*.dist-info/direct_url.json "$V"/bin/[Aa]ctivate*
grep -rlIF "$V" "$V" | while read -r f; do sed -i "s#$V#$DEST#g" "$f"; done
if grep -rqIF "$ROOT" "$V"; then die "a path of the staging root is left in the venv"; fi
find "$V" -name __pycache__ -prune -exec rm -rf {} +
# /usr/lib/gpuwatchd/bin/python3.X -> ../../../bin/python3.X (/usr/bin/python3.X), relative: the
# package's links stay inside /usr (Debian Policy 10.5)
ln -sfn "../../../bin/python$PYVER" "$V/bin/python$PYVER"
# the wheels' ELF files, stripped
find "$V" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0 | sort -z \
    | while IFS= read -r -d '' f; do
        [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
        strip --strip-unneeded --remove-section=.comment --remove-section=.note "$f"
    done
# RECORD matches the files again (pip's format): the stripped binaries, and the scripts whose #!
# named the staging root (their sizes depended on where the venv was staged)
PYTHONHASHSEED=0 "$PYTHON" - "$V" <<'RECORD'
import base64, csv, hashlib, io, pathlib, sys
venv = pathlib.Path(sys.argv[1])
for record in venv.glob("lib/python*/site-packages/*.dist-info/RECORD"):
    site = record.parent.parent
    # rows of files removed above (direct_url.json) go; the rest get the installed files' hashes
    rows = [r for r in csv.reader(io.StringIO(record.read_text())) if (site / r[0]).exists()]
    for row in rows:
        if len(row) == 3 and row[1]:
            data = (site / row[0]).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            row[1:3] = [f"sha256={digest}", str(len(data))]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    record.write_text(out.getvalue())
RECORD
if [ -n "$BYTECODE" ]; then
    PYTHONHASHSEED=0 "$PYTHON" -m compileall -q -j0 -s "$ROOT" -p / --invalidation-mode checked-hash \
        "$V/lib" >&2
fi
echo "$PYVER"
