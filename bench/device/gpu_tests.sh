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
echo "# python3 -m pytest -v -s $* ${PYTEST_K:+-k \"$PYTEST_K\"}; main $rev" > $log
timeout "${LIMIT:-560}" python3 -m pytest -v -s -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} "$@" >> $log 2>&1
echo "rc=$?" >> $log
grep -E "passed|failed|SAW|PASSED|FAILED|Error|assert" $log | cut -c1-700 | tail -80
