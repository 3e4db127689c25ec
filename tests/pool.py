"""Reusable multi-process worker pools for tests.

A `Pool(world)` starts `world` real processes once; each initialises the default process group
on the backend under test ("neuron", with NEURON_DIST_* settings from the environment) plus a
Gloo group over the same ranks for side-by-side comparison. Tests then run rank-side functions
(named "module:function", importable from tests/) on every rank and get each rank's return
value back. A pool whose worker dies or hangs is torn down and restarted for the next test, so
one broken case cannot poison the rest.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

from neuron_dist.ports import free_port  # noqa: F401  (one picker for every test's rendezvous port)

HERE = os.path.dirname(os.path.abspath(__file__))


class WorkerError(AssertionError):
    pass


def run_scripts(script: str, argvs: list[list], env: dict | None = None, timeout: float = 120) -> list[tuple[int, str]]:
    """Start `python tests/scripts/<script> *argv` for each argv at once (the ranks of one job)
    and return each process's (exit status, output with stderr), once all have ended. A rank
    still running when the time-out ends the wait (a hung job) is killed, not left behind."""
    path = os.path.join(HERE, "scripts", script)
    procs = [subprocess.Popen([sys.executable, path, *map(str, argv)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def rank_line(out: str, rank: int) -> str:
    """The line a script's rank printed about how it ended ("rank N: ..."), else the output's tail."""
    return next((line for line in out.splitlines() if line.startswith(f"rank {rank}: ")), out[-2000:])


def _worker(rank: int, world: int, port: int, conn, env: dict, backend: str) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    import neuron_dist  # noqa: F401  registers "neuron"
    import rankctx
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    rankctx.GLOO = dist.new_group(backend="gloo")
    rankctx.RANK, rankctx.WORLD = rank, world
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        target, kwargs = msg
        try:
            mod, fn = target.split(":")
            result = getattr(importlib.import_module(mod), fn)(rank, world, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001 - report everything to the test
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # Skip the interpreter's finalization: its full garbage collections over torch's objects
    # took 8-12 s per worker at world 4 on 2 cores (gdb: gc_collect_main under
    # finalize_modules), all of it after the group had closed. The exit hooks still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Pool:
    def __init__(self, world: int, env: dict | None = None, backend: str = "neuron"):
        self.world, self.env, self.backend = world, dict(env or {}), backend
        self.procs, self.conns = [], []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs, self.conns = [], []
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world, port, child, self.env, self.backend), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        for r, c in enumerate(self.conns):
            if not c.poll(120):
                self.close()
                raise RuntimeError(f"pool of {self.world}: rank {r} did not start")
            c.recv()

    def run(self, target: str, timeout: float = 120, **kwargs) -> list:
        """Run `module:function(rank, world, **kwargs)` on every rank; return the results."""
        for c in self.conns:
            c.send((target, kwargs))
        results, errors = [None] * self.world, []
        deadline = time.time() + timeout
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.time())):
                errors.append(f"rank {r}: no answer within {timeout}s (hung)")
                continue
            try:
                status, value = c.recv()
            except EOFError:
                errors.append(f"rank {r}: worker died (exit code {self.procs[r].exitcode})")
                continue
            if status == "ok":
                results[r] = value
            else:
                errors.append(value)
        if errors:
            self.restart()
            raise WorkerError("\n".join(errors))
        return results

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        self.stop()
        self.join()

    def stop(self) -> None:
        """Ask every worker to leave (close() = stop() + join(): stopping several pools first
        lets them shut down side by side)."""
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass

    def join(self) -> None:
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self.conns = [], []
