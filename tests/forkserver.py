"""The fork server for the rank processes of tests/test_faults.py, tests/test_lifecycle.py and
tests/test_init_methods.py.

Each rank those tests start is a script run as `python tests/scripts/<script> ARGS` (or
`python -c CODE ARGS`), and nearly all of its CPU went into importing torch (~1.5 s a process on
the CI's 2 cores, most of the suite's time). This server imports torch and torch.distributed
once; every rank is then a forked child that runs its script as `__main__`, with the script's
argv, environment, working directory and sys.path[0] as a fresh `python script.py` would have
them, and ends as such a process does (the script's end or `sys.exit` runs the interpreter's
finalization, atexit hooks and all; an uncaught exception prints its traceback, sets
sys.last_value and exits 1). Nothing else is imported before the fork: the backend
(`neuron_dist`, which reads its environment and registers its exit hook at import) is imported
by the child itself, so a script that registers an exit hook before importing it has that hook
run after the backend's, as in a fresh process. The server never makes a group, runs a torch op
or starts a thread, so every child starts as clean as a fresh interpreter.

The ranks are reaped in order, as run_scripts's `communicate` rank by rank does: rank i only once
ranks 0..i-1 have ended. Until then an ended rank stays a zombie and its pid stays taken, so a
peer still running may open it (a pidfd) as long as the ranks before it run.

Server: `python tests/forkserver.py`, JSON requests on stdin, one reply line each on stdout:
  {"cmd": "start", "ranks": [{"script": PATH | null, "code": SRC | null, "argv": [...], "env": {...},
                              "cwd": DIR | null, "out": PATH, "err": PATH | null}, ...]}  -> {"pids": [...]}
  {"cmd": "wait", "timeout": S, "first_only": bool}  -> {"codes": [...], "timed_out": bool}  (the
      last start's ranks, reaped in order; first_only: once the first rank has ended the others
      are killed; ranks still running at the time-out are killed; codes as subprocess's returncode)
At the end of its input it kills any child still running and exits.

Client (imported by the tests): `run_forked(...)`, as tests/pool.py's run_scripts, and
`start_forked(...)` for a test that acts on the ranks while they run.
"""
import json
import os
import shutil
import sys
import time

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


# ---------------------------------------------------------------------------------------------
# server side (no try/finally on the stack between a fork and the child's script: the child's
# SystemExit or uncaught exception must reach the interpreter's top level as a script's would)

def _exec_child(spec: dict) -> None:
    import builtins
    import types
    fd = os.open(spec["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    if spec.get("err"):  # stderr apart (as capture_output=True has it), else with stdout
        os.close(fd)
        fd = os.open(spec["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.environ.clear()
    os.environ.update(spec["env"])
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    if spec.get("code") is not None:
        path, src = "<string>", spec["code"]
        sys.argv = ["-c", *spec["argv"]]
        sys.path[0] = ""
    else:
        path = spec["script"]
        with open(path) as f:
            src = f.read()
        sys.argv = [path, *spec["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(path))
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    if spec.get("code") is None:
        main.__file__ = path
    sys.modules["__main__"] = main  # kept till the interpreter's finalization, as a script's globals are
    exec(compile(src, path, "exec"), main.__dict__)
    raise SystemExit(0)  # the script's end: the interpreter finalizes (atexit hooks, threads) as after a script


def _reply(obj) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _wait_in_order(pids: list[int], timeout: float, first_only: bool) -> dict:
    """Reap the ranks in order (rank i once ranks 0..i-1 have ended; first_only: rank 0 alone),
    then kill and reap the ones left: those after rank 0 (first_only) or still running at the
    time-out."""
    import select
    deadline = time.monotonic() + timeout
    codes: list = [None] * len(pids)
    timed_out = False
    for i, pid in enumerate(pids[:1] if first_only else pids):
        ended = os.pidfd_open(pid)  # readable once the process has ended
        try:
            timed_out = not select.select([ended], [], [], max(0.0, deadline - time.monotonic()))[0]
        finally:
            os.close(ended)
        if timed_out:
            break
        codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    for pid, code in zip(pids, codes):
        if code is None:
            os.kill(pid, 9)
    for i, pid in enumerate(pids):
        if codes[i] is None:
            codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return {"codes": codes, "timed_out": timed_out}


def _serve() -> None:
    import torch  # noqa: F401  (what every rank's start spent its CPU on)
    import torch.distributed  # noqa: F401
    stdin = os.fdopen(0, "rb", buffering=0)
    pids: list[int] = []
    _reply({"ready": True})
    while True:
        line = stdin.readline()
        if not line:
            break
        req = json.loads(line)
        if req["cmd"] == "start":
            for pid in pids:  # a job started and never waited for (its client gave up) ends first
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            pids = []
            for spec in req["ranks"]:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _exec_child(spec)  # never returns: the child ends as its script does
                pids.append(pid)
            _reply({"pids": pids})
        elif req["cmd"] == "wait":
            _reply(_wait_in_order(pids, req["timeout"], req.get("first_only", False)))
            pids = []
    for pid in pids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


# ---------------------------------------------------------------------------------------------
# client side

class _Server:
    def __init__(self) -> None:
        import subprocess
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(os.environ))
        if json.loads(self._line(300)).get("ready") is not True:
            raise RuntimeError("fork server did not start")

    def _line(self, timeout: float) -> str:
        import select
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"fork server: no answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server ended (status {self.proc.poll()})")
        return line.decode()

    def ask(self, req: dict, timeout: float) -> dict:
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return json.loads(self._line(timeout))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


_SERVER: list = []


def _server() -> _Server:
    if _SERVER and _SERVER[0].proc.poll() is not None:
        _SERVER.clear()
    if not _SERVER:
        import atexit
        _SERVER.append(_Server())
        atexit.register(_stop)
    return _SERVER[0]


def _stop() -> None:
    while _SERVER:
        _SERVER.pop().close()


class Job:
    """The ranks of one job, forked at once: `pids`; `out(i)`, rank i's output so far; `wait()`."""

    def __init__(self, ranks: list[dict]) -> None:
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="forked_job_")
        self.ranks = []
        for i, r in enumerate(ranks):
            env = dict(os.environ if r.get("env") is None else r["env"])
            self.ranks.append(dict(script=r.get("script"), code=r.get("code"), argv=[str(a) for a in r.get("argv", [])],
                                   env=env, cwd=None if r.get("cwd") is None else str(r["cwd"]),
                                   out=os.path.join(self.dir, f"rank{i}.out"),
                                   err=os.path.join(self.dir, f"rank{i}.err") if r.get("split") else None))
        self.server, self.reaped = _server(), False
        try:
            self.pids = self.server.ask({"cmd": "start", "ranks": self.ranks}, 120)["pids"]
        except BaseException:
            _stop()  # a server that did not answer is no use to the next test
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def out(self, i: int, what: str = "out") -> str:
        """Rank i's output so far (what="err": its stderr, where the job was started split)."""
        try:
            with open(self.ranks[i][what], errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait(self, timeout: float = 120, first_only: bool = False) -> list[tuple]:
        """Each rank's (exit status, output with stderr), or (exit status, stdout, stderr) where
        the job was started split, once all have ended, reaped in order as run_scripts's are.
        first_only: once the first rank has ended the others are killed (a test that reads the
        first rank's output only, its peers left running or frozen). Ranks still running after
        `timeout` seconds are killed and the wait fails, as run_scripts's does."""
        import subprocess
        try:
            res = self.server.ask({"cmd": "wait", "timeout": timeout, "first_only": first_only}, timeout + 120)
            outs = [(code, self.out(i)) if self.ranks[i]["err"] is None else (code, self.out(i), self.out(i, "err"))
                    for i, code in enumerate(res["codes"])]
        except BaseException:
            _stop()  # (its children killed as it ends)
            raise
        finally:
            self.reaped = True  # by the server: their pids are no longer this job's to signal
            shutil.rmtree(self.dir, ignore_errors=True)
        if res["timed_out"]:
            raise subprocess.TimeoutExpired([r["script"] or "-c" for r in self.ranks], timeout,
                                            output="\n".join(f"--- rank {i}: status {c[0]}\n{c[1][-2000:]}"
                                                             for i, c in enumerate(outs)))
        return outs


def start_forked(script: str | None, argvs: list[list], env: dict | None = None, code: str | None = None,
                 split: bool = False, cwd: str | None = None) -> Job:
    """Fork `tests/scripts/<script> *argv` (or `python -c code *argv`) for each argv at once, in
    `cwd` if given; split: stderr kept apart from stdout (then wait() gives (status, stdout,
    stderr) per rank)."""
    path = None if script is None else os.path.join(SCRIPTS, script)
    return Job([dict(script=path, code=code, argv=argv, env=env, split=split, cwd=cwd) for argv in argvs])


def run_forked(script: str | None, argvs: list[list], env: dict | None = None, timeout: float = 120,
               code: str | None = None, split: bool = False, cwd: str | None = None,
               first_only: bool = False) -> list[tuple]:
    """tests/pool.py's run_scripts, each rank forked from the server instead of started afresh
    (start_forked's and Job.wait's options)."""
    return start_forked(script, argvs, env, code, split, cwd).wait(timeout, first_only)


if __name__ == "__main__":
    _serve()
