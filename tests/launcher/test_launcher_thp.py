"""--thp: torch's huge-page switch in every rank (thp.py), and what it does to a step's page faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from launcher_helpers import clean_env, neuronrun

from neuronrun_launcher.plan import NeuronPlan, neuron_env
from neuronrun_launcher.run import main as run_main
from neuronrun_launcher.thp import THP_VAR, host_mode, rank_vars


def test_rank_vars_sets_it_unless_the_user_did():
    assert rank_vars(True, {}) == {THP_VAR: "1"}
    assert rank_vars(True, {"GLIBC_TUNABLES": "x"}) == {THP_VAR: "1"}
    for exported in ("0", "1", ""):  # the user's value stands, whatever it is
        assert rank_vars(True, {THP_VAR: exported}) == {}
    assert rank_vars(False, {}) == {}


def test_host_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("garbled\n", None)):
        f.write_text(text)
        assert host_mode(str(f)) == mode
    assert host_mode(str(tmp_path / "missing")) is None


def test_the_plan_carries_it_to_every_rank():
    plan = NeuronPlan("trn1.32xlarge", 1, 16, 2, 2, 4, 0, 32, thp_env={THP_VAR: "1"})
    assert neuron_env(plan, 1, "10.0.0.1", 29500)[THP_VAR] == "1"
    assert THP_VAR not in neuron_env(NeuronPlan("trn1.32xlarge", 1, 16, 2, 2, 4, 0, 32), 1, "10.0.0.1", 29500)
    assert NeuronPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("flags, env, shown", [
    ([], {}, True),                                  # on by default
    (["--thp", "on"], {}, True),
    (["--thp", "off"], {}, False),
    ([], {"NEURONRUN_THP": "off"}, False),           # the flag's environment fallback
    ([], {THP_VAR: "0"}, False),                     # exported by the user: theirs reaches the rank
])
def test_dry_run_shows_it_for_every_rank(flags, env, shown, scrubbed_environ, monkeypatch, capsys):
    argv = ["--dry-run", "--nproc-per-node", "2", *flags, "train.py"]
    if not flags and not env:  # the command line, end to end, in a process of its own
        r = neuronrun(argv, env=clean_env(**env))
        code, out, err = r.returncode, r.stdout, r.stderr
    else:  # the same main(), in this process (--dry-run imports no torch and starts nothing)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code = run_main(argv)
        out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count(f"\n  {THP_VAR}=1\n") == (2 if shown else 0), out
    # the header says whether this node's kernel honours it
    assert (f"this node's transparent huge pages: {host_mode() or 'unknown'}" in out) == shown, out


def test_a_bad_value_is_a_usage_error():
    r = neuronrun(["--thp", "maybe", "train.py"])
    assert r.returncode == 2 and "--thp" in r.stderr and "Traceback" not in r.stderr


# Two 48 MiB tensors made, filled and freed, round after round, as a training step's gradients
# are: glibc maps them afresh each time and the kernel faults their pages in again
PROBE = textwrap.dedent('''
    import resource, torch
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    counts = []
    for _ in range(6):
        f0 = faults()
        ts = [torch.empty(12 << 20).fill_(1.0) for _ in range(2)]
        del ts
        counts.append(faults() - f0)
    print(max(counts[2:]))
''')


def _faults_per_round(env: dict[str, str]) -> int:
    p = subprocess.run([sys.executable, "-c", PROBE], env=clean_env(**env), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.split()[-1])


def test_what_a_rank_gets_cuts_its_page_faults():
    """The variable neuronrun gives a rank, in a process of its own: torch takes it, and the
    large tensors fault in far less often, where the kernel gives huge pages only when asked."""
    pages = 2 * (48 << 20) // 4096
    plain = _faults_per_round({})
    with_thp = _faults_per_round(rank_vars(True, {}))
    mode = host_mode()
    if mode == "madvise":  # huge pages only where advised: torch's switch is what asks
        assert plain >= 0.9 * pages and with_thp * 8 < plain, (with_thp, plain)
    elif mode == "always":  # large mappings may get them unasked; with the switch they must
        assert with_thp * 8 < pages, (with_thp, plain)
    else:  # never (or unreadable): the switch changes nothing (README says so)
        assert plain >= 0.9 * pages and with_thp * 2 > plain, (with_thp, plain, mode)
