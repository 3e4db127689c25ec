#!/bin/bash
# In-process A/B of the pair form with lent frames (thirty-sixth pass): the two-rank collectives
# whose blocks the shared-memory transport lends (all-gather, broadcast, all-to-all), back to back
# at 512 KiB (the smallest lent block), 1 MiB and 4 MiB, and at 1 MiB behind a Gloo barrier.
# Usage: run_lent_ab.sh OUT.txt   (inproc_ab.py's "off" is the Execution)
cd "$(dirname "$0")/../../.."
export NEURON_DIST_TUNING=host
{
  date; uname -r; lscpu | grep -E 'Model name|L3'; git rev-parse HEAD
  for size in 512K 1M 4M; do
    for op in allgather broadcast alltoall; do
      torchrun --nproc-per-node 2 benchmarks/results/pair-exchange-ab/inproc_ab.py --op $op --bytes $size \
        --batch $([ $size = 4M ] && echo 60 || echo 150) 2>&1 | grep -E '^#'
    done
  done
  for op in allgather broadcast alltoall; do
    torchrun --nproc-per-node 2 benchmarks/results/pair-exchange-ab/inproc_ab.py --op $op --bytes 1M --mode barrier \
      --batch 100 2>&1 | grep -E '^#'
  done
  date
} > "$1" 2>&1
