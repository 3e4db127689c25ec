#!/bin/bash
# In-process A/Bs of the adapter's common paths for all-gather, reduce-scatter and broadcast (all-to-all: common_ab_alltoall.txt, the same commands with --op alltoall)
# (inproc_ab.py --switch common), back to back and behind a Gloo barrier at 4 KiB, back to back
# at 64 KiB and 1 MiB.  Usage: run_common_ab.sh OUT.txt
cd "$(dirname "$0")/../../.."
export NEURON_DIST_TUNING=host
{
  date; uname -r; lscpu | grep -E 'Model name|L3'; git rev-parse HEAD
  for mode in loop barrier; do
    for op in allgather reduce_scatter broadcast; do
      torchrun --nproc-per-node 2 benchmarks/results/pair-exchange-ab/inproc_ab.py --switch common --op $op \
        --mode $mode --batch $([ $mode = loop ] && echo 300 || echo 150) 2>&1 | grep -E '^(pair|#)'
    done
  done
  for size in 64K 1M; do
    for op in allgather reduce_scatter broadcast; do
      torchrun --nproc-per-node 2 benchmarks/results/pair-exchange-ab/inproc_ab.py --switch common --op $op \
        --bytes $size --batch $([ $size = 1M ] && echo 100 || echo 300) 2>&1 | grep -E '^#'
    done
  done
  date
} > "$1" 2>&1
