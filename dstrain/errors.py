"""The one exception type for mistakes a user can fix; train.py prints it as one line and exits 2."""
from __future__ import annotations

import difflib
from typing import Iterable


class UserError(Exception):
    """A problem with the user's input (recipe, config, data, paths), not a bug in dstrain."""


def closest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid spelling, or '' when nothing is near."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""
