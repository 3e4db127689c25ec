"""Where this process runs, as a group tells its members' hosts apart, and the one address a
job's listeners bind to.

Pure functions of this process's environment (its CPUs, boot, namespaces, the rendezvous host's
route), read as a group meets (`meeting.py`) and, for the address, by `mpi_env` before any group
exists. Nothing here binds or sends: a UDP connect only asks the kernel for a route.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import zlib

from .errors import GroupError


def cpu_runs() -> list[list[int]]:
    """The CPUs this process may run on (all of them where the OS cannot say), as inclusive
    [first, last] runs: every rank reads every rank's record, so it stays a few bytes."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return runs


def machine_key() -> str:
    """What ranks of one host name must share to meet through shared memory and know each
    other's pids: the boot (two machines given one host name), /dev/shm's file system (an IPC
    or mount namespace of its own) and the PID namespace (containers on one host network, each
    with its own pids: a peer's published pid means another process here, or none), as NCCL's
    host and PID hashes tell them apart. A crc of the three, each "" where unreadable."""
    parts = []
    for read in (lambda: open("/proc/sys/kernel/random/boot_id").read().strip(),
                 lambda: str(os.stat("/dev/shm").st_dev), lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return f"{zlib.crc32('|'.join(parts).encode()):08x}"


def host_identities(peers_info: list[dict]) -> list[str]:
    """Each member's host as the group uses it (which transport, whose pids to watch, which
    node): its host name, qualified with its machine key when that differs from the key of
    the first member of that name (so two containers of one host name, in PID namespaces of
    their own, are two hosts that talk over the network). The same list on every member."""
    first = {}
    for p in peers_info:
        first.setdefault(p["host"], p.get("machine"))
    return [p["host"] if p.get("machine") == first[p["host"]] else f"{p['host']} [{p.get('machine')}]"
            for p in peers_info]


def store_host(store) -> str | None:
    """The host of the TCPStore under (possibly nested) PrefixStores, if that is what it is."""
    for _ in range(16):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def unbracket(a: str) -> str:
    """"[::1]" -> "::1" (IPv6 addresses are written in brackets in URLs)."""
    return a[1:-1] if a.startswith("[") and a.endswith("]") else a


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def forced_bind_addr() -> str | None:
    """NEURON_DIST_BIND_ADDR, checked for every group (a one-host job does not use it, but a
    wildcard, or a word that is no address, could never work: a mistake to report, not to
    ignore; whether an address is this host's is found only where it is used, when a job spans
    hosts)."""
    forced = (os.environ.get("NEURON_DIST_BIND_ADDR") or "").strip()
    if not forced:
        return None
    addr = unbracket(forced)
    if addr in ("0.0.0.0", "::", "*"):
        raise GroupError(f"NEURON_DIST_BIND_ADDR={forced!r} would listen on every interface, and peers "
                         f"cannot reach an address of that form; give this host's address on the job's network")
    try:  # checked here too, not only where a job spans hosts: a one-host job took any word silently
        ipaddress.ip_address(addr)
    except ValueError:
        raise GroupError(f"NEURON_DIST_BIND_ADDR={forced!r} is not an IPv4 or IPv6 address; give this host's "
                         f"address on the job's network") from None
    return addr


def route_from(host: str, what: str = "the rendezvous host") -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP connect only asks
    the kernel for the route)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0]
    except OSError as e:
        raise GroupError(f"cannot resolve {what} {host!r} to choose the interface to bind ({e}); "
                         f"set NEURON_DIST_BIND_ADDR") from None
    ip = sockaddr[0]
    if is_loopback(ip):
        return "::1" if family == socket.AF_INET6 else "127.0.0.1"
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError as e:
            raise GroupError(f"no route to {what} {host} ({ip}): {e}; set NEURON_DIST_BIND_ADDR") from None


def bind_addr(store=None) -> str:
    """The address this job's traffic uses, and the only one our listeners bind to: the
    interface that routes to the rendezvous host (NEURON_DIST_BIND_ADDR overrides). A job whose
    rendezvous is on loopback stays on loopback; nothing ever binds to every interface. IPv4 or
    IPv6, as the rendezvous host resolves. (`GroupMeeting._job_addr` corrects a loopback answer for a
    group that spans hosts.)"""
    forced = forced_bind_addr()
    if forced:
        return forced
    master = os.environ.get("MASTER_ADDR") or store_host(store)
    if not master:  # file:// rendezvous: this host's own address
        master = socket.gethostname()
    return route_from(unbracket(master), "the rendezvous host (MASTER_ADDR)" if os.environ.get("MASTER_ADDR")
                       else "the rendezvous host")
