"""Stop cleanly when asked: save a checkpoint at the next step boundary and exit with EXIT_CODE.

Ways to ask, for every kind of scheduler and user:
  SIGUSR1, SIGTERM or SIGINT        SLURM `--signal=USR1@T` on the steps, spot-VM / Kubernetes SIGTERM, Ctrl-C
    to any rank                     (SIGINT to the whole process group);
  the launcher going away           `kill <deepspeed launcher pid>`: DeepSpeed's runner has no handler on one node
                                    and dies alone, leaving the ranks training; each rank watches its launcher
                                    (deepspeed's launch.py and the runner above it, or torchrun) and stops when
                                    it is gone. launch/*.sh trap SIGTERM/SIGINT (`docker stop`) and signal the
                                    ranks themselves (`python -m dstrain.run.preempt PID`), then wait for exit 75;
  a file named STOP in the run dir  `touch runs/x/STOP`, or launch/slurm.sbatch's trap, which gets the
                                    signal in the batch shell (`--signal=B:USR1@T`) and cannot reach
                                    ranks on other nodes except through the shared file system.
The ranks agree on stopping with one all-reduce of a flag per step, so all save the same step.
A second SIGINT or SIGTERM to a rank is not caught: it kills as usual.
EXIT_CODE is 75 (EX_TEMPFAIL, "try again"): launch/slurm.sbatch requeues the job on it, and the next
run resumes from the checkpoint (--resume auto).
"""
from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from .. import env
from ..errors import EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from . import faults

if TYPE_CHECKING:  # dist imports torch (seconds): this module is imported first, to see the launchers early
    from ..parallel.dist import DistContext

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
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._launchers = LAUNCHERS if LAUNCHERS is not None else launchers()
        if self._launchers:
            threading.Thread(target=self._watch, name="dstrain-launcher-watch", daemon=True).start()

    def _on_signal(self, signum, frame) -> None:
        self.reason = self.reason or signal.Signals(signum).name
        faults.release("signalled")  # tests: `step:slow:until=signalled` holds a step until a signal asks to stop
        if signum != signal.SIGUSR1:  # asked once politely; a second SIGTERM or SIGINT kills
            signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    def _watch(self) -> None:
        # Names were read while the launchers lived: a launcher that is gone (reaped by its shell at once, or a
        # zombie until its parent waits) can no longer be asked. Nothing in this loop may raise: a watch thread
        # that dies leaves the rank training on, orphaned.
        stop = threading.Event()
        while not stop.wait(1.0):
            gone = next((launcher for launcher in self._launchers if not launcher.running()), None)
            if gone is not None:
                self.reason = self.reason or f"the launcher {gone.name} (pid {gone.pid}) exited"
                return

    def agreed(self, step: int, device) -> bool:
        """True on every rank when any rank was signalled or rank 0 sees the STOP file."""
        from ..parallel.dist import all_reduce_sum

        if self.ctx.is_main and self.reason is None and self.path.exists():
            self.reason = f"{STOP_FILE} file"
        (votes,) = all_reduce_sum([1.0 if self.reason else 0.0], device)
        if votes:
            self.stopped_at = step
            self.reason = self.reason or "another rank was signalled"
            if self.ctx.is_main and self.path.exists():
                self.path.unlink()  # consumed: the resumed run must not stop on it again
        return bool(votes)



_LAUNCHERS = ("deepspeed.launcher.launch", "torchrun", "torch.distributed.run", "accelerate")
# What a process is reparented to when its parent dies: init, or a subreaper (a container's init, systemd).
_ADOPTERS = ("systemd", "init", "tini", "dumb-init", "docker-init", "catatonit", "conmon")


@dataclass(frozen=True)
class Launcher:
    """A launcher process, identified by pid and start time (so a reused pid is not taken for it), and its name
    read while it lived."""
    process: psutil.Process
    name: str
    pid: int
    gone_at_start: bool = False

    def running(self) -> bool:
        if self.gone_at_start:
            return False
        try:  # is_running() also compares the start time; a zombie has exited but still answers
            return self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # NoSuchProcess once reaped, AccessDenied, ...
            return False
        except Exception:  # noqa: BLE001 - the watch must never die: treat anything unexpected as gone
            return False


def _launcher(process: psutil.Process, name: str | None = None) -> Launcher:
    return Launcher(process, name or _describe(process), process.pid)


def _describe(process: psutil.Process) -> str:
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return "launcher"
    for name in _LAUNCHERS:
        if name in command:
            return {"deepspeed.launcher.launch": "deepspeed launch.py", "torch.distributed.run": "torchrun"}.get(
                name, name)
    return "deepspeed" if "deepspeed" in command else process.name() if process.is_running() else "launcher"


def _adopted(process: psutil.Process) -> bool:
    """True when process's parent is gone: it now belongs to init or a subreaper."""
    parent = process.parent()
    if parent is None or parent.pid == 1:
        return True
    try:
        return any(parent.name().startswith(name) for name in _ADOPTERS)
    except psutil.Error:
        return True


def launchers() -> list[Launcher]:
    """The processes that started this rank and whose death should stop it: deepspeed's per-node launch.py and
    what started it (the runner, or on other nodes pdsh's ssh session), torchrun, accelerate. A plain
    `python train.py` watches nothing: `nohup python train.py &` must survive its shell.

    Read as early as train.py starts (note_launchers below), so a launcher that dies while the rank builds its model
    is still known; one already gone by then (launch.py or this rank adopted by init) counts as gone."""
    try:
        me = psutil.Process()
        parent = me.parent()
        if parent is None or parent.pid == 1:
            return []
        command = " ".join(parent.cmdline())
        if "deepspeed.launcher.launch" in command:
            watched = [_launcher(parent, "deepspeed launch.py")]
            grand = parent.parent()
            if _adopted(parent):  # the runner above launch.py died before this rank looked
                watched.append(Launcher(parent, "deepspeed", -1, gone_at_start=True))
            elif grand is not None:
                watched.append(_launcher(grand))
            return watched
        return [_launcher(parent)] if any(name in command for name in _LAUNCHERS) else []
    except psutil.Error:
        return []


# The launchers above this rank, taken by note_launchers() as train.py starts (before seconds of imports and model
# building: a launcher that dies meanwhile is still known); None: not taken, StopRequest looks then.
LAUNCHERS: list[Launcher] | None = None


def note_launchers() -> None:
    global LAUNCHERS
    if LAUNCHERS is None and env.launched():
        LAUNCHERS = launchers()


def signal_ranks(root: int, signum: int = signal.SIGTERM) -> int:
    """Send signum to every training rank below process `root` (a launcher): the processes carrying the
    launcher's RANK/LOCAL_RANK whose parent does not (so not a rank's own helper processes). The launcher
    itself is not signalled: deepspeed's runner would die at once, launch.py would SIGKILL the ranks 30 s
    later. Returns how many ranks were signalled."""
    try:
        tree = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return 0
    ranks = []
    for proc in tree:
        try:
            if "LOCAL_RANK" in proc.environ() and "LOCAL_RANK" not in proc.parent().environ():
                ranks.append(proc)
        except psutil.Error:
            continue
    for proc in ranks:
        try:
            proc.send_signal(signum)
        except psutil.Error:
            pass
    return len(ranks)


if __name__ == "__main__":  # python -m dstrain.run.preempt LAUNCHER_PID: what launch/common.sh's trap runs
    count = signal_ranks(int(sys.argv[1]))
    print(f"launch: asked {count} rank(s) below pid {sys.argv[1]} to checkpoint and stop (exit 75)",
          file=sys.stderr)
    sys.exit(EXIT_OK if count else EXIT_FAILED)
