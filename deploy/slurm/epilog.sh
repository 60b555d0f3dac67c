#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/gpuwatchd.sh), run by slurmd as root on
# each node when the job ends. Removes rank files the job's tasks left behind (a task killed
# before its TaskEpilog ran), so that gpuwatchd does not report the finished job's ranks as down.
# Rank files of this job are named "<SLURM_JOB_ID>.<step>.<rank>.json" by task_prolog.sh.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

[ -n "${SLURM_JOB_ID:-}" ] || exit 0
case "$SLURM_JOB_ID" in *[!0-9_]*) exit 0 ;; esac  # never a glob from an unexpected value

# GPUWATCHD_RANK_DIR: set it (e.g. in an epilog.d wrapper) when config.yaml moves rank_dir.
RANK_DIR=${GPUWATCHD_RANK_DIR:-/run/gpuwatch/ranks}

shopt -s nullglob
for f in "$RANK_DIR/$SLURM_JOB_ID".*.json "$RANK_DIR/$SLURM_JOB_ID".json \
         "$RANK_DIR/$SLURM_JOB_ID".*.hb; do
    # Only regular files (never follow a link a user placed in the sticky directory).
    [ -f "$f" ] && [ ! -L "$f" ] && rm -f -- "$f"
done
exit 0
