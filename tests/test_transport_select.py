"""Which transport each pair of ranks uses (transport/select.py): decided from facts both ranks
of the pair publish (their hosts, whether each is an MPI process), so the two ends agree."""
from __future__ import annotations

from datetime import timedelta

import pytest

from neuron_dist.transport import select
from neuron_dist.transport.base import TransportContext, TransportError

HOSTS = ["a", "a", "b", "b"]


def ctx(rank, mpi_ranks=(), hosts=HOSTS):
    return TransportContext(rank=rank, size=len(hosts), store=None, token=1, timeout=timedelta(seconds=5),
                            hostname=hosts[rank], bind_addr="127.0.0.1", hosts=list(hosts),
                            mpi_ranks=list(mpi_ranks), job_id="sel")


@pytest.fixture
def torchrun_worker_under_mpirun(monkeypatch):
    """This process as a torchrun worker that mpirun's agent started: the agent's MPI variables
    and torch's elastic ones."""
    monkeypatch.delenv("NEURON_DIST_TRANSPORT", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")


def test_mpi_only_where_both_ends_are_mpi_processes(torchrun_worker_under_mpirun):
    """Each pair between hosts uses mpi only when both of its ranks published that they are MPI
    processes; a pair with one that is not (a torchrun worker under mpirun) uses zmq, and both
    ends of it say so. This process's own variables do not decide for the others."""
    assert select.plan(ctx(0, [True] * 4)) == {1: "shm", 2: "mpi", 3: "mpi"}
    mixed = [True, True, True, False]
    assert select.plan(ctx(0, mixed)) == {1: "shm", 2: "mpi", 3: "zmq"}
    assert select.plan(ctx(3, mixed)) == {0: "zmq", 1: "zmq", 2: "shm"}
    assert select.plan(ctx(2, mixed)) == {0: "mpi", 1: "mpi", 3: "shm"}
    # no facts published (a forecast before the ranks meet): this process's own, a torchrun
    # worker's here, for every rank
    assert select.plan(ctx(0)) == {1: "shm", 2: "zmq", 3: "zmq"}


def test_forced_mpi_in_a_torchrun_worker_is_a_clear_error(torchrun_worker_under_mpirun):
    with pytest.raises(TransportError, match=r"NEURON_DIST_TRANSPORT=mpi, but rank 3 is no MPI process: it is a "
                                             r"worker of torchrun or neuronrun \(TORCHELASTIC_RUN_ID is set\)"):
        select.plan(ctx(3, [True, True, True, False]), "mpi")


def test_forced_mpi_names_the_peers_that_are_no_mpi_processes(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert select.plan(ctx(0, [True] * 4), "mpi") == {1: "mpi", 2: "mpi", 3: "mpi"}
    with pytest.raises(TransportError, match=r"but ranks 2, 3 are no MPI process \(rank 0 is"):
        select.plan(ctx(0, [True, True, False, False]), "mpi")
