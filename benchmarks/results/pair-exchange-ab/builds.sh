#!/bin/bash
# Interleaved builds A/B: stop 42's head (a git worktree) against this pass's head, neuron_dist.bench
# at world 2, 4 KiB-256 KiB, back to back (--loop) and one call at a time, three rounds.
#   git worktree add -f /tmp/s43/base 5eced00
#   bash benchmarks/results/pair-exchange-ab/builds.sh /tmp/s43/base OUTDIR   (from the repository root)
#   python3 benchmarks/results/pair-exchange-ab/cmp.py OUTDIR
BASE=$1; OUT=$2; NEW=$(pwd); mkdir -p "$OUT"
export NEURON_DIST_TUNING=host
for round in 1 2 3; do
  for b in base new; do
    if [ $b = base ]; then P=$BASE; else P=$NEW; fi
    (cd "$P" && PYTHONPATH=$P timeout 600 python -m neuron_dist.bench -g 2 --ops all -b 4K -e 256K -f 4 -n 200 -w 20 \
       --loop --json "$OUT/${b}_loop_$round.json" > "$OUT/${b}_loop_$round.txt" 2>/dev/null)
    (cd "$P" && PYTHONPATH=$P timeout 600 python -m neuron_dist.bench -g 2 --ops all -b 4K -e 256K -f 4 -n 100 -w 10 \
       --json "$OUT/${b}_one_$round.json" > "$OUT/${b}_one_$round.txt" 2>/dev/null)
  done
done
