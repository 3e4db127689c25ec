"""neuronrun: start a PyTorch job like torchrun, with every rank pinned to its NeuronCores.

Usage
-----
    neuronrun [options] train.py [script args]
    neuronrun --nproc-per-node auto train.py                   # one rank per modelled logical NeuronCore
    neuronrun --instance trn1.32xlarge --nproc-per-node 32 train.py
    neuronrun --lnc 1 --cores-per-rank 2 --nproc-per-node auto -m my.module
    neuronrun --dry-run --nproc-per-node 4 train.py            # print the plan, start nothing

neuronrun accepts torchrun's flags (dashed or underscored) and is built on
torch.distributed.elastic: rendezvous, worker monitoring and --max-restarts are
torchrun's. On top, every rank gets the Neuron runtime environment below.

Placement
---------
--instance (default $NEURON_DIST_INSTANCE, else trn2.48xlarge) and --lnc (default
$NEURON_LOGICAL_NC_CONFIG, else the instance's: 2 on trn2, 1 on trn1/inf2) give
k logical cores per chip. Logical core c sits on chip c // k. Local rank l gets
cores l*m .. l*m+m-1 with m = --cores-per-rank (default $NEURON_RT_NUM_CORES, else 1);
m must divide k or be a multiple of it. --nproc-per-node auto = cores / m; asking
for more ranks than cores is an error. Every node uses the same local cores.
If NEURON_RT_VISIBLE_CORES is exported (e.g. by a container's device plugin) it is
the node's pool: ranks are placed inside it, starting at its first core.

Environment of each rank
------------------------
torch's, set by the elastic agent: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
TORCHELASTIC_ERROR_FILE (and OMP_NUM_THREADS=1 when unset and more than one rank;
with --cpu-bind core, the number of CPUs in the rank's share instead).
Neuron's, set by neuronrun:
  NEURON_RT_VISIBLE_CORES   the rank's core, or inclusive range a-b when m > 1
  NEURON_RT_NUM_CORES       m
  NEURON_LOGICAL_NC_CONFIG  the LNC
  NEURON_RT_ROOT_COMM_ID    MASTER_ADDR:(MASTER_PORT+1), the collectives bootstrap root,
                            unless exported by the user (then used as is)
  NEURON_DIST_INSTANCE      the instance, so neuron_dist's topology matches this placement
An exported Neuron variable is respected; one that contradicts a flag is an error.
torch's huge-page switch, set by neuronrun (--thp on, the default):
  THP_MEM_ALLOC_ENABLE=1    torch backs tensors of 2 MiB and more with transparent huge
                            pages: a training step faults its large tensors in about 20
                            times less often (needs THP at madvise or always in
                            /sys/kernel/mm/transparent_hugepage/enabled). An exported value
                            stands; --thp off sets nothing, as torchrun.

Flags from the environment
--------------------------
Each flag --foo-bar not on the command line is read from NEURONRUN_FOO_BAR, then
from torchrun's PET_FOO_BAR (switches: 1/0). Command line wins.

Multi-node
----------
Same command on every node. Static rendezvous (torchrun's default):
    neuronrun --nnodes 2 --node-rank $I --master-addr node0 --master-port 29500 train.py
c10d rendezvous (node ranks assigned on arrival, elastic MIN:MAX allowed):
    neuronrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job7 train.py
Under srun (one task per node) the node count, node rank and master address
come from SLURM_STEP_NUM_NODES/SLURM_NNODES, SLURM_NODEID and the first host of
SLURM_STEP_NODELIST/SLURM_JOB_NODELIST, and the rendezvous id from SLURM_JOB_ID:
    #SBATCH --nodes=4 --ntasks-per-node=1 --exclusive
    srun neuronrun --nproc-per-node auto train.py
Under mpirun (one process per node: mpirun -N 1) they come from
OMPI_COMM_WORLD_SIZE/OMPI_COMM_WORLD_RANK (or PMI_SIZE/PMI_RANK); MPI does not
publish hosts, so pass --master-addr or export MASTER_ADDR (mpirun -x MASTER_ADDR).
--scheduler slurm|mpi|none forces or disables this detection.

Output and failures
-------------------
Each output line is prefixed with the global rank ("[rank3]: ..."; --tee defaults
to 3, unlike torchrun's 0, because the prefix and the failure report need the
per-rank files; set TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE to change the prefix)
and printed whole: an unfinished line waits up to 0.5 s for its newline.
When a rank exits non-zero or is killed, the agent stops the others (SIGTERM, then
SIGKILL after 30 s, torch's fixed grace there; --shutdown-timeout is the grace when
neuronrun itself gets a signal), restarts the group if --max-restarts
allows, and otherwise neuronrun prints the root cause (rank, node, host, exit code
or signal, last lines of its stderr/stdout) and exits with the rank's exit code
(128+N for signal N). Ctrl-C or SIGTERM to neuronrun stops every rank and its
children, and neuronrun then exits 128+N (130, 143; torchrun exits 1); ranks also
die if neuronrun itself is killed. Whatever a rank leaves
running in its process group (it is a session leader) is killed when the next
attempt starts or the job ends. With c10d rendezvous, a node whose ranks have all
ended while its rendezvous store stopped answering (the store's node cut off or
stopped: torch's agent would wait for it forever) says so and exits with 1 once a
call to the store has waited --rdzv-conf read_timeout (60 s by default).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from .cli import parse
from .config import ConfigError, RunConfig, build_config


def config_from_argv(argv: Sequence[str], env: Mapping[str, str] | None = None) -> RunConfig:
    env = os.environ if env is None else env
    try:
        return build_config(parse(argv, env, __doc__), env)
    except ConfigError:
        raise
    except ValueError as exc:  # bad values read from the environment
        raise ConfigError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = config_from_argv(argv)
    except ConfigError as exc:
        print(f"neuronrun: error: {exc}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        from .dryrun import render

        try:
            print(render(cfg), flush=True)
        except BrokenPipeError:  # `neuronrun --dry-run ... | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
        return 0
    from .launch import launch

    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
