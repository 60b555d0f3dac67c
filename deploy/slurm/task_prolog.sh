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

# Opt-in, GPUWATCHD_FR_PIPE=1 in the job's environment: torch's flight-recorder dump pipe, so that
# gpuwatchd can ask each rank for a dump while the job looks stalled (docs/rankfile.md, "PyTorch's
# dump pipe"). The FIFOs and dumps go to a directory private to the task (0700, owned by the job's
# user; a directory another user made first turns the opt-in off: a name they control could break
# the job's start). Printed as "export" lines, which Slurm applies to the task; what the job set
# itself wins. Workers that torchrun starts inherit them and append their own global rank.
fr_pipe() {
    local base dir
    base="${TMPDIR:-/tmp}/gpuwatch-fr-$(id -u)"
    dir="$base/$SLURM_JOB_ID.${SLURM_STEP_ID:-0}.${SLURM_PROCID:-0}"
    case "$dir" in *[!A-Za-z0-9_./-]*) return ;; esac  # never a path an odd value shapes
    mkdir -m 700 "$base" 2>/dev/null
    [ -d "$base" ] && [ ! -L "$base" ] && [ -O "$base" ] || return
    mkdir -m 700 "$dir" 2>/dev/null
    [ -d "$dir" ] && [ ! -L "$dir" ] && [ -O "$dir" ] || return
    # the pipe under its current name and the one torch read before the TORCH_FR_ names; the
    # buffer and the dump file only under the current names (the old ones are nccl_legacy_env)
    echo "export TORCH_FR_DEBUG_INFO_PIPE_FILE=$dir/pipe_"
    echo "export TORCH_NCCL_DEBUG_INFO_PIPE_FILE=$dir/pipe_"
    [ -n "${TORCH_FR_BUFFER_SIZE:-}${TORCH_NCCL_TRACE_BUFFER_SIZE:-}" ] ||
        echo "export TORCH_FR_BUFFER_SIZE=2000"
    [ -n "${TORCH_FR_DUMP_TEMP_FILE:-}${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-}" ] ||
        echo "export TORCH_FR_DUMP_TEMP_FILE=$dir/trace_"
}
if [ "${GPUWATCHD_FR_PIPE:-0}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ] && \
        [ -z "${TORCH_FR_DEBUG_INFO_PIPE_FILE:-}${TORCH_NCCL_DEBUG_INFO_PIPE_FILE:-}" ]; then
    fr_pipe
fi

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
