#!/bin/bash
cd /work/main; source /tmp/lead/venv/bin/activate
for round in 1 2 3; do
 for cfg in base new; do
  d=/work/main; [ $cfg = base ] && d=/tmp/s41/base
  PYTHONPATH=$d python -m neuron_dist.bench_train --steps 10 --warmup 3 --backends neuron --json /tmp/s41/tr_${cfg}_${round}.json > /tmp/s41/tr_${cfg}_${round}.txt 2>&1
 done
done
echo done
