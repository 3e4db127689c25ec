"""Rank output, prefixed line by line, without lines broken in two.

torch's agent copies each rank's log file to the terminal with a thread per rank
(``tail_log.tail_logfile``) that writes "<prefix><line>" for every ``readline()``.
At the end of the file ``readline()`` returns what is there, newline or not, and a
rank started with ``python -u`` (as torchrun and neuronrun start them) writes a
``print`` in two pieces: the text, then the newline. A read that falls between
them prints the text without its newline, another rank's line lands on it, and
the newline follows alone under a prefix of its own ("[rank2]: " on an empty line).

``tail_whole_lines`` is that function with one change: an unfinished line is held
until its newline arrives, for at most ``HOLD_S`` (so a progress bar that never
ends its line is still shown), and the last piece is written when the rank is
done. A piece written unfinished (after the hold, or the rank's last words
without a newline) gets a newline, so the next line, maybe another rank's, starts
on a line of its own. Same arguments, same filter semantics, same destination.
"""

from __future__ import annotations

import os
import time
from typing import Callable, TextIO

HOLD_S = 0.5  # longest an unfinished line waits for its newline (print's two writes are us apart)


def tail_whole_lines(header: str, file: str, dst: TextIO, finished, interval_sec: float,
                     log_line_filter: Callable[[str], bool] | None = None) -> None:
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)

    def emit(text: str) -> None:
        if log_line_filter and log_line_filter(text):
            dst.write(f"{header}{text}")

    held, since = "", 0.0
    with open(file, errors="replace") as fp:
        while True:
            piece = fp.readline()
            if piece:
                held += piece
                if held.endswith("\n"):
                    emit(held)
                    held = ""
                elif len(held) == len(piece):
                    since = time.monotonic()
                continue
            if held and (finished.is_set() or time.monotonic() - since >= HOLD_S):
                emit(held + "\n")  # the rank is done, or this line is not going to end soon
                held = ""
            if finished.is_set():
                return
            time.sleep(min(interval_sec, HOLD_S))
