"""`python -m neuron_dist.TOOL ARGV` command lines (TOOL: bench or bench_train), one after another
in this one process, for tests/test_bench.py (its `bench_cli` fixtures): each is the tool's
main(argv), as its command line runs it, and its ranks are real processes forked from a fork
server, as the tool's own launch starts them; but the interpreter and the fork server (torch
imported in each: seconds of CPU on a small host) are started once for all of them instead of
once per command line.

    python bench_session.py CAPTURE_DIR TOOL

Reads one JSON line per command line on stdin, {"argv": [...], "env": {NAME: value, or null to
unset}}, and answers on its standard output one line, {"returncode", "stdout", "stderr"}: what
the command line would exit with, and what it and its ranks wrote. The environment changes
apply to this process, where bench's main reads them (MASTER_PORT, ...); the ranks, children of
the fork server, get the environment this process started with plus what bench sets in each
rank, so a command line that needs another environment in its ranks does not belong here.
"""
import importlib
import json
import os
import sys
import traceback


def main() -> None:
    answer = os.fdopen(os.dup(1), "w")
    cap = sys.argv[1]
    names = [os.path.join(cap, n) for n in ("stdout", "stderr")]
    for fd, name in zip((1, 2), names):  # the fork server, and so every rank, writes here too
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        os.dup2(f, fd)
        os.close(f)
    from multiprocessing import forkserver

    from neuron_dist import bench
    tool = importlib.import_module(f"neuron_dist.{sys.argv[2]}")
    bench.rank_context(("torch._dynamo",) if sys.argv[2] == "bench_train" else ())  # the tool's preload
    forkserver.ensure_running()  # with this process's environment and output files
    base = dict(os.environ)
    for line in sys.stdin:
        req = json.loads(line)
        os.environ.clear()
        os.environ.update(base)
        for k, v in req["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        starts = [os.path.getsize(n) for n in names]
        try:
            code = tool.main(req["argv"])
        except SystemExit as e:  # as the interpreter exits on it
            code = e.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        got = []
        for name, start in zip(names, starts):
            with open(name, "rb") as f:
                f.seek(start)
                got.append(f.read().decode(errors="replace"))
        answer.write(json.dumps({"returncode": code or 0, "stdout": got[0], "stderr": got[1]}) + "\n")
        answer.flush()
    os.environ.clear()
    os.environ.update(base)


if __name__ == "__main__":  # (the ranks import this file as __mp_main__: nothing to do there)
    main()
