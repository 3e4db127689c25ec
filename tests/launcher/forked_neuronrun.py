"""neuronrun jobs forked from one interpreter that has imported torch once.

Every neuronrun process imports torch (about 1.5 s of CPU); most launcher tests need neuronrun as
a process of its own (its own pid, signals, exit status, rank children, directories) but not a
fresh interpreter. A server process, started once per test process, imports torch and the
launcher, and forks one child per job; the child sets the job's environment, working directory
and standard streams and runs ``neuronrun_launcher.run`` as ``python -m`` runs it (as
``__main__``, with the interpreter's own handling of SystemExit, exceptions and Ctrl-C, then
atexit). ``popen`` returns a ``subprocess.Popen``-like handle on the child (its pid is the
neuronrun pid, its returncode Popen's); ``run`` is ``subprocess.run(..., capture_output=True,
text=True)``. Tests that need a fresh interpreter's start (import timing, the console entry
point, a launcher such as mpirun or ip netns exec) keep starting ``python -m
neuronrun_launcher.run`` themselves.
"""

from __future__ import annotations

import atexit
import io
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

_SERVER: dict = {}


# ---------------------------------------------------------------- client (the test process)

def _server_socket() -> str:
    if _SERVER.get("pid") != os.getpid():  # none yet in this process (or inherited by a fork)
        from launcher_helpers import clean_env

        d = tempfile.mkdtemp(prefix="forked-neuronrun-")
        path = os.path.join(d, "sock")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], env=clean_env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"the fork server did not start ({proc.wait()})"

        def stop(proc=proc, d=d):
            proc.kill()
            proc.wait()
            try:
                os.unlink(path)
                os.rmdir(d)
            except OSError:
                pass

        atexit.register(stop)
        _SERVER.update(pid=os.getpid(), path=path, proc=proc)
    return _SERVER["path"]


def _text(data: bytes) -> str:  # as subprocess's text mode reads a stream
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()


class Job:
    """A neuronrun process forked by the server, read as a subprocess.Popen of it."""

    def __init__(self, args, env=None, cwd=None):
        from launcher_helpers import clean_env

        self.args = args
        self.returncode = None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server_socket())
        req = json.dumps({"argv": list(map(str, args)), "env": dict(env if env is not None else clean_env()),
                          "cwd": os.fspath(cwd) if cwd is not None else os.getcwd()}).encode()
        socket.send_fds(self._conn, [len(req).to_bytes(8, "big")], [0, self._out.fileno(), self._err.fileno()])
        self._conn.sendall(req)
        self._buf = b""
        self.pid = int(self._line(None))

    def _line(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            assert chunk, "the fork server went away"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self):
        if self.returncode is None:
            status = self._line(0)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(int(status))
                self._conn.close()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            status = self._line(timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = os.waitstatus_to_exitcode(int(status))
            self._conn.close()
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        out = []
        for f in (self._out, self._err):
            if f.closed:
                out.append("")
                continue
            f.seek(0)
            out.append(_text(f.read()))
            f.close()
        return tuple(out)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def popen(args, env=None, cwd=None) -> Job:
    """neuronrun ARGS as a forked process (see Job)."""
    return Job(args, env, cwd)


def run(args, *, env=None, timeout: float = 60, cwd=None) -> subprocess.CompletedProcess:
    """launcher_helpers.neuronrun's subprocess.run, on a forked neuronrun."""
    job = popen(args, env, cwd)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        raise
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


# ---------------------------------------------------------------- server

def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(req, fds, inherited):
    """In the forked child: become `python -m neuronrun_launcher.run ARGV` and never return."""
    import atexit as _atexit
    import runpy
    import threading
    import traceback

    code = 1
    interrupted = False
    try:
        for fd in inherited:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                             (signal.SIGCHLD, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL)):
            signal.signal(sig, handler)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # $TMPDIR is the job's
        sys.argv = ["-m", *req["argv"]]
        sys.path[0] = req["cwd"]
        sys.modules.pop("neuronrun_launcher.run", None)  # run afresh as __main__, as `python -m` does
        try:
            runpy.run_module("neuronrun_launcher.run", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except KeyboardInterrupt:
            traceback.print_exc()
            interrupted = True
        except BaseException:  # noqa: BLE001 - the interpreter's report of an uncaught exception
            traceback.print_exc()
            code = 1
        try:
            threading._shutdown()
            _atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code)


def _serve(path: str) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the test process
    # what a neuronrun job imports, once (each job's fork has them)
    import torch  # noqa: F401
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    import neuronrun_launcher.launch  # noqa: F401
    import neuronrun_launcher.run  # noqa: F401
    import neuronrun_launcher.storewatch  # noqa: F401
    import neuronrun_launcher.tail  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    jobs: dict[int, socket.socket] = {}
    conns: list[socket.socket] = []
    while True:
        ready = select.select([listener], [], [], 0.05 if jobs else None)[0]  # reaps every 50 ms while jobs run
        if ready:
            conn, _ = listener.accept()
            conns.append(conn)
            msg, fds, _, _ = socket.recv_fds(conn, 8, 3)
            size = int.from_bytes(msg, "big")
            data = b""
            while len(data) < size:
                data += conn.recv(size - len(data))
            req = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, fds, [listener.fileno(), *(c.fileno() for c in conns)])
            for fd in fds:
                os.close(fd)
            jobs[pid] = conn
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:
                pass
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass
                conns.remove(conn)
                conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
