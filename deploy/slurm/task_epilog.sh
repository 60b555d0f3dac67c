#!/bin/bash
# Slurm TaskEpilog (slurm.conf: TaskEpilog=/etc/slurm/gpuwatchd-task-epilog.sh), run by
# slurmstepd as the job's user after each task ends. Removes the task's rank file, so that a task
# that finished is not reported as a dead rank. The node Epilog (epilog.sh) sweeps whatever a
# killed step left behind.
export PATH=/usr/local/bin:/usr/bin:/bin

# The task's flight-recorder pipe directory (task_prolog.sh, GPUWATCHD_FR_PIPE=1): removed when
# it is the user's own directory, never through a link.
if [ "${GPUWATCHD_FR_PIPE:-0}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    fr_dir="${TMPDIR:-/tmp}/gpuwatch-fr-$(id -u)/$SLURM_JOB_ID.${SLURM_STEP_ID:-0}.${SLURM_PROCID:-0}"
    case "$fr_dir" in
        *[!A-Za-z0-9_./-]*) ;;
        *) [ -d "$fr_dir" ] && [ ! -L "$fr_dir" ] && [ -O "$fr_dir" ] && rm -rf -- "$fr_dir" ;;
    esac
fi

[ "${GPUWATCHD_SLURM_REGISTER:-1}" = 0 ] && exit 0
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_PROCID:-}" ] || exit 0

GW=${GPUWATCHD:-/usr/local/bin/gpuwatchd}
[ -x "$GW" ] || GW=$(command -v gpuwatchd || true)
[ -n "$GW" ] || exit 0

job="$SLURM_JOB_ID"
[ -n "${SLURM_STEP_ID:-}" ] && job="$SLURM_JOB_ID.$SLURM_STEP_ID"
args=(unregister --job-id "$job" --rank "$SLURM_PROCID")
[ -n "${GPUWATCHD_CONFIG:-}" ] && args+=(--config.file "$GPUWATCHD_CONFIG")
"$GW" "${args[@]}" >/dev/null 2>&1 || true
exit 0
