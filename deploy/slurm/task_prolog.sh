#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/gpuwatchd-task-prolog.sh), run by
# slurmstepd as the job's user before each task starts. Registers the task as a rank with
# gpuwatchd: job "<SLURM_JOB_ID>.<SLURM_STEP_ID>" (the same id that discovery from
# /proc/PID/environ derives), rank SLURM_PROCID, pid SLURM_TASK_PID (the task's own process, which
# then execs the user's program), its GPUs from SLURM_STEP_GPUS / SLURM_JOB_GPUS.
#
# The rank file is written by the job's user, so gpuwatchd accepts it for the task's PID (same
# uid) and for nothing else (docs/security.md). Monitoring must never break a job: every failure
# is logged and the task starts anyway. Set GPUWATCHD_SLURM_REGISTER=0 in a job that launches its
# own ranks (`srun torchrun ...`: the Slurm task is the torchrun agent, not a rank).
#
# A TaskProlog's stdout is read by Slurm ("export NAME=value" lines change the task's
# environment), so gpuwatchd's own output goes to stderr only.
export PATH=/usr/local/bin:/usr/bin:/bin

[ "${GPUWATCHD_SLURM_REGISTER:-1}" = 0 ] && exit 0
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_PROCID:-}" ] && [ -n "${SLURM_TASK_PID:-}" ] || exit 0

GW=${GPUWATCHD:-/usr/local/bin/gpuwatchd}
[ -x "$GW" ] || GW=$(command -v gpuwatchd || true)
[ -n "$GW" ] || exit 0

job="$SLURM_JOB_ID"
[ -n "${SLURM_STEP_ID:-}" ] && job="$SLURM_JOB_ID.$SLURM_STEP_ID"
args=(register --job-id "$job" --rank "$SLURM_PROCID" --pid "$SLURM_TASK_PID")
[ -n "${GPUWATCHD_CONFIG:-}" ] && args+=(--config.file "$GPUWATCHD_CONFIG")
[ -n "${SLURM_LOCALID:-}" ] && args+=(--local-rank "$SLURM_LOCALID")
ntasks=${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:-}}
[ -n "$ntasks" ] && args+=(--world-size "$ntasks")
gpus=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}
[ -n "$gpus" ] && args+=(--gpus "$gpus")

if ! err=$("$GW" "${args[@]}" 2>&1 >/dev/null); then
    logger -t gpuwatchd-task-prolog -- "job $job rank $SLURM_PROCID: register failed: ${err:0:500}" \
        2>/dev/null || true
    echo "gpuwatchd-task-prolog: register failed: ${err:0:500}" >&2
fi
exit 0
