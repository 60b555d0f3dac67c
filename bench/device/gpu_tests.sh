#!/usr/bin/env bash
# A device run of chosen GPU test files: installs the carried wheels (.whl/: py-spy, pyudev, bcrypt,
# h11), then runs `python3 -m pytest -v -s` on each file named, with its log under $OUT.
#   bash bench/device/gpu_tests.sh tests/gpu/test_real_faults.py[::test...] ...
#   env: PYTEST_K (a -k expression), LIMIT (seconds for the whole run, default 560)
set -u
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-deps --no-index --prefix /tmp/site .whl/*.whl 2>&1 | tail -2
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site/lib/python3.12/site-packages:$PWD
rev=$(cat .rev 2>/dev/null || echo "?")
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name())'
log=$OUT/gpu_tests.log
# A warm machine keeps what an earlier call left running: a run cut by its limit may leave its
# jobs on the GPU (the call after one cut during a Lightning job read GPU 0 5-7 % busy where the
# "idle GPU" tests want it idle). End them before and after, and say so in the log.
leftovers() {
    local pid apps n=0
    for pid in $(pgrep -f "[p]ython.*tests/gpu/"); do  # pytest, torchrun and the ranks; not this script
        if [ "$pid" != $$ ] && [ "$pid" != "$PPID" ] && kill -9 "$pid" 2>/dev/null; then n=$((n + 1)); fi
    done
    [ "$n" -gt 0 ] && echo "# killed $n leftover test processes" >> $log
    apps=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
    if [ -n "$apps" ]; then
        echo "# GPU compute processes left: $(echo "$apps" | tr '\n' ';'): killed" >> $log
        kill -9 $(echo "$apps" | cut -d, -f1) 2>/dev/null
        sleep 2
    fi
}
echo "# python3 -m pytest -v -s $* ${PYTEST_K:+-k \"$PYTEST_K\"}; main $rev" > $log
leftovers
timeout -k 10 "${LIMIT:-560}" python3 -m pytest -v -s -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} "$@" >> $log 2>&1
echo "rc=$?" >> $log
leftovers
grep -E "passed|failed|SAW|PASSED|FAILED|Error|assert|^# (killed|GPU compute)" $log | cut -c1-700 | tail -80
