#!/bin/bash
# In-process A/Bs of the pair form (inproc_ab.py) for every two-rank collective it takes, back to
# back and behind a Gloo barrier, 4 KiB (and 64/256 KiB back to back).  Usage: run_ab.sh OUT.txt
cd "$(dirname "$0")/../../.."
export NEURON_DIST_TUNING=host
{
  date; uname -r; lscpu | grep -E 'Model name|L3'; git rev-parse HEAD
  for mode in loop barrier; do
    for op in allreduce allgather reduce_scatter broadcast alltoall; do
      torchrun --nproc-per-node 2 benchmarks/results/pair-exchange-ab/inproc_ab.py --op $op --mode $mode \
        --batch $([ $mode = loop ] && echo 300 || echo 150) 2>&1 | grep -E '^(pair|#)'
    done
  done
  for size in 64K 256K; do
    for op in allreduce allgather reduce_scatter broadcast alltoall; do
      torchrun --nproc-per-node 2 benchmarks/results/pair-exchange-ab/inproc_ab.py --op $op --bytes $size 2>&1 | grep -E '^#'
    done
  done
  date
} > "$1" 2>&1
