#!/usr/bin/env bash
# Reproduces every table in benchmarks/RESULTS.md (about 11 minutes on 2 cores).
# Usage: benchmarks/run_all.sh OUTDIR   (a new folder, e.g. benchmarks/results/NAME; then
# python benchmarks/tables.py OUTDIR). collbench is the reference harness beside this repository
# (the workspace's shared/tools/collbench.py), not part of it: COLLBENCH=PATH names another copy.
set -u
cd "$(dirname "$0")/.."
# no default folder: benchmarks/results itself holds a kept run, which a bare call overwrote
if [ $# -ne 1 ]; then echo "usage: benchmarks/run_all.sh OUTDIR (a new folder, e.g. benchmarks/results/NAME)" >&2; exit 2; fi
OUT=$1
if [ -e "$OUT/machine.txt" ]; then echo "run_all.sh: $OUT holds a run already; name a new folder" >&2; exit 2; fi
# The fast host policy for the main tables; the default "model" policy (the cost model's choice
# for the modelled Trainium instance) is timed at the end for comparison.
export NEURON_DIST_TUNING=${NEURON_DIST_TUNING:-host}
CB=${COLLBENCH:-../shared/tools/collbench.py}
if [ ! -f "$CB" ]; then
  echo "run_all.sh: collbench not found at $CB (it is the workspace's shared/tools/collbench.py, not part of this repository); set COLLBENCH=/path/to/collbench.py" >&2; exit 2
fi
mkdir -p "$OUT"
# A command that fails (a benchmark exits 1 when it counted wrong results, bench_train when the
# ranks' parameters disagree) is named in $OUT/FAILED with its exit status, its stderr is kept in
# $OUT/NAME.err (removed when it succeeded: progress lines only), the rest still runs, and the
# script's own exit status is 1; set -e would have lost every table after the first failure.
rm -f "$OUT/FAILED"
status() { if [ "$2" != 0 ]; then echo "$1: exit status $2" >> "$OUT/FAILED"; else rm -f "$OUT/$1.err"; fi; }
{ date; uptime; uname -a; nproc; lscpu | grep -E 'Model name|MHz|L3'; python -c 'import torch,mpi4py;print("torch",torch.__version__,"mpi4py",mpi4py.__version__)'; git rev-parse HEAD; } > "$OUT/machine.txt" 2>&1
python "$CB" --membw --json "$OUT/membw.json" > "$OUT/membw.txt" 2>&1; status membw $?
for op in allreduce allgather reducescatter; do
  python "$CB" --backend neuron --import neuron_dist --op $op -g 2 -b 4K -e 64M -f 4 --stat median -n 20 --json "$OUT/cb_${op}_neuron.json" > "$OUT/cb_${op}_neuron.txt" 2>&1; status cb_${op}_neuron $?
  python "$CB" --backend gloo --op $op -g 2 -b 4K -e 64M -f 4 --stat median -n 20 --json "$OUT/cb_${op}_gloo.json" > "$OUT/cb_${op}_gloo.txt" 2>&1; status cb_${op}_gloo $?
  python "$CB" --mpi --op $op -g 2 -b 4K -e 64M -f 4 --stat median -n 20 --json "$OUT/cb_${op}_mpi.json" > "$OUT/cb_${op}_mpi.txt" 2>&1; status cb_${op}_mpi $?
done
# back-to-back latency (nccl-tests style: one barrier, then the average of 200 calls)
python "$CB" --backend neuron --import neuron_dist --op allreduce -g 2 -b 4K -e 1M -f 4 --loop -n 200 -w 20 --json "$OUT/loop_neuron.json" > "$OUT/loop_neuron.txt" 2>&1; status loop_neuron $?
python "$CB" --backend gloo --op allreduce -g 2 -b 4K -e 1M -f 4 --loop -n 200 -w 20 --json "$OUT/loop_gloo.json" > "$OUT/loop_gloo.txt" 2>&1; status loop_gloo $?
python "$CB" --mpi --op allreduce -g 2 -b 4K -e 1M -f 4 --loop -n 200 -w 20 --json "$OUT/loop_mpi.json" > "$OUT/loop_mpi.txt" 2>&1; status loop_mpi $?
python -m neuron_dist.bench -g 2 --ops all -b 4K -e 64M -f 4 --vs gloo -n 20 -w 5 --json "$OUT/bench_w2.json" > "$OUT/bench_w2.txt" 2>"$OUT/bench_w2.err"; status bench_w2 $?
# the same three at world 2 with torch's huge pages in every rank (what neuronrun sets), Gloo's too
python -m neuron_dist.bench -g 2 --ops allreduce,allgather,reduce_scatter --place out -b 1M -e 64M -f 4 --vs gloo -n 20 -w 5 --thp on --json "$OUT/bench_w2_thp.json" > "$OUT/bench_w2_thp.txt" 2>"$OUT/bench_w2_thp.err"; status bench_w2_thp $?
python -m neuron_dist.bench -g 2 --ops allreduce -d bfloat16 -b 4K -e 64M -f 4 --vs gloo -n 20 -w 5 --json "$OUT/bench_w2_bf16.json" > "$OUT/bench_w2_bf16.txt" 2>"$OUT/bench_w2_bf16.err"; status bench_w2_bf16 $?
python -m neuron_dist.bench -g 4 --ops all -b 4K -e 64M -f 4 --vs gloo -n 10 -w 3 --json "$OUT/bench_w4.json" > "$OUT/bench_w4.txt" 2>"$OUT/bench_w4.err"; status bench_w4 $?
python -m neuron_dist.bench -g 4 --ops all -b 4K -e 64M -f 4 --vs gloo -n 20 -w 3 --loop --json "$OUT/bench_w4_loop.json" > "$OUT/bench_w4_loop.txt" 2>"$OUT/bench_w4_loop.err"; status bench_w4_loop $?
python -m neuron_dist.bench -g 4 --ops all -b 4K -e 64M -f 4 --vs gloo -n 60 -w 3 --added --json "$OUT/bench_w4_added.json" > "$OUT/bench_w4_added.txt" 2>"$OUT/bench_w4_added.err"; status bench_w4_added $?
python -m neuron_dist.bench_train --steps 10 --warmup 3 --backends neuron,gloo,none --json "$OUT/train.json" > "$OUT/train.txt" 2>&1; status train $?
# the same with torch's huge pages in every process, reference included (what neuronrun sets)
python -m neuron_dist.bench_train --steps 10 --warmup 3 --backends neuron,gloo,none --thp on --json "$OUT/train_thp.json" > "$OUT/train_thp.txt" 2>&1; status train_thp $?
NEURON_DIST_TUNING=model python -m neuron_dist.bench -g 2 --ops allreduce,allgather,reduce_scatter -b 4K -e 64M -f 4 --vs gloo -n 20 -w 5 --json "$OUT/bench_w2_model.json" > "$OUT/bench_w2_model.txt" 2>"$OUT/bench_w2_model.err"; status bench_w2_model $?
# the copy rates again: the 64 MiB bound takes the better of the two, so that one slow minute
# at the start cannot lower the bar (benchmarks/tables.py)
python "$CB" --membw --json "$OUT/membw_end.json" > "$OUT/membw_end.txt" 2>&1; status membw_end $?
{ date; uptime; } >> "$OUT/machine.txt"
if [ -s "$OUT/FAILED" ]; then
  echo "run_all.sh: these commands failed (their output is in $OUT):" >&2
  cat "$OUT/FAILED" >&2
  exit 1
fi
