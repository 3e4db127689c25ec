#!/bin/bash
cd /work/main; source /tmp/lead/venv/bin/activate
for round in 1 2 3; do
 for cfg in base new; do
  d=/work/main; [ $cfg = base ] && d=/tmp/s41/base
  for op in allreduce allgather reducescatter; do
   PYTHONPATH=$d NEURON_DIST_TUNING=host python ../shared/tools/collbench.py --backend neuron --import neuron_dist --op $op -g 2 -b 4K -e 16M -f 4 --stat median -n 30 --json /tmp/s41/cc_${op}_${cfg}_${round}.json > /dev/null 2>&1
  done
 done
done
echo done
