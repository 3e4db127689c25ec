"""A fork server for tests/test_faults.py's multi-process jobs: it imports torch, torch.distributed
and neuron_dist once, then forks every rank of every job it is sent, so that a rank starts in a
fraction of a second instead of importing torch again (~1.5 s of CPU per process).

Each rank is a fresh child that runs its script (or `-c` code) as `__main__` at this
interpreter's top level, so that it ends as `python script.py` would: an uncaught exception is
printed, sets sys.last_value and runs the exit handlers (neuron_dist's `_close_at_exit`) with
exit status 1, sys.exit(N) is status N, os._exit and signals are what they are. The server
itself starts no group and no thread of its own.

Protocol: one JSON request a line on stdin, {"argvs": [[...], ...], "path": P | "code": C,
"env": {...}, "cwd": D | null, "split": bool (stderr apart from stdout), "timeout": S, "first_only": bool, "fresh": [rank, ...]}; one JSON answer a line on
stdout: {"outs": [[status, output], ...]} (split: [status, stdout, stderr]) (status as subprocess gives it: -N for signal N) or
{"error": text}. first_only: once the first rank has ended, the others are killed (the test
reads the first rank's output only). fresh: those ranks exec a new interpreter instead (a
case whose imports' order matters: exit handlers registered before neuron_dist's, say)."""
import json
import os
import selectors
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (preloaded for the ranks)
import torch.distributed  # noqa: F401
import neuron_dist  # noqa: F401

_ANSWERS = os.fdopen(os.dup(1), "w")  # the answer channel (a rank's fd 1 is its own pipe)
_REQUESTS = os.fdopen(os.dup(0), "r")
_DEVNULL = os.open(os.devnull, os.O_RDWR)
os.dup2(_DEVNULL, 0)
os.dup2(_DEVNULL, 1)  # (the server prints nothing)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_job(job: dict):
    """Fork the job's ranks; in a rank return (argv0, source, cwd), in the server its outputs."""
    reads, pids = [], []
    try:
        for argv in job["argvs"]:
            pipes = [os.pipe() for _ in range(2 if job.get("split") else 1)]  # (stdout[, stderr])
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # a rank
                try:
                    _ANSWERS.close()
                    _REQUESTS.close()
                    for fd in reads + [r for r, _ in pipes] + [_DEVNULL]:
                        os.close(fd)
                    reads.clear()  # (closed here: not again, by number, in the finally below)
                    os.dup2(pipes[0][1], 1)
                    os.dup2(pipes[-1][1], 2)
                    for _, w in pipes:
                        os.close(w)
                    os.environ.clear()  # (in place: neuron_dist keeps os.environ's own dict)
                    os.environ.update(job["env"])
                    if job.get("cwd"):
                        os.chdir(job["cwd"])
                    path = job.get("path")
                    if len(pids) in job.get("fresh", ()):  # this rank as a new interpreter, imports and all
                        os.execv(sys.executable, [sys.executable, *([path] if path else ["-c", job["code"]]),
                                                  *map(str, argv)])
                    argv0 = path if path else "-c"
                    sys.argv = [argv0, *map(str, argv)]
                    sys.path[0] = os.path.dirname(path) if path else ""
                    if path:
                        with open(path) as f:
                            source = f.read()
                    else:
                        source = job["code"]
                    return argv0, source
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                    os._exit(70)
            for _, w in pipes:
                os.close(w)
            reads += [r for r, _ in pipes]
            pids.append(pid)
        return _collect(job, reads, pids)
    finally:
        for fd in reads:
            try:
                os.close(fd)
            except OSError:
                pass


def _collect(job: dict, reads: list, pids: list) -> dict:
    per = len(reads) // len(pids)  # streams per rank: rank i's are reads[i * per:(i + 1) * per]
    outs = [bytearray() for _ in reads]
    status = [None] * len(pids)
    sel = selectors.DefaultSelector()
    for i, fd in enumerate(reads):
        sel.register(fd, selectors.EVENT_READ, i)
    open_ = set(range(len(reads)))
    deadline = time.monotonic() + job.get("timeout", 120)
    while True:
        # reaped as pool.run_scripts (subprocess's communicate, rank by rank) reaps them: a rank
        # once those before it are reaped and its output has ended, not before (until then an
        # ended rank stays a zombie, and its pid, which a peer may open as a pidfd, stays taken)
        for i, pid in enumerate(pids):
            if status[i] is None:
                if open_ & set(range(i * per, (i + 1) * per)):
                    break
                done, st = os.waitpid(pid, os.WNOHANG)
                if not done:
                    break
                status[i] = os.waitstatus_to_exitcode(st)
        if job.get("first_only") and status[0] is not None and not open_ & set(range(per)):
            break  # the first rank has ended and said all it will
        if not open_ and all(s is not None for s in status):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        events = sel.select(min(left, 0.05)) if open_ else (time.sleep(min(left, 0.01)) or [])
        for key, _ in events:
            i = key.data
            chunk = os.read(key.fd, 1 << 16)
            if chunk:
                outs[i] += chunk
            else:
                sel.unregister(key.fd)
                open_.discard(i)
    sel.close()
    for i, pid in enumerate(pids):  # a rank still running (first_only, or a hung job) is killed
        if status[i] is None:
            _kill(pid)
            status[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    text = [o.decode(errors="replace") for o in outs]
    return {"outs": [[s, *text[i * per:(i + 1) * per]] for i, s in enumerate(status)]}


def _serve():
    for line in _REQUESTS:
        if not line.strip():
            continue
        try:
            got = _run_job(json.loads(line))
        except Exception:  # noqa: BLE001 - report to the test
            got = {"error": traceback.format_exc()}
        if isinstance(got, tuple):
            return got  # in a rank
        _ANSWERS.write(json.dumps(got) + "\n")
        _ANSWERS.flush()
    os._exit(0)


_argv0, _source = _serve()
# the rank's script, at this interpreter's top level as `python script.py` runs it
exec(compile(_source, _argv0 if _argv0 != "-c" else "<string>", "exec"), {"__name__": "__main__",
                                                                          "__builtins__": __builtins__,
                                                                          "__file__": _argv0})
