"""Failure injection for the fault-tolerance tests; does nothing unless DSTRAIN_FAULT is set.

    DSTRAIN_FAULT="<point>:<action>[:rank=R][:step=S]"   several separated by ';'

points   validate (before the validation pass, step 0), step (before a training step), save:copy (a background
         save's deferred copy of the engine's state), save:write (a background save's file), save:shards (files
         written, not yet listed), save:manifest
         (complete.json written, not yet published), save:publish (renamed, `latest` not yet written),
         save:prune (published, old checkpoints not yet pruned)
actions  kill (SIGKILL this process), stall (sleep forever, like a stuck data loader), enospc (raise
         "No space left on device", like a full disk), slow (sleep `seconds=N`, default 30, then go on:
         a slow data loader or file system; with `until=EVENT` only until the code calls release(EVENT):
         `step:slow:seconds=10:until=compiled` slows the steps while train.compile works in the background;
         `until=signalled`: until a signal asks the rank to stop, dstrain/preempt.py)

Real failures are used where a test can make them (kill -9 from outside, a full tmpfs); injection covers
the points in between that no outside timing can hit reliably.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time

from . import env

_SPEC = env.fault_spec()


def _parse(spec: str) -> list[tuple[str, str, dict[str, int]]]:
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        parts = item.split(":")
        point_parts, where = [], {}
        for part in parts:
            key, sep, value = part.partition("=")
            if sep:
                where[key] = int(value) if value.lstrip("-").isdigit() else value
            else:
                point_parts.append(part)
        *point, action = point_parts
        rules.append((":".join(point), action, where))
    return rules


_RULES = _parse(_SPEC)
_RELEASED: dict[str, threading.Event] = {}


def release(event: str) -> None:
    """The code reached `event` (e.g. "compiled"): a `slow ... until=event` fault stops slowing."""
    if _RULES:
        _RELEASED.setdefault(event, threading.Event()).set()


def point(name: str, rank: int, step: int) -> None:
    """Fail here when DSTRAIN_FAULT asks for it at this point, rank and step."""
    for where, action, cond in _RULES:
        if where != name or cond.get("rank", rank) != rank or cond.get("step", step) != step:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stall":
            while True:
                time.sleep(3600)
        elif action == "slow":
            until = _RELEASED.setdefault(cond["until"], threading.Event()) if "until" in cond else None
            if until is None:
                time.sleep(cond.get("seconds", 30))
            else:
                until.wait(cond.get("seconds", 30))
        elif action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        else:
            raise ValueError(f"DSTRAIN_FAULT: unknown action {action!r} (kill, stall, slow, enospc)")
