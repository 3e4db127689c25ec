"""How a group's members meet through the store, before any data moves.

Each member posts its member list, then its set-up (host, pid, CPUs, placement, settings that
must agree), under keys its generation of the group keeps apart from every earlier group of the
same name on the same store; every member reads every record, so they build the same topology and
fail alike on a disagreement; the transports connect; the last member up deletes the records.
`Group` (group.py) inherits these methods and starts its engine once they are done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import zlib
from datetime import timedelta

import torch.distributed as dist

from . import hosts
from .config import env, env_int
from .errors import GroupError, headline
from .mpi_env import adopted_note
from .transport.base import TransportContext

log = logging.getLogger("neuron_dist.init")
topo_log = logging.getLogger("neuron_dist.topology")

# torch's rank numbers, which `mpi_env.adopt` may have taken from a launcher's variables
_NUMBERING_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def slot_record(rank: int, size: int) -> dict:
    """`Group._placement_info`'s record, from this process's environment."""
    from . import topology
    from .topology.placement import node_named, placement_before_hosts
    env = os.environ
    world_rank = int(env.get("RANK", rank))
    world = int(env.get("WORLD_SIZE", size))
    node_given = node_named(env)  # (the node variables placement reads)
    local_rank = env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK"))
    by_host = None  # the cores it takes by its local rank where its host decides that (see _build_topology)
    if local_rank is None and not node_given:  # (tcp:// or file:// with rank and world size, say)
        slot, by_host = placement_before_hosts(env, world_rank, world)
    else:
        local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world)))
        local_rank = int(world_rank if local_rank is None else local_rank)
        slot = topology.placement_from_env(env, world_rank, world, local_rank, local_world)
    # what this rank's model of the instance holds, not only its name: ranks that load
    # different descriptions under one name (a file, register_instance on some ranks,
    # versions of neuron_dist) built different rings and waited for each other at the first
    # collective; compared with the other settings every rank must share as the group meets
    model = {k: v for k, v in topology.get_instance(slot.instance).to_dict().items() if k not in ("sources", "notes")}
    digest = f"{slot.instance} {zlib.crc32(json.dumps(model, sort_keys=True).encode()):08x}"
    return {"slot": slot.to_dict(), "node_given": node_given, "model": digest, "by_host": by_host}


LOCAL_COUNTS: dict[str, int] = {}  # Group._generation's count where the store cannot add


def elastic_attempt() -> int:
    """Which attempt of an elastic job this process belongs to, where that keeps attempts apart:
    TORCHELASTIC_RESTART_COUNT, set by torch's agent for every worker, when the ranks use the
    agent's store, which lives on across attempts (TORCHELASTIC_USE_AGENT_STORE). Otherwise 0
    (outside torchrun/neuronrun, or a store made afresh for each round, as neuronrun asks for
    with c10d rendezvous over several nodes): there a node's count can differ from another's in
    one round (a round begun by another node's failure does not raise it), and keys that carried
    it would keep the round's ranks from meeting."""
    if env("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return 0
    return env_int("TORCHELASTIC_RESTART_COUNT", 0, minimum=0)


def retire_generation(store, key: str, generation: int, size: int) -> None:
    """A group whose forming failed (a member that never came: a rank's `new_group` that timed
    out alone, with `use_local_synchronization`) may have left its generation's count short of
    `size` adds: the next attempt's adds then split across two generations and its members met
    under different keys, again and again (the retry never formed, where Gloo's did). The count
    is raised to the generation's end, so the next attempt starts a fresh one; no generation is
    met twice, so keys a failed attempt left are never read. Best effort: a store that is gone
    leaves the error that brought us here to be raised."""
    end = (generation + 1) * size
    try:
        for _ in range(64):  # compare-and-set: a late member's add in between is kept, not undone
            now = int(store.add(key, 0))
            if now >= end or int(store.compare_set(key, str(now), str(end))) >= end:
                return
    except (RuntimeError, NotImplementedError, ValueError):  # the store is gone, or cannot compare
        if key in LOCAL_COUNTS:  # (a store without add: this process's own count)
            LOCAL_COUNTS[key] = max(LOCAL_COUNTS[key], end)


# (group name, global rank) of each group this process is forming now (`forming`)
_FORMING: set[tuple[str, int]] = set()
_FORMING_LOCK = threading.Lock()


@contextlib.contextmanager
def forming(name: str, global_rank: int, who: str):
    """Mark group `name` as forming in this process while the block runs; a second group of that
    name begun meanwhile is refused at once, before it touches the store. torch names a group
    that `new_group(..., use_local_synchronization=True)` makes by its ranks and its count of
    groups, so threads of one rank calling it at the same time get one name and one store
    prefix: they shared the name's generation count, two threads met as the same member, and
    every call failed at 1-3 times the time-out, or hung. torch keeps one group of a name (under
    Gloo the others formed, then failed to register; with three threads one hung in new_group);
    here the first thread of each rank forms it alone and meets the peers' first threads. Yields
    whether another group of this process is forming meanwhile (see `own_connection`).
    `who`: this member as errors name it."""
    key = (name, global_rank)
    with _FORMING_LOCK:
        if key in _FORMING:
            raise GroupError(f"[{who}] group {name!r}: another thread of this process is forming a group of this "
                             f"name (torch names groups that new_group(..., use_local_synchronization=True) makes "
                             f"at the same time with the same ranks alike), and only one group of a name can "
                             f"exist; call new_group for them one after another")
        beside_others = bool(_FORMING)
        _FORMING.add(key)
    try:
        yield beside_others
    finally:
        with _FORMING_LOCK:
            _FORMING.discard(key)


def own_connection(store):
    """A connection to `store` of the group's own, for a group formed while another group of this
    process forms: a TCPStore client answers one call at a time, so one group's store wait (up to
    its time-out) held up every call of the other, and groups of different names that threads
    formed side by side (new_group without use_local_synchronization) waited for one another's
    time-outs and failed at several times theirs, where each could form. Only then, as a clone
    costs: one more descriptor for the group's life, and a connect to a store whose host is gone
    waits out the store's time-out where the shared connection fails at once. A store that
    cannot be cloned (one written in Python) is shared."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - RuntimeError: a Python Store has no clone
        return store


# a group's set-up records per rank, as "{family}/{rank}{tail}" (`_forget_setup`): written by
# `_meet` (peer, peer_read), `_job_addr` (addr) and the transports' set-up (transport/shm.py,
# zmq_transport.py, mpi.py; each transport's own key)
SETUP_RECORDS = (("peer", ("",)), ("peer_read", ("",)), ("addr", ("",)), ("shm", ("", "/mapped")),
                  ("zmq", ("",)), ("mpi", ("",)))
# the job id of this process's current world (its default group, while it is open): it scopes
# the member lists its subgroups post as they meet (`Group._agree_on_members`)
WORLD: dict[str, str | None] = {"id": None}


def forget(store, key: str) -> None:
    """Delete `key` from `store`, where the store can (best effort: a caller's store may not)."""
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001 - NotImplementedError, or the store is gone
        pass


class GroupMeeting:
    """The meeting's half of `Group`: what its members agree on, and how they connect."""

    def _meet(self, store, members: str, placement, placement_error, forced, choice: dict) -> None:
        """Meet the peers under this group's generation of the store (agree on the members, the
        token, every rank's set-up) and connect the transport (`Group._start_engine` follows). Its
        failure retires the generation (`retire_generation`), so that the next attempt meets afresh."""
        from .transport import select as transport_select
        rank, size, name, timeout = self.rank, self.size, self.name, self.timeout
        # a subgroup's member lists are its world's: a later world on this store (torchrun's
        # agent store, one passed again) whose group torch names alike, with other members, never
        # reads them as a member's disagreement; a late member that disagrees still finds them
        default = not dist.is_initialized()  # (the default group is made before torch counts it made)
        scope = None if default else WORLD["id"]
        lists = f"members/{scope}/" if scope else "members/"
        self._agree_on_members(store, lists)
        meeting = store
        # keys of this member list only: processes that called new_group with other ranks may
        # share this group's name (and a group rank) but never its keys
        store = self.store = dist.PrefixStore(f"members-{members}/", store)
        # the token authenticates every frame; the job id names the group's shared-memory segments
        # and IPC sockets, which any local user can list (/dev/shm, /proc/net/unix), so it is
        # drawn apart from the token: a name derived from it gave away 48 of its 63 bits
        if rank == 0:
            store.set("token", f"{secrets.randbits(63)} {secrets.token_hex(6)}")
        token, job_id = store.get("token").split()
        self.token, self.job_id = int(token), job_id.decode()
        try:  # a value that can never work is an error on every job, told to the peers like a bad placement
            hosts.forced_bind_addr()
        except GroupError as e:
            placement, placement_error = None, placement_error or e
        me = {"host": socket.gethostname(), "machine": hosts.machine_key(), "pid": os.getpid(),
              "cpus": hosts.cpu_runs(), "mpi": transport_select.is_mpi_rank(), "frame_bytes": self.frame_bytes,
              "transport": forced, **choice}
        me.update(placement or {"error": f"{type(placement_error).__name__}: {placement_error}"})
        store.set(f"peer/{rank}", json.dumps(me))
        try:
            store.wait([f"peer/{r}" for r in range(size)], timeout)
        except Exception as e:  # noqa: BLE001 - the store's time-out (DistStoreError) or its loss
            raise GroupError(f"[rank {rank}] group {name!r}: the members met, but not every one published its "
                             f"set-up within {timeout.total_seconds():.0f}s (a member that died or left meanwhile): "
                             f"{headline(e)}") from None
        # every member has read every member list (each publishes its set-up only after): an
        # unscoped one (a world's own, or a subgroup's of a world not on this backend) goes, lest a
        # later world on this store whose group has other members meet under the same generation
        # and read it as a member's disagreement
        if not scope:
            forget(meeting, f"{lists}{self.global_ranks[rank]}")
        self.peers_info = [json.loads(store.get(f"peer/{r}")) for r in range(size)]
        store.set(f"peer_read/{rank}", "1")
        bad = [(r, p["error"]) for r, p in enumerate(self.peers_info) if "error" in p]
        # every rank cuts messages into frames of this size, and each checks the peer's frames
        # against its own cut: ranks that differ would fail at their first collective, on sizes;
        # ranks that force different transports would each wait for the other's records; ranks
        # that choose algorithms differently (one host's environment forcing a ring, another's a
        # hierarchical grid) send to disjoint peers and wait out the time-out at their first call
        settings = {var: [p.get(key) for p in self.peers_info]
                    for var, key in (("NEURON_DIST_FRAME_BYTES", "frame_bytes"), ("NEURON_DIST_TRANSPORT", "transport"),
                                     ("the instance description (name and digest)", "model"),
                                     ("NEURON_DIST_ALGO", "algo"), ("NEURON_DIST_TUNING", "tuning"))}
        differ = [var for var, values in settings.items() if len(set(values)) > 1]
        if bad or differ:
            self._stay_until_read(store)
            if placement_error is not None:
                raise placement_error
            if bad:
                raise GroupError(f"[rank {rank}] group {name!r} cannot be built: " + "; ".join(
                    f"{self.who(r)} cannot take part: {why}" for r, why in bad))
            var = differ[0]
            raise GroupError(f"[rank {rank}] group {name!r} cannot be built: the ranks disagree on {var} ("
                             + ", ".join(f"rank {r}: {v if v else 'unset'}" for r, v in enumerate(settings[var]))
                             + "); set it alike on every rank")
        self.hosts = hosts.host_identities(self.peers_info)
        host = self.hosts[rank]
        try:
            self.topology, self.order = self._build_topology()
        except (GroupError, ValueError) as e:  # every rank finds it in the same records
            self._stay_until_read(store)
            note = adopted_note(_NUMBERING_VARS)  # (two ranks given one local rank by their launcher's variables)
            if note and isinstance(e, ValueError):
                raise ValueError(f"{e}{note}") from None
            raise
        # the CPUs this group's ranks on this host may run on, together (each may be bound to one)
        local_cpus = {c for p, h in zip(self.peers_info, self.hosts) if h == host
                      for first, last in p.get("cpus", ()) for c in range(first, last + 1)}
        try:  # only a job that spans hosts listens on TCP (one host: shm or IPC)
            bind_addr = self._job_addr(me, store) if len(set(self.hosts)) > 1 else "127.0.0.1"
        except GroupError as e:  # (an unresolvable MASTER_ADDR on this host, say): the peers
            err = e if str(e).startswith("[rank") else GroupError(f"[rank {rank}] {e}")
            transport_select.publish_failure(store, rank, str(err))  # would wait to connect to us
            raise err from None
        ctx = TransportContext(rank=rank, size=size, store=store, token=self.token, timeout=timeout,
                               hostname=host, hosts=self.hosts, bind_addr=bind_addr,
                               mpi_ranks=[bool(p.get("mpi")) for p in self.peers_info],
                               job_id=self.job_id, local_cpus=len(local_cpus),
                               pids=[int(p.get("pid") or 0) for p in self.peers_info])
        self.transport = transport_select.create(ctx)
        self._forget_setup(store)

    # -- topology ----------------------------------------------------------------------------
    def _placement_info(self) -> dict:
        """This rank's slot (node, chip, cores) from the launcher's environment: published to
        the group so every rank builds the same topology, hence the same ring."""
        try:
            return slot_record(self.rank, self.size)
        except ValueError as e:  # ("bad rank numbers" may be values neuron_dist adopted: say whose)
            raise ValueError(f"{e}{adopted_note(_NUMBERING_VARS)}") from None

    def _forget_setup(self, store) -> None:
        """Once every member's transport is up, every member has read every set-up record: the
        last member to get here deletes them all (best effort: a caller's store may not add or
        delete), so that a job making groups again and again does not grow the store by five
        keys per member per group (review AC: 1,000 two-rank subgroups made and destroyed left
        12,000 keys and 13 MB in the store's process; Gloo's leave 2,000). What stays: the
        member lists of a subgroup (`_meet`), `progress/` records (diagnosis) and the count of
        the name's generations."""
        try:
            if int(store.add("set-up", 1)) != self.size:
                return
        except Exception:  # noqa: BLE001
            return
        for key in ["token", "set-up"] + [f"{family}/{r}{tail}" for r in range(self.size)
                                          for family, tails in SETUP_RECORDS for tail in tails]:
            forget(store, key)

    def _stay_until_read(self, store) -> None:
        """Before a set-up error every rank finds in the records: rank 0's process may host the
        store, so it stays until every peer has read them (a peer still reading met a closed
        store: "DistNetworkError: Failed to recv", not the error)."""
        if self.rank != 0:
            return
        try:
            store.wait([f"peer_read/{r}" for r in range(1, self.size)], min(self.timeout, timedelta(seconds=30)))
        except Exception:  # noqa: BLE001 - a peer that never comes learns it at its own time-out
            pass

    def _build_topology(self):
        """The group's agreed topology (from every rank's published slot) and its ring order.

        Without a node number from the launcher (GROUP_RANK, NODE_ID, NODE_RANK), a rank's node
        was guessed as rank // LOCAL_WORLD_SIZE, which holds only for ranks laid out node by
        node; when the members' host names show several hosts, the hosts decide instead (nodes
        numbered in order of first appearance). A rank with neither a node number nor LOCAL_RANK
        (published `by_host`) is placed here, by its host (`placement.place_by_host`): taken for
        local rank `rank` of `world_size`, every multi-host job started so was refused ("4
        processes per node but ... only 2")."""
        from . import topology
        from .topology.placement import place_by_host
        slots = [topology.Slot.from_dict(p["slot"]) for p in self.peers_info]
        by_host = [p.get("by_host") for p in self.peers_info]
        if any(m is not None for m in by_host):
            try:
                slots = place_by_host(slots, self.hosts, by_host)
            except ValueError as e:
                raise GroupError(f"[rank {self.rank}] group {self.name!r} cannot be placed: {e} (no LOCAL_RANK or "
                                 f"node number was given, so each host's ranks share one node)") from None
        if len(set(self.hosts)) > 1 and not any(p.get("node_given") for p in self.peers_info):
            node_of = {h: i for i, h in enumerate(dict.fromkeys(self.hosts))}
            slots = [dataclasses.replace(s, node=node_of[h]) for s, h in zip(slots, self.hosts)]
        else:  # the launcher's node numbers stand: ranks on two hosts cannot share a node's cores
            first: dict[int, tuple[int, str]] = {}
            for r, (s, h) in enumerate(zip(slots, self.hosts)):
                q, other = first.setdefault(s.node, (r, h))
                if other != h:
                    raise GroupError(
                        f"[rank {self.rank}] group {self.name!r}: ranks {q} and {r} run on different hosts ({other}; "
                        f"{h}) but both on node {s.node} by the launcher's node number (GROUP_RANK, NODE_ID or "
                        f"NODE_RANK): give each host its own, or set none and the hosts decide")
        topo = topology.GroupTopology(topology.get_instance(slots[0].instance), slots)
        topo.validate()
        order = list(topology.ring_order(topo))
        topo_log.debug("rank %d group %s: instance %s, placement %s, ring %s", self.rank, self.name,
                       topo.instance.name, [s.to_dict() for s in slots], order)
        return topo, order

    def _job_addr(self, me: dict, store) -> str:
        """The address to listen on in a group that spans hosts (every member calls this, and
        publishes its answer). The route to the rendezvous host is loopback on that host itself
        when its name resolves to 127.0.1.1 (Debian's and Ubuntu's /etc/hosts): peers on other
        hosts would then dial their own loopback. Such a rank takes its address on the route to
        a rank on another host instead."""
        forced, addr = hosts.forced_bind_addr(), ""
        try:
            addr = hosts.bind_addr(store)  # the forced address, if any
        finally:  # published even when it failed, so that no member waits for it
            store.set(f"addr/{self.rank}", addr)
        if forced or not hosts.is_loopback(addr):
            return addr
        if all(p["host"] == me["host"] for p in self.peers_info):  # one machine, its "hosts" namespaces
            return addr                                          # of it that reached the store on loopback
        for r, p in enumerate(self.peers_info):
            if p["host"] == me["host"]:
                continue
            theirs = store.get(f"addr/{r}").decode()
            if theirs and not hosts.is_loopback(theirs):
                mine = hosts.route_from(theirs, f"rank {r}'s address")
                if not hosts.is_loopback(mine):
                    log.debug("rank %d: the rendezvous host is loopback here; listening on %s, the route "
                              "to rank %d (%s)", self.rank, mine, r, theirs)
                    return mine
        raise GroupError(f"[rank {self.rank}] group {self.name!r} spans hosts {sorted(set(self.hosts))}, but "
                         f"this host reaches the rendezvous host over loopback ({addr}) and no rank on another "
                         f"host has an address to route to: set MASTER_ADDR to an address every host reaches, "
                         f"or NEURON_DIST_BIND_ADDR to this host's address on the job's network")

    def _generation(self, store, attempt: int, members: str) -> tuple[str, int]:
        """How many groups of these members this store has seen by this name before (and the
        count's key), counted in the store: each member adds one, and none can start the next
        such group before every member has added for this one (_agree_on_members waits for them
        all), so the n-th group is the one whose adds are n*size+1..(n+1)*size; a generation that
        failed before every member added is retired (`retire_generation`). A count kept in each
        process went wrong where processes had different pasts (one ran a world of its own in
        between; a process not in an earlier world's subgroup never counted that name): the ranks
        met under different keys and waited out the time-out, where Gloo formed the group. The
        member list is in the key, not in the meeting's keys: ranks that disagree on it still
        meet there and are told so at once (the lists they post there are their world's:
        `_meet`). `members`: the member list's key (a checksum of the global ranks)."""
        key = f"gen-{attempt}/groups/{members}"
        try:
            k = store.add(key, 1)
        except dist.DistNetworkError:  # the store is gone (its host), not one without add: the caller says so
            raise
        except (RuntimeError, NotImplementedError):  # a store of the caller's without add (Gloo needs none):
            k = LOCAL_COUNTS[key] = LOCAL_COUNTS.get(key, 0) + self.size  # this process's own count, as before
            log.debug("rank %d: the store has no add; group %r counts its generations in this process",
                      self.rank, self.name)
        return key, (k - 1) // self.size

    def _agree_on_members(self, store, lists: str = "members/") -> None:
        """Every member must have called new_group with the same ranks, checked before this
        group writes anything else. Each process posts its member list under its *global* rank
        (ranks that disagree may share a group rank, never a global one), below `lists`, and
        reads every member's: a disagreement, or a member that never comes, is a clear error at
        once or at the group's time-out, never a group whose ranks mean different processes. A
        rank that gives up on a member takes its own list back (it would mislead a later world
        on this store)."""
        mine = self.global_ranks
        store.set(f"{lists}{mine[self.rank]}", json.dumps(mine))
        try:
            store.wait([f"{lists}{g}" for g in mine], self.timeout)
        except Exception as e:  # noqa: BLE001 - the store's time-out (DistStoreError) or its loss
            try:
                missing = [g for g in mine if not store.check([f"{lists}{g}"])]
            except Exception:  # noqa: BLE001 - the store itself is gone (its host, rank 0, left)
                raise GroupError(f"[rank {self.rank}] group {self.name!r} (global ranks {mine}): the store was "
                                 f"lost while the members met: {e}") from None
            forget(store, f"{lists}{mine[self.rank]}")
            # the default group is made inside init_process_group, before torch counts it initialized
            todo = ("new_group with the same ranks" if dist.is_initialized() else
                    f"init_process_group: were all {self.size} ranks (WORLD_SIZE) started?")
            raise GroupError(f"[rank {self.rank}] group {self.name!r} (global ranks {mine}): global ranks {missing} "
                             f"did not join within {self.timeout.total_seconds():.0f}s; every process must call "
                             f"{todo}") from None
        views = {g: json.loads(store.get(f"{lists}{g}")) for g in mine}
        other = {g: v for g, v in views.items() if v != mine}
        if other:
            theirs = "; ".join(f"global rank {g}: {v}" for g, v in other.items())
            raise GroupError(f"[rank {self.rank}] group {self.name!r}: ranks disagree on the group's members "
                             f"(global rank {mine[self.rank]}, this process: {mine}; {theirs}); call new_group "
                             f"with the same ranks on every process")
