#!/usr/bin/env bash
# The commit before this pass (a git worktree at BASE) against the working tree, interleaved:
# collbench back to back (nccl-tests --loop style, 4 KiB-1 MiB all-reduce) and call_anatomy's
# modes at 4 KiB, ROUNDS rounds. Usage: ab_builds.sh BASE_DIR OUT_DIR [ROUNDS]
set -u
BASE=$1; OUT=$2; R=${3:-3}
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
CB=${COLLBENCH:-$NEW/../shared/tools/collbench.py}
export NEURON_DIST_TUNING=${NEURON_DIST_TUNING:-host}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
for i in $(seq "$R"); do
  for b in base new; do
    P=$NEW; [ "$b" = base ] && P=$BASE
    (cd /tmp && PYTHONPATH=$P python "$CB" --backend neuron --import neuron_dist --op allreduce -g 2 -b 4K -e 1M -f 4 \
        --loop -n 200 -w 20 --json "$OUT/loop_${b}_$i.json" > "$OUT/loop_${b}_$i.txt" 2>&1)
    (cd /tmp && PYTHONPATH=$P torchrun --nproc-per-node 2 "$NEW/benchmarks/call_anatomy.py" --iters 300 \
        2>&1 | grep -v "^W1205\|OMP_NUM\|\*\*\*\*" > "$OUT/anatomy_${b}_$i.txt")
  done
done
