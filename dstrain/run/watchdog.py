"""No silent hangs: a background thread per rank that notices a dead peer or a stuck run and ends the job.

Every `fault.heartbeat_interval` seconds each rank, through the rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT that every launcher already runs, reached over its own connection):
  - bumps its heartbeat counter;
  - watches the next rank (a ring, so the store sees O(world) requests, not O(world^2)): the peer is dead
    when its process is gone (same machine: checked by pid at once) or its counter has not moved for
    `fault.peer_timeout` seconds (another machine: killed, out of memory, node lost);
  - reads one shared abort flag. The rank that finds a failure sets it with a message naming the rank and
    host; every rank then writes its Python stacks to <run dir>/stacks/rank<R>.txt, prints the message
    and exits, instead of waiting in a collective for the 10-30 minutes of the backend's own timeout.
  - Once training has started, a rank whose main thread finished no step, eval or save for
    `fault.stall_timeout` seconds (a stuck collective, a data stall) sets the flag too.
When rank 0 dies the store dies with it; losing the store for `peer_timeout` seconds names rank 0.
A rank that finishes or stops on bad input marks itself done, so its exit is not taken for a death.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import psutil

from .. import env
from ..config import FaultConfig
from ..errors import EXIT_FAILED
from ..parallel.dist import DistContext, looks_like_comm_failure

EXIT_CODE = EXIT_FAILED  # a peer died or the run stalled: worth retrying (launch/ scripts do)


def _machine_identity() -> str:
    """Same boot and same pid namespace: pids of the other process are meaningful here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:unknown"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Watchdog:
    def __init__(self, run_dir: Path, cfg: FaultConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.stacks_dir = run_dir / "stacks"
        self.host = socket.gethostname()
        self.prefix = f"dstrain/{env.store_generation()}"
        self.store = None
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._lock = threading.RLock()  # one TCPStore client, used by the main thread and the watchdog thread
        self._armed = False
        self._last_progress = time.monotonic()
        self._thread: threading.Thread | None = None
        self._failed_collective = ""  # the traceback of a collective that failed while a peer was being named
        self.store_timeout = max(cfg.heartbeat_interval, 5.0)

    # ------------------------------------------------------------------ main-thread API
    def start(self) -> Watchdog:
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            self.store = dist.TCPStore(env.master()[0], int(env.master()[1]), is_master=False,
                                       timeout=timedelta(seconds=self.store_timeout),
                                       wait_for_workers=False)
            self.store.set(self._key("proc", self.ctx.rank), f"{self.host}\t{_machine_identity()}\t{os.getpid()}")
        self._thread = threading.Thread(target=self._run, name="dstrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def arm(self) -> None:
        """From now on, a main thread that makes no progress for stall_timeout seconds ends the run."""
        self.progress()
        self._armed = True

    def progress(self) -> None:
        self._last_progress = time.monotonic()

    def close(self) -> None:
        """This rank is leaving on purpose (finished, stopped, bad input): not a death."""
        if self._stop.is_set():
            return
        self._armed = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.heartbeat_interval + 10)
        if self.store is not None:
            try:
                with self._lock:
                    if self.ctx.rank == 0:
                        self.store.set(self._key("done", 0), "1")
                        self._wait_for_the_others()
                    else:
                        # rank 0's `done` first, then this rank's own as its last word to the store: rank 0 (the
                        # store's host) leaves once it sees it, and a rank still polling a store that is gone
                        # gets c10d's "recvValue failed" warning with a 19-frame C++ stack on stderr, after the
                        # error line (issue 69: 10 of 24 failed launches ended so)
                        self._wait_for_rank0()
                        self.store.set(self._key("done", self.ctx.rank), "1")
            except Exception:
                pass

    def _wait_for_rank0(self) -> None:
        """A rank leaving on purpose waits for rank 0 to be leaving too (bounded by fault.peer_timeout): under the
        deepspeed launcher the first rank to exit gets the others killed, and rank 0 may still have to say why
        (a bad input's one line, said before it closes). Seen in the suite: a refused pipeline config exited
        without its error line when rank 1 was faster."""
        deadline = time.monotonic() + self.cfg.peer_timeout
        while time.monotonic() < deadline and not self.store.check([self._key("done", 0)]):
            time.sleep(0.05)

    def _wait_for_the_others(self) -> None:
        """Rank 0 hosts the store (under the deepspeed runner and plain env:// launches): if it left first, a
        rank still on its way out (the same bad input, found a moment later) would see the store vanish and
        report rank 0 dead, exit 1, and the launcher could pass that on instead of 2. So rank 0 leaves last,
        bounded by fault.peer_timeout; a rank on this machine whose process is gone is not waited for."""
        deadline = time.monotonic() + self.cfg.peer_timeout
        waiting = set(range(1, self.ctx.world_size))
        while waiting and time.monotonic() < deadline:
            for rank in list(waiting):
                if self.store.check([self._key("done", rank)]):
                    waiting.discard(rank)
                elif self.store.check([self._key("proc", rank)]):
                    host, identity, pid = self.store.get(self._key("proc", rank)).decode().split("\t")
                    if identity == _machine_identity() and not _alive(int(pid)):
                        waiting.discard(rank)
            if waiting:
                time.sleep(0.05)

    def fail(self, error: BaseException, code: int = EXIT_CODE) -> NoReturn:
        """The main thread hit an unexpected error. A failed collective usually means a peer died: give the
        ring a moment to name it, and then that one line is what a person reads (the failed collective's
        traceback, 60 lines through steps.py and the backend, says nothing more: it goes to the stacks file);
        otherwise this rank's own error ends the job, its traceback printed."""
        text = "".join(traceback.format_exception(error))
        if self.store is not None and looks_like_comm_failure(error):
            self._failed_collective = text
            # as long as the watchdog thread may take to name a peer: its timeout, a beat, and a store call that
            # blocks until the store's own timeout when the peer was rank 0 (the store's host)
            deadline = time.monotonic() + self.cfg.peer_timeout + 2 * self.cfg.heartbeat_interval + \
                self.store_timeout
            while time.monotonic() < deadline:  # the watchdog thread exits the process when the flag comes
                time.sleep(0.2)
        print(text, end="", file=sys.stderr, flush=True)
        self.abort(f"rank {self.ctx.rank} on {self.host} failed: {_one_line(error)}", code)

    def abort(self, message: str, code: int = EXIT_CODE, dead: int = 0) -> NoReturn:
        """End the whole job: raise the shared flag, dump stacks, exit. `dead` ranks will not answer."""
        if self.store is not None:
            try:
                self._lock.acquire()  # held until exit: the watchdog thread must not use the store meanwhile
                self.store.set(self._key("abort"), f"{code}\t{message}")
                if self.ctx.rank == 0:  # the store lives in this process: wait until the others have read the
                    # flag (and its exit code), else they would only see the store vanish and report rank 0 dead
                    deadline = time.monotonic() + self.cfg.peer_timeout
                    while self.store.add(self._key("acks"), 0) < self.ctx.world_size - 1 - dead \
                            and time.monotonic() < deadline:
                        time.sleep(0.1)
            except Exception:
                pass
        self._exit(message, code)

    # ------------------------------------------------------------------ the thread
    def _key(self, *parts) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _exit(self, message: str, code: int) -> NoReturn:
        with self._exiting:  # the main thread and the watchdog thread may both get here
            try:
                self.stacks_dir.mkdir(parents=True, exist_ok=True)
                with open(self.stacks_dir / f"rank{self.ctx.rank}.txt", "w") as f:
                    f.write(f"rank {self.ctx.rank} on {self.host}, pid {os.getpid()}: {message}\n\n")
                    if self._failed_collective:
                        f.write(f"the main thread's failed collective:\n{self._failed_collective}\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                where = f"; Python stacks of every rank in {self.stacks_dir}"
            except OSError:
                where = ""
            print(f"error: rank {self.ctx.rank} stopping: {message}{where}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if self.store is not None and self.ctx.rank != 0:
                try:
                    self._lock.acquire(timeout=5)
                    self.store.add(self._key("acks"), 1)
                except Exception:
                    pass
            os._exit(code)

    def _run(self) -> None:
        interval = self.cfg.heartbeat_interval
        beats, store_ok = 0, time.monotonic()
        peer = (self.ctx.rank + 1) % self.ctx.world_size
        peer_info: list[str] | None = None
        rank0_info: list[str] | None = None
        peer_beat, peer_seen = None, time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            if self._armed and now - self._last_progress > self.cfg.stall_timeout:
                self.abort(f"no progress for {self.cfg.stall_timeout:.0f} s on rank {self.ctx.rank} ({self.host}): "
                           f"a stuck collective or a data stall (raise fault.stall_timeout if a step, eval or save "
                           f"really takes that long)")
            if self.store is None:
                continue
            try:
                self._lock.acquire()
                beats += 1
                self.store.set(self._key("beat", self.ctx.rank), str(beats))
                if self.store.check([self._key("abort")]):
                    code, _, message = self.store.get(self._key("abort")).decode().partition("\t")
                    self._exit(message, int(code))
                if rank0_info is None and self.store.check([self._key("proc", 0)]):
                    rank0_info = self.store.get(self._key("proc", 0)).decode().split("\t")
                if peer_info is None and self.store.check([self._key("proc", peer)]):
                    peer_info = self.store.get(self._key("proc", peer)).decode().split("\t")
                if peer_info is not None and not self.store.check([self._key("done", peer)]):
                    host, identity, pid = peer_info
                    if identity == _machine_identity() and not _alive(int(pid)):
                        self.abort(f"rank {peer} on {host} (pid {pid}) died", dead=1)
                    beat = self.store.get(self._key("beat", peer)) if self.store.check(
                        [self._key("beat", peer)]) else None
                    if beat != peer_beat:
                        peer_beat, peer_seen = beat, now
                    elif now - peer_seen > self.cfg.peer_timeout - interval:
                        self.abort(f"rank {peer} on {host} stopped responding: no heartbeat for "
                                   f"{now - peer_seen:.0f} s (killed, out of memory, or its node is lost)", dead=1)
                store_ok = now
                self._lock.release()
            except Exception as error:  # the store is gone or unreachable
                self._lock.release()
                if self._stop.is_set():
                    return
                if rank0_info is not None and rank0_info[1] == _machine_identity() and not _alive(int(rank0_info[2])):
                    self._exit(f"rank 0 on {rank0_info[0]} (pid {rank0_info[2]}) died", EXIT_CODE)
                if now - store_ok > self.cfg.peer_timeout - interval:
                    self._exit(f"lost the rendezvous store at {env.master()[0]}:"
                               f"{env.master()[1]} for {now - store_ok:.0f} s: rank 0 (which hosts it) "
                               f"or its node is gone ({_one_line(error)})", EXIT_CODE)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
