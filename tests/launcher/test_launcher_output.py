"""Rank output reaches the terminal in whole lines (neuronrun_launcher/tail.py)."""
from __future__ import annotations

import io
import threading
import time

import forked_neuronrun as forked
import pytest

from neuronrun_launcher import tail

pytest.importorskip("torch.distributed")


def _copy(tmp_path, fn, pieces, interval=0.01, shown_first=False):
    """Run tail function `fn` over a log file written in `pieces` ((text, pause after) each).
    With `shown_first`, each piece waits (up to 5 s) to be shown before its pause: on a loaded
    host a reader thread may not run within a pause, and would then read two pieces at once."""
    log = tmp_path / "rank.log"
    log.write_text("")
    out, finished = io.StringIO(), threading.Event()
    t = threading.Thread(target=fn, args=("[r0]: ", str(log), out, finished, interval, lambda _: True))
    t.start()
    with open(log, "a") as f:
        for text, pause in pieces:
            f.write(text)
            f.flush()
            deadline = time.monotonic() + 5
            while shown_first and text.strip() not in out.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(pause)
    finished.set()
    t.join(10)
    return out.getvalue()


def test_a_line_written_in_two_pieces_stays_one_line(tmp_path):
    from torch.distributed.elastic.multiprocessing.tail_log import tail_logfile
    pieces = [("sum=6 world=4", 0.1), ("\n", 0.05), ("next\n", 0.05)]  # the reader sees the first piece alone
    torchs = _copy(tmp_path, tail_logfile, pieces, shown_first=True)
    assert torchs == "[r0]: sum=6 world=4[r0]: \n[r0]: next\n"  # torch's tail splits the line
    assert _copy(tmp_path, tail.tail_whole_lines, pieces) == "[r0]: sum=6 world=4\n[r0]: next\n"


def test_an_unended_line_is_shown_after_the_hold_and_at_the_end(tmp_path):
    shown = _copy(tmp_path, tail.tail_whole_lines, [("50%", tail.HOLD_S + 0.3), (" 100%", 0.05)])
    assert shown.startswith("[r0]: 50%\n")  # not held for ever (a progress bar without newlines)
    assert shown.endswith("[r0]:  100%\n")  # the last piece is written once the rank is done


def test_a_last_line_without_newline_is_ended(tmp_path):
    """A rank whose last words had no newline ("done" with end="") left the terminal's cursor
    after them, and the next line written there, another rank's or neuronrun's report, was glued
    to them: the README promises whole lines."""
    assert _copy(tmp_path, tail.tail_whole_lines, [("line\nlast words", 0.05)]) == "[r0]: line\n[r0]: last words\n"


def test_neuronrun_prints_each_rank_line_whole(tmp_path):
    script = tmp_path / "split.py"
    script.write_text("import sys, time\n"
                      "sys.stdout.write('part one'); sys.stdout.flush(); time.sleep(0.15)\n"
                      "sys.stdout.write(' and two\\n'); sys.stdout.flush()\n")
    r = forked.run(["--nproc-per-node", "1", str(script)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[rank0]: part one and two\n" in r.stdout, r.stdout


def test_a_rank_that_wrote_nothing_is_not_said_to_be_uncaptured(tmp_path):
    """A rank killed before writing a line (its log files exist, empty) was reported as "its
    output was not captured: run with --tee 3 ...", even with --tee 3 given."""
    from types import SimpleNamespace
    from neuronrun_launcher.launch import describe_failure
    failure = SimpleNamespace(local_rank=1, pid=42, exitcode=-9, message=None, signal_name=lambda: "SIGKILL")
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.write_text("")
    err.write_text("")
    said = describe_failure(1, failure, 0, "h", {"stdout": str(out), "stderr": str(err)})
    assert "(it wrote nothing to stdout or stderr)" in said and "not captured" not in said, said
    said = describe_failure(1, failure, 0, "h", None)
    assert "(its output was not captured: run with --tee 3" in said, said
    err.write_text("Traceback\nValueError: the cause\n")
    said = describe_failure(1, failure, 0, "h", {"stdout": str(out), "stderr": str(err)})
    assert "last 2 lines of its stderr" in said and "ValueError: the cause" in said, said
