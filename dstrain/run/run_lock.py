"""One run per run directory: rank 0 holds an exclusive flock on <run dir>/.lock for the life of the run.

Two launches into one directory (two terminals, a requeued SLURM job whose first attempt still runs) would interleave
metrics and checkpoints. The kernel releases a flock when its holder dies, however it dies (SIGKILL, OOM, a lost
node on NFSv4 and Lustre once the lease expires), so a dead run never leaves the directory locked, unlike a pid file.
File systems without flock (some NFSv3 mounts without lockd) get one warning and no lock, not a refusal.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import UserError

LOCK_FILE = ".lock"
_held: list = []  # the open file that carries the lock: kept for the life of the process
_previous: list = []  # what the lock file said before this run took it


def acquire(run_dir: Path) -> str | None:
    """Take the lock; None when taken (or the file system has no flock), else the one-line refusal."""
    path = run_dir / LOCK_FILE
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "{}")
        except ValueError:
            holder = {}
        handle.close()
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(holder["started"])) if "started" in holder else "?"
        return (f"{run_dir} is in use by another run ({who}, started {since}); wait for it, stop it "
                f"(kill {holder.get('pid', 'PID')} checkpoints and stops it), or choose another --output_dir")
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        handle.close()
        print(f"warning: {run_dir} cannot be locked ({error.strerror}: a file system without flock); nothing "
              f"stops a second run from writing into it, so start one run per --output_dir", file=sys.stderr)
        return None
    handle.seek(0)
    _previous[:] = [handle.read()]
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                             "command": " ".join(sys.argv)}) + "\n")
    handle.flush()
    _held.append(handle)
    return None


def put_back() -> None:
    """A run that ends on bad input (or finds its run finished) leaves the lock file saying what it said before:
    the last run that trained there (issue 85: a refused relaunch rewrote it)."""
    if _held and _previous and _previous[0]:
        handle = _held[-1]
        handle.seek(0)
        handle.truncate()
        handle.write(_previous[0])
        handle.flush()


def lock_run_dir(run_dir: Path, is_main: bool) -> None:
    """Rank 0 takes the lock; every rank learns the outcome (one broadcast) and the same UserError ends them all."""
    from ..parallel.dist import broadcast_object

    refusal = acquire(run_dir) if is_main else None
    refusal = broadcast_object(refusal)
    if refusal:
        raise UserError(refusal)


def remove_if_unused(run_dir: Path, created: bool) -> None:
    """A run that failed on bad input leaves no empty run directory behind (only one it created itself)."""
    if not created:
        return
    try:
        left = {p.name for p in run_dir.iterdir()}
        if left <= {LOCK_FILE}:
            for name in left:
                (run_dir / name).unlink()
            run_dir.rmdir()
    except OSError:
        pass
