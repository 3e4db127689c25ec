#!/bin/bash
# interleaved A/B of single-copy lending: collbench world 2 (all-gather, the harness),
# neuron_dist.bench world 4 --loop (broadcast, all-gather, all-to-all), FSDP2/DDP training
cd /work/main; source /tmp/lead/venv/bin/activate
O=/tmp/lead/lend/ab; mkdir -p $O
export NEURON_DIST_TUNING=host
for r in 1 2; do
 for L in 1 0; do
  NEURON_DIST_SHM_LEND=$L python ../shared/tools/collbench.py --backend neuron --import neuron_dist --op allgather -g 2 -b 1M -e 64M -f 4 --stat median -n 20 > $O/cb_ag_L${L}_r$r.txt 2>&1
  NEURON_DIST_SHM_LEND=$L python -m neuron_dist.bench -g 4 --ops broadcast,allgather,alltoall -b 1M -e 64M -f 4 -n 10 -w 2 --loop --vs gloo --no-progress > $O/w4_L${L}_r$r.txt 2>&1
 done
done
python ../shared/tools/collbench.py --mpi --op allgather -g 2 -b 1M -e 64M -f 4 --stat median -n 20 > $O/cb_ag_mpi.txt 2>&1
python ../shared/tools/collbench.py --backend gloo --op allgather -g 2 -b 1M -e 64M -f 4 --stat median -n 20 > $O/cb_ag_gloo.txt 2>&1
for r in 1 2; do
 for L in 1 0; do
  NEURON_DIST_SHM_LEND=$L python -m neuron_dist.bench_train --steps 10 --warmup 3 --backends neuron,none --wrap fsdp2 > $O/tr_L${L}_r$r.txt 2>&1
 done
done
echo done
