# A device run of the GPU suite, then the 64-rank cost window (bench/nvml_poll.py: the heartbeat path
# and the heartbeat-less one beside nvitop-exporter, shipped defaults), from the repository root:
#   bash bench/device/cost_window.sh
#   run with the wheels of py-spy, pyudev, bcrypt, h11, nvitop, nvitop-exporter in .whl/
#   env: BENCH_SECONDS (window), WORK_MS (each holder's CPU every 50 ms), MAIN_REPO (a "before"
#   checkout beside), SKIP_SUITE=1 (the cost window only), GIB (each holder's memory: 1 fits 64
#   holders on an H200; 0.25 on an 80 GB H100, where each CUDA context adds ~0.5 GiB)
set -u
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-deps --no-index --prefix /tmp/site .whl/*.whl 2>&1 | tail -2
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site/lib/python3.12/site-packages:$PWD
rev=$(cat .rev 2>/dev/null || echo "?")
if [ -z "${SKIP_SUITE:-}" ]; then
echo "# python3 -m pytest -v -s tests/gpu; main $rev" > $OUT/gpu_suite.log
timeout 330 python3 -m pytest -v -s -p no:cacheprovider tests/gpu >> $OUT/gpu_suite.log 2>&1
echo "rc=$?" >> $OUT/gpu_suite.log
grep -E "passed|failed|SAW|PASS|paged|FAILED|Error" $OUT/gpu_suite.log | tail -40
fi
args="--sizes 64 --gib ${GIB:-1} --seconds ${BENCH_SECONDS:-150} --warmup 10 --no-poll --interval 5 --defaults --work-ms ${WORK_MS:-4}"
only=gpuwatchd-defaults-hb,gpuwatchd-defaults-nohb
# MAIN_REPO: a checkout (its gpuwatchd/ at least) whose heartbeat daemon runs beside, as "before"
[ -n "${MAIN_REPO:-}" ] && { args="$args --main-repo $MAIN_REPO"; only="$only,gpuwatchd-before-defaults-hb"; }
args="$args --only $only --profile-variant gpuwatchd-defaults-hb"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "# python3 -m bench.nvml_poll $args --pyspy bench/pyspy_counting.sh; ${card:-?}, main $rev" > $OUT/bench.log
python3 -m bench.nvml_poll $args --pyspy $PWD/bench/pyspy_counting.sh --keep $OUT/keep --out $OUT/bench.json >> $OUT/bench.log 2>&1
echo "rc=$?" >> $OUT/bench.log
cp /tmp/pyspy_calls.log $OUT/ 2>/dev/null
for m in $OUT/keep/*.metrics; do  # what each daemon said at the end of the window: its findings
  echo "findings of $(basename $m .metrics): $(grep -c '^gpuwatch_finding{' $m)" \
    "$(grep '^gpuwatch_finding{' $m | sed 's/.*kind="\([a-z_]*\)".*/\1/' | sort | uniq -c | tr '\n' ' ')" >> $OUT/bench.log
done
tar -czf $OUT/keep.tgz -C $OUT keep && rm -rf $OUT/keep  # one file: the device hands back a few
cat $OUT/bench.log; echo "py-spy runs: $(grep -c ' rc=' $OUT/pyspy_calls.log 2>/dev/null) ($(grep ' rc=' $OUT/pyspy_calls.log 2>/dev/null | awk '{print $2, $4}' | sort | uniq -c | tr '\n' ';'))"
