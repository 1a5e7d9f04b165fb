"""Stop cleanly when asked: save a checkpoint at the next step boundary and exit with EXIT_CODE.

Three ways to ask, for three kinds of scheduler:
  SIGUSR1 or SIGTERM to any rank   SLURM `--signal=USR1@T` on the steps, spot-VM / Kubernetes SIGTERM;
  a file named STOP in the run dir  `touch runs/x/STOP`, or launch/slurm.sbatch's trap, which gets the
                                    signal in the batch shell (`--signal=B:USR1@T`) and cannot reach
                                    ranks on other nodes except through the shared file system.
The ranks agree on stopping with one all-reduce of a flag per step, so all save the same step.
A second SIGTERM is not caught: it kills as usual.
EXIT_CODE is 75 (EX_TEMPFAIL, "try again"): launch/slurm.sbatch requeues the job on it, and the next
run resumes from the checkpoint (--resume auto).
"""
from __future__ import annotations

import signal
from pathlib import Path

import psutil

from .dist import DistContext, all_reduce_sum
from .errors import EXIT_STOPPED

EXIT_CODE = EXIT_STOPPED
STOP_FILE = "STOP"


class StopRequest:
    def __init__(self, run_dir: Path, ctx: DistContext):
        self.path = run_dir / STOP_FILE
        self.ctx = ctx
        self.reason: str | None = None
        self.stopped_at: int | None = None
        started = psutil.Process().create_time()
        if ctx.is_main and self.path.exists() and self.path.stat().st_mtime < started:
            self.path.unlink()  # left from an earlier run that finished before it saw the file
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name
        if signum == signal.SIGTERM:  # asked once politely; a second SIGTERM kills
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def agreed(self, step: int, device) -> bool:
        """True on every rank when any rank was signalled or rank 0 sees the STOP file."""
        if self.ctx.is_main and self.reason is None and self.path.exists():
            self.reason = f"{STOP_FILE} file"
        (votes,) = all_reduce_sum([1.0 if self.reason else 0.0], device)
        if votes:
            self.stopped_at = step
            self.reason = self.reason or "another rank was signalled"
            if self.ctx.is_main and self.path.exists():
                self.path.unlink()  # consumed: the resumed run must not stop on it again
        return bool(votes)

