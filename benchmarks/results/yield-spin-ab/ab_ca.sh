#!/bin/bash
cd /work/main; source /tmp/lead/venv/bin/activate
for round in 1 2; do
 for size in 4K 1M 16M; do
  for op in allreduce allgather; do
   for cfg in base new; do
    d=/work/main; [ $cfg = base ] && d=/tmp/s41/base
    it=300; [ $size = 16M ] && it=100
    echo "== $round $size $op $cfg"
    PYTHONPATH=$d NEURON_DIST_TUNING=host timeout 200 torchrun --nproc-per-node 2 $d/benchmarks/call_anatomy.py --bytes $size --op $op --iters $it 2>&1 | grep -A4 " mode" | tail -4
   done
  done
 done
done
echo done
