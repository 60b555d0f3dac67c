#!/usr/bin/env bash
# Device smoke run of the real-faults test scripts (no daemon): each framework job trains and
# checkpoints; fault_rank.py injects two faults; the NCCL version decides RAS (>= 2.24).
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name())'
pip list 2>/dev/null | grep -iE "^(transformers|lightning|torch|py-spy|nvidia-nccl)" 
tr() { python3 -m torch.distributed.run --nnodes 1 --nproc-per-node "$1" --master-addr 127.0.0.1 --master-port "$2" --rdzv-id "$3" "${@:4}"; }
( timeout 100 bash -c "$(declare -f tr); tr 1 29511 hf tests/gpu/hf_trainer_job.py --out $OUT/hf --every 40" > $OUT/hf.log 2>&1; echo "hf rc $?" >> $OUT/hf.log ) &
( timeout 100 bash -c "$(declare -f tr); tr 1 29512 lt tests/gpu/lightning_job.py --out $OUT/lt --every 50" > $OUT/lt.log 2>&1; echo "lt rc $?" >> $OUT/lt.log ) &
for f in GPU SEGFAULT INT; do timeout 60 bash -c "$(declare -f tr); tr 2 $((29520 + RANDOM % 400)) fr-$f tests/gpu/fault_rank.py $f --delay 3" > $OUT/fault_$f.log 2>&1; echo "$f rc $?" >> $OUT/fault_$f.log; done
wait
for f in $OUT/*.log; do echo "=== $f"; grep -vE "^\s*$" $f | tail -25; done
ls -R $OUT/hf | head -20; ls $OUT/lt | head
