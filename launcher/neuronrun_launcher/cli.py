"""The command line: every flag defined once, in ``FLAGS``, with its environment fallback.

Each flag ``--foo-bar`` (also spelled ``--foo_bar``) reads, when absent from the
command line, ``NEURONRUN_FOO_BAR`` and then torchrun's ``PET_FOO_BAR``, so job
templates written for torchrun keep working. Defaults are *not* applied here:
``parse`` reports where each value came from (command line, which variable, or
default) because the configuration step must tell an explicit ``--nnodes`` from a
default one before it fills values in from Slurm or MPI, and must name the source
in conflict errors. A variable of a torchrun flag that neuronrun does not accept
(``PET_START_METHOD``) is an error, as the flag is on the command line: ignored,
the job would run other than its template says.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIXES = ("NEURONRUN_", "PET_")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
# torchrun's flags that read PET_* and that neuronrun does not have (as of torch 2.13), and the
# values that ask for what neuronrun does anyway, so that a template spelling out torchrun's
# defaults still runs: a switch's false ones; spawn, its only start method; torch's default event
# log handler and signal list, which neuronrun's agent runs with
TORCHRUN_ONLY = {"start_method": {"spawn"}, "event_log_handler": {"null"}, "run_path": _FALSE,
                 "duplicate_stdout_filters": set(), "duplicate_stderr_filters": set(),
                 "signals_to_handle": {"sighup,sigint,sigquit,sigterm"}, "virtual_local_rank": _FALSE}


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    switch: bool = False
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return max(self.names, key=len).lstrip("-").replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        return tuple(p + self.dest.upper() for p in ENV_PREFIXES)


def _spellings(*names: str) -> tuple[str, ...]:
    """``--foo-bar`` also answers to ``--foo_bar`` (torchrun accepts both)."""
    out: list[str] = []
    for n in names:
        out.append(n)
        if n.startswith("--") and "-" in n[2:]:
            out.append("--" + n[2:].replace("-", "_"))
    return tuple(out)


FLAGS: tuple[Flag, ...] = (
    # --- torchrun: job size and rendezvous -------------------------------------------------
    Flag(_spellings("--nnodes"), "number of nodes, N or MIN:MAX (elastic)", "1:1", metavar="N|MIN:MAX"),
    Flag(_spellings("--nproc-per-node"), "ranks per node: an integer, 'auto' (one per logical NeuronCore, "
         "divided by --cores-per-rank) or 'cpu' (one per CPU, as torchrun)", "1", metavar="K|auto|cpu"),
    Flag(_spellings("--node-rank"), "rank of this node, static rendezvous only", 0, int),
    Flag(_spellings("--master-addr"), "address of node 0, static rendezvous only", "127.0.0.1"),
    Flag(_spellings("--master-port"), "port of node 0's store, static rendezvous only (default 29500)", None, int),
    Flag(_spellings("--rdzv-backend"), "rendezvous backend: static, c10d, etcd, etcd-v2", "static"),
    Flag(_spellings("--rdzv-endpoint"), "rendezvous endpoint host[:port]", ""),
    Flag(_spellings("--rdzv-id"), "job id shared by all nodes ($SLURM_JOB_ID under Slurm)", "none"),
    Flag(_spellings("--rdzv-conf"), "extra rendezvous settings key1=v1,key2=v2 (e.g. timeout=60)", ""),
    Flag(_spellings("--standalone"), "single node: c10d rendezvous on a free local port (several nodes, by "
         "--nnodes or Slurm/MPI, are an error)", False, switch=True),
    Flag(_spellings("--local-addr"), "address this node advertises (default: its FQDN)", None),
    # --- torchrun: workers, restarts, logs ---------------------------------------------------
    Flag(_spellings("--max-restarts"), "restarts of the whole worker group before failing", 0, int),
    Flag(_spellings("--monitor-interval"), "seconds between worker health checks", 0.1, float),
    Flag(_spellings("--shutdown-timeout"), "grace period in seconds between SIGTERM and SIGKILL when neuronrun "
         "is stopped by a signal (default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30; after a rank fails, "
         "torch's agent waits 30 s)", None, int),
    Flag(_spellings("--role"), "worker role name", "default"),
    Flag(_spellings("--log-dir"), "directory for per-rank stdout/stderr/error files (default: a temp dir)", None),
    Flag(("-r", *_spellings("--redirects")), "redirect std streams of ranks to files only: 0 none, 1 out, "
         "2 err, 3 both, or per local rank '0:1,1:2'", "0"),
    Flag(("-t", *_spellings("--tee")), "copy std streams to files *and* the console, each line prefixed with "
         "the rank; same values as --redirects. Default 3 (torchrun: 0): needed for prefixes and for the "
         "failure report's last lines; 0 when --redirects is given alone (files only)", "3"),
    Flag(_spellings("--local-ranks-filter"), "only show console output of these local ranks, e.g. 0,1", ""),
    Flag(("-m", *_spellings("--module")), "run the script as a Python module, like python -m", False, switch=True),
    Flag(_spellings("--no-python"), "run the script as an executable, not with python", False, switch=True),
    # --- neuronrun's own -----------------------------------------------------------------------
    Flag(_spellings("--instance"), "instance model for placement (default: $NEURON_DIST_INSTANCE, else "
         "trn2.48xlarge)", None, metavar="NAME"),
    Flag(_spellings("--lnc"), "logical NeuronCore config (default: $NEURON_LOGICAL_NC_CONFIG, else the "
         "instance's: 2 on trn2, 1 on trn1/inf2)", None, int, choices=(1, 2)),
    Flag(_spellings("--cores-per-rank"), "logical NeuronCores per rank (default: $NEURON_RT_NUM_CORES, else 1)",
         None, int, metavar="M"),
    Flag(_spellings("--cpu-bind"), "core: bind each local rank to its own even share of the CPUs neuronrun "
         "may use (as mpirun --bind-to core; more ranks than CPUs wrap around, one CPU each); none: leave "
         "placement to the OS, as torchrun does", "none", choices=("none", "core")),
    Flag(_spellings("--thp"), "on: THP_MEM_ALLOC_ENABLE=1 in every rank, so torch backs its tensors of 2 MiB "
         "and more with transparent huge pages and a training step page-faults them in about 20 times "
         "less often (thp.py; a value the user exported stands); off: as torchrun leaves it", "on",
         choices=("on", "off")),
    Flag(_spellings("--scheduler"), "read nodes/node rank/master from: auto (detect srun/mpirun), slurm, mpi, "
         "none", "auto", choices=("auto", "slurm", "mpi", "none")),
    Flag(_spellings("--dry-run"), "print every rank's host, node rank, local rank, chip, cores and the "
         "environment neuronrun sets for it (torch's agent adds its own TORCHELASTIC_* bookkeeping), then exit",
         False, switch=True),
)


@dataclass(frozen=True)
class ParsedArgs:
    values: dict[str, Any]  # dest -> value (defaults filled in)
    sources: dict[str, str]  # dest -> "command line" | "$VAR" | "default"
    script: str | None
    script_args: list[str]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def explicit(self, dest: str) -> bool:
        return self.sources[dest] != "default"


class _Parser(argparse.ArgumentParser):
    """argparse, and for a flag it does not know the nearest one it does: neuronrun takes no
    abbreviations (torchrun does), so `--nproc-per-nod` must point the user to the flag."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            hints = []
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                near = flag.startswith("--") and difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
                if near:
                    hints.append(f"{flag}: did you mean {near[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="neuronrun",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a typo must not silently become another flag
    )
    for flag in FLAGS:
        env_help = " [env: " + ", ".join(flag.env_names) + "]"
        if flag.switch:
            parser.add_argument(*flag.names, dest=flag.dest, action="store_const", const=True, default=None,
                                help=flag.help + env_help)
        else:
            default = "" if flag.default in (None, "") else f" (default: {flag.default})"
            parser.add_argument(*flag.names, dest=flag.dest, type=flag.type, default=None, choices=flag.choices,
                                metavar=flag.metavar, help=flag.help + default + env_help)
    parser.add_argument("script", nargs="?", help="training script (or module with -m, executable with --no-python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def _from_env(flag: Flag, raw: str, var: str) -> Any:
    if flag.switch:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"${var}={raw!r}: expected 1/0, true/false, yes/no, on/off")
    try:
        value = flag.type(raw)
    except ValueError:
        raise ValueError(f"${var}={raw!r} is not a valid {flag.type.__name__}") from None
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"${var}={raw!r}: choose from {', '.join(map(str, flag.choices))}")
    return value


def _refuse_torchrun_only(env: Mapping[str, str]) -> None:
    for dest, harmless in TORCHRUN_ONLY.items():
        for var in (p + dest.upper() for p in ENV_PREFIXES):
            raw = env.get(var)
            # (compared as a sorted, comma-separated list: a signal list in any order)
            if raw is not None and raw != "" and ",".join(sorted(raw.replace(" ", "").lower().split(","))) not in harmless:
                raise ValueError(f"${var}={raw!r}: neuronrun has no --{dest.replace('_', '-')} (a torchrun flag "
                                 f"it does not accept); unset the variable")


def parse(argv: Sequence[str], env: Mapping[str, str], description: str | None = None) -> ParsedArgs:
    """Parse ``argv`` with ``env`` as fallback. Raises SystemExit (argparse) or ValueError."""
    ns = build_parser(description).parse_args(list(argv))
    _refuse_torchrun_only(env)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag in FLAGS:
        value = getattr(ns, flag.dest)
        if value is not None:
            values[flag.dest], sources[flag.dest] = value, "command line"
            continue
        for var in flag.env_names:
            if var in env and (flag.switch or env[var] != ""):
                values[flag.dest], sources[flag.dest] = _from_env(flag, env[var], var), "$" + var
                break
        else:
            values[flag.dest], sources[flag.dest] = flag.default, "default"
    return ParsedArgs(values, sources, ns.script, list(ns.script_args))
