#!/usr/bin/env bash
# The 8- and 16-rank tables of issue 5 ("On a 16-core host ... at least 3x Gloo at every size
# from 1 MiB"), on a borrowed 16-core machine whose image has its own Python and torch (pyzmq is
# carried as a wheel in .whl/) and no network. Writes each table as text and JSON under $RES
# (default benchmarks/results/sixteen-cores), and with $OUT set (the borrowed machine's folder
# that comes back, which takes at most 8 files) every line to $OUT/log.txt as it comes, so a run
# cut short keeps what it measured, and all of $RES to $OUT/tables.tgz at the end. A failed
# two-rank smoke run ends it at once (the image's torch is not the pinned one). Then the target's
# runs (all-reduce, all-gather, reduce-scatter from 1 MiB at 8 and 16 ranks) and, in the time
# left, the other collectives of the tables from 4 KiB (`run_16core.sh tables`, the default), or
# the 16-rank rows again beside settings they may depend on (`run_16core.sh variants`), or the
# target's rows again between two measurements of the copy rates (`run_16core.sh repeat`), or
# each algorithm forced at 1-16 MiB (`run_16core.sh algos`).
set -u
RES=${RES:-benchmarks/results/sixteen-cores}
LOG=${OUT:+$OUT/log.txt}
LOG=${LOG:-/dev/null}
BUDGET_S=${BUDGET_S:-480}
mkdir -p "$RES"
start=$(date +%s)
export PYTHONUNBUFFERED=1
export NEURON_DIST_TUNING=${NEURON_DIST_TUNING:-host}  # as RESULTS.md's tables: pick by host speed
# 16 ranks map 15 rings of 2 MiB each: a container-sized /dev/shm (64 MiB) would refuse them
if (($(df --output=avail -k /dev/shm | tail -1) < 4 << 20)); then
    mount -o remount,size=16G /dev/shm 2>&1 | tee -a "$LOG"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{
    date -u; nproc; uname -r
    lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node|L3"
    python3 -c "import sys, torch, zmq; print(sys.version.split()[0], 'torch', torch.__version__, 'pyzmq', zmq.__version__)"
    df -h /dev/shm | tail -1
    echo "NEURON_DIST_TUNING=$NEURON_DIST_TUNING"
    git rev-parse --short HEAD 2>/dev/null
} 2>&1 | tee "$RES/machine.txt" | tee -a "$LOG"

run() {  # run NAME TIMEOUT ARGS...: one bench invocation, if the budget still allows it
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET_S - ($(date +%s) - start)))
    ((left < 20)) && { echo "skipped $name: ${left}s left" | tee -a "$RES/skipped.txt" "$LOG"; return; }
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s): python3 -m neuron_dist.bench $*" | tee -a "$LOG"
    timeout -k 5 "$limit" python3 -m neuron_dist.bench "$@" --json "$RES/$name.json" 2>&1 | tee "$RES/$name.txt" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name rc=$rc after $(($(date +%s) - start))s" | tee -a "$LOG"
    return "$rc"
}

run smoke_w2 60 -g 2 --ops allreduce -b 4K -e 1M -f 16 -n 5 -w 2 --no-progress || exit 1
CORE="--ops allreduce,allgather,reduce_scatter -b 1M -e 64M -f 4 --vs gloo -n 10 -w 3"
case "${1:-tables}" in
tables)
    run core_w8 120 -g 8 $CORE
    run core_w16 180 -g 16 $CORE
    run rest_w8 90 -g 8 --ops broadcast,alltoall,sendrecv -b 4K -e 64M -f 4 --vs gloo -n 10 -w 3
    run rest_w16 120 -g 16 --ops broadcast,alltoall,sendrecv -b 4K -e 64M -f 4 --vs gloo -n 10 -w 3
    run small_w16 60 -g 16 --ops allreduce,allgather,reduce_scatter -b 4K -e 256K -f 4 --vs gloo -n 10 -w 3
    ;;
variants)  # what the 16-rank rows depend on: the spin before sleeping, the ring, the frame size
    run again_w16 60 -g 16 $CORE
    NEURON_DIST_SHM_SPIN_US=1000 run spin1000_w16 60 -g 16 $CORE
    NEURON_DIST_SHM_SPIN_US=10000 run spin10000_w16 60 -g 16 $CORE
    NEURON_DIST_ALGO=allreduce:ring run ring_w16 40 -g 16 --ops allreduce -b 1M -e 64M -f 4 --vs gloo -n 10 -w 3
    NEURON_DIST_FRAME_BYTES=2097152 run frame2m_w16 60 -g 16 $CORE
    NEURON_DIST_SHM_SPIN_US=1000 run spin1000_w8 50 -g 8 $CORE
    NEURON_DIST_SHM_SPIN_US=10000 run spin10000_w8 50 -g 8 $CORE
    run loop_w16 60 -g 16 ${CORE/-n 10/-n 20} --loop
    NEURON_DIST_SHM_SPIN_US=10000 run loop_spin10000_w16 60 -g 16 ${CORE/-n 10/-n 20} --loop
    ;;
repeat)  # the target's rows once more, between two measurements of the host's copy rates
    membw() {  # the shared collbench.py (../shared/tools, carried as .tools/) measures them
        [ -f .tools/collbench.py ] || return 0
        timeout 60 python3 .tools/collbench.py --membw -n 10 --json "$RES/membw_$1.json" 2>&1 | tee "$RES/membw_$1.txt" | tee -a "$LOG"
    }
    membw start
    run core_w8 60 -g 8 $CORE
    run core_w16 60 -g 16 $CORE
    membw end
    ;;
algos)  # 1-16 MiB, where the rows are latency-bound: each algorithm forced on all three
    SIZES="-b 1M -e 16M -f 4 --vs gloo -n 10 -w 3"
    for g in 16 8; do
        for a in ring direct torus; do
            NEURON_DIST_ALGO="allreduce:$a;allgather:$a;reduce_scatter:$a" run ${a}_w$g 40 -g $g --ops allreduce,allgather,reduce_scatter $SIZES
        done
        NEURON_DIST_ALGO="allreduce:rdh" run rdh_w$g 30 -g $g --ops allreduce $SIZES
    done
    ;;
esac
echo "/dev/shm after: $(ls /dev/shm | head)" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then tar czf "$OUT/tables.tgz" -C "$RES" .; fi
