"""The one exception type for mistakes a user can fix, and the exit codes of a run (defined here only).

Exit codes (launch/common.sh treats 0, 2, 74 and 75 as final and restarts on anything else):
  0   done
  1   EXIT_FAILED      a peer died, a rank stalled or crashed: worth retrying with --resume auto
  2   EXIT_USER_ERROR  bad input (recipe, config, data, paths); one line says what to change
  74  EXIT_SAVE_FAILED EX_IOERR: a checkpoint could not be written (a full disk stays full: not retried)
  75  EXIT_STOPPED     EX_TEMPFAIL: stopped on request (signal, STOP file) after a checkpoint (SLURM requeues)
  130 EXIT_INTERRUPTED Ctrl-C before the first step: nothing to save (during training Ctrl-C is a stop: 75)
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_SAVE_FAILED = 74
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


class UserError(Exception):
    """A problem with the user's input (recipe, config, data, paths), not a bug in dstrain."""


def closest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid spelling, or '' when nothing is near."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""
