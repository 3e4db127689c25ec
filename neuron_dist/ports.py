"""A port for a rendezvous that binds it later (the benchmarks' and tests' local jobs, rank 0
under mpirun).

The usual trick, ``bind(("", 0))`` and close, returns a port from the kernel's ephemeral range,
which goes back to that range on close: any socket's ``connect`` or ``bind(0)`` on the host may
take it before the rendezvous binds it, and the job fails with EADDRINUSE (a CI run failed so).
Below the ephemeral range only another explicit bind can take it, as with torch's default port
29500, so the port is drawn there (at random, so that concurrent jobs rarely draw the same one)
and checked free; the kernel's pick where the range cannot be read or leaves no room.
"""
from __future__ import annotations

import random
import socket

LOWEST = 10000  # below: well-known and registered service ports more often in use


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` ("" for every interface) that was free a moment ago."""
    low = ephemeral_low()
    if low > LOWEST + 1024:
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(LOWEST, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
