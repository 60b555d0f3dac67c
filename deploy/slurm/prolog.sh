#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/gpuwatchd.sh), run by slurmd as root on
# each node before the job's first step. Refuses the node when one of the job's GPUs still holds
# memory of a process that belongs to no live job (`gpuwatchd check`, DESIGN §6): the prolog then
# exits non-zero, Slurm drains the node ("Prolog error") and requeues the job elsewhere, instead
# of letting it die with "CUDA out of memory ... Process 11223 has 55 GiB".
#
# Environment (slurmd sets SLURM_*; the others are optional, e.g. in a prolog.d wrapper):
#   SLURM_JOB_GPUS        GPU indexes of the allocation on this node; no GPUs -> nothing to check
#   GPUWATCHD             the gpuwatchd executable (default: /usr/local/bin/gpuwatchd, then PATH)
#   GPUWATCHD_CONFIG      config file (default: /etc/gpuwatchd/config.yaml when it exists)
#   GPUWATCHD_PROLOG_KILL 1: terminate the stale holders (`check --kill`) and accept the node
#                         once their memory is really freed, instead of refusing it
#   GPUWATCHD_FAIL_OPEN   1: accept the node when the check itself cannot run (exit 2: no
#                         driver, NVML hung, gpuwatchd missing); default: refuse it
# Slurm runs prologs without PATH (prolog_epilog.html), so every command is looked up here.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { logger -t gpuwatchd-prolog -- "$*" 2>/dev/null || true; echo "gpuwatchd-prolog: $*" >&2; }

if [ -z "${SLURM_JOB_GPUS:-}" ]; then
    exit 0  # a job without GPUs on this node: nothing to check
fi

GW=${GPUWATCHD:-/usr/local/bin/gpuwatchd}
[ -x "$GW" ] || GW=$(command -v gpuwatchd || true)
cfg=()
[ -n "${GPUWATCHD_CONFIG:-}" ] && cfg=(--config.file "$GPUWATCHD_CONFIG")

refuse() {
    log "job ${SLURM_JOB_ID:-?}: refusing node ${SLURMD_NODENAME:-$(hostname)}: $1"
    if [ -n "${SLURMD_NODENAME:-}" ] && command -v scontrol >/dev/null; then
        scontrol update nodename="$SLURMD_NODENAME" state=drain reason="gpuwatchd: $1" \
            >/dev/null 2>&1 || true
    fi
    exit 1
}

if [ -z "$GW" ]; then
    [ "${GPUWATCHD_FAIL_OPEN:-0}" = 1 ] && { log "gpuwatchd not installed; accepting"; exit 0; }
    refuse "gpuwatchd not installed, cannot check GPU memory"
fi

args=(check "${cfg[@]}" --gpus "$SLURM_JOB_GPUS" --timeout 60)
[ "${GPUWATCHD_PROLOG_KILL:-0}" = 1 ] && args+=(--kill)
out=$("$GW" "${args[@]}" 2>&1)
rc=$?
case $rc in
    0) exit 0 ;;
    1) log "$out"; refuse "stale GPU memory on GPU(s) $SLURM_JOB_GPUS (gpuwatchd check)" ;;
    *) log "$out"
       [ "${GPUWATCHD_FAIL_OPEN:-0}" = 1 ] && { log "check failed (exit $rc); accepting"; exit 0; }
       refuse "gpuwatchd check failed (exit $rc)" ;;
esac
