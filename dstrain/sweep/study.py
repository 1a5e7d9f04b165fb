"""The study: Optuna's storage, sampler and pruner, and the worker that runs trials as train.py run directories.

Optuna keeps the study (trials, parameters, reported values, states) in a database every worker reaches. What it
does not do for a study of multi-process training runs, and this module adds:
  - a trial is a launched process (train.py under torchrun, or alone for one rank), polled through its
    metrics.jsonl; pruning it writes the STOP file of its run directory (run/preempt.py), so it saves a checkpoint
    and exits 75, resumable later;
  - ownership: the worker running a trial holds an flock on claims/trial_N.lock. The kernel drops it when the worker
    dies however it dies (SIGKILL, a lost node once the file system's lease expires), so a restarted worker, or
    another SLURM array task, adopts a RUNNING trial nobody holds and resumes it from its checkpoint (--resume auto),
    with no heartbeat or timeout to tune; no trial is run twice or lost;
  - reproducibility: parameters are drawn by a sampler seeded from (seed, trial number), and a trial is judged at a
    step against the trials numbered before it, once each has been judged at that step or has ended. Optuna's own
    MedianPruner compares with the trials COMPLETE at that moment, which depends on which finished first; here the
    same sweep file gives the same trials, values, prunings and table whether trials ran 1 or 4 at a time, on one
    worker or several, interrupted or not (TPE's later draws still depend on which trials had finished).
"""
from __future__ import annotations

import copy
import ctypes
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import optuna
import yaml
from optuna.trial import TrialState

from .. import env
from ..config import load_recipe
from ..errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_SAVE_FAILED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    UserError,
)
from ..paths import REPO_ROOT
from ..run import run_lock
from ..run.preempt import STOP_FILE
from .spec import Sweep

POLL_S = 0.5
FINAL = {EXIT_USER_ERROR, EXIT_NONFINITE, EXIT_SAVE_FAILED, EXIT_INTERRUPTED}  # exits a resume would repeat (errors.py)


def yaml_scalar(value) -> str:
    """A value as train.py's --key=value override reads it back exactly (floats keep every digit and a dot)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return text[:-3].strip() if text.endswith("...") else text


def override_args(overrides: dict, prefix: str = "") -> list[str]:
    args = []
    for key, value in overrides.items():
        if isinstance(value, dict):
            args += override_args(value, f"{prefix}{key}.")
        else:
            args.append(f"--{prefix}{key}={yaml_scalar(value)}")
    return args


class Lock:
    """An exclusive flock on a file, held until release (or the holder's death)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.handle = path, None

    def take(self, wait: bool = True) -> bool:
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            self.handle.close()
            self.handle = None
            return False
        return True

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def __enter__(self):
        self.take()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _sampler_for(kind: str, seed: int):
    return optuna.samplers.TPESampler(seed=seed) if kind == "tpe" else optuna.samplers.RandomSampler(seed=seed)


def trial_seeded_sampler(kind: str, seed: int):
    """Optuna's random or TPE sampler, made afresh for each trial with the seed (seed, trial number): what a trial
    draws does not depend on which process asked for it or how many draws came before (a restarted or
    distributed study would otherwise draw trial 5 from a generator that drew trials 0-4 elsewhere). Optuna's
    samplers keep no other state between trials: the history TPE uses is read from the study each time."""

    class TrialSeeded(optuna.samplers.BaseSampler):
        def __init__(self):
            self._made: tuple[int, object] | None = None

        def _for(self, trial):
            if self._made is None or self._made[0] != trial.number:
                self._made = (trial.number, _sampler_for(kind, seed * 100_003 + trial.number))
            return self._made[1]

        def infer_relative_search_space(self, study, trial):
            return self._for(trial).infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self._for(trial).sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self._for(trial).sample_independent(study, trial, param_name, param_distribution)

    return TrialSeeded()


class Peers:
    """The study as the pruner sees it when it judges trial k at step s: the trials numbered before k that reported
    at s (each shown as finished, with its values up to s). Everything else is the real study."""

    def __init__(self, study, trials: list, step: int):
        self._study, self._peers = study, []
        for trial in trials:
            if step in trial.intermediate_values and trial.state != TrialState.FAIL:
                seen = copy.copy(trial)
                seen.state = TrialState.COMPLETE
                seen.intermediate_values = {t: v for t, v in trial.intermediate_values.items() if t <= step}
                self._peers.append(seen)

    def get_trials(self, deepcopy: bool = True, states=None) -> list:
        return [t for t in self._peers if states is None or t.state in states]

    def __getattr__(self, name):
        return getattr(self._study, name)


def judged_step(trial) -> int:
    return int(trial.user_attrs.get("judged_step", 0))


def ready_to_judge(trials: list, number: int, step: int) -> bool:
    """Trial `number` may be judged at `step` once every trial before it has been judged there or has ended."""
    return all(t.state.is_finished() or judged_step(t) >= step for t in trials if t.number < number)


def open_study(sweep: Sweep):
    """The study of this sweep file (made, or loaded and checked to ask the same questions)."""

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = sweep.run_root
    root.mkdir(parents=True, exist_ok=True)
    with Lock(root / ".study.lock"):
        claim_output_dir(sweep)
        study = optuna.create_study(storage=sweep.storage_url(), study_name=sweep.study_name, load_if_exists=True,
                                    direction=sweep.direction, sampler=trial_seeded_sampler(sweep.sampler, sweep.seed),
                                    pruner=sweep.pruner.make())
        fingerprint = json.loads(json.dumps(sweep.fingerprint()))
        saved = study.user_attrs.get("sweep")
        if saved is None:
            study.set_user_attr("sweep", fingerprint)
            for params in sweep.grid or []:
                study.enqueue_trial(params)
        elif saved != fingerprint:
            changed = sorted(k for k in fingerprint if fingerprint.get(k) != saved.get(k))
            raise UserError(f"study {sweep.study_name!r} in {sweep.storage_url()} was made from another sweep "
                            f"({', '.join(changed)} differ); keep the file as it was to continue it, or give a new "
                            f"output_dir (or study_name) for a new study")
    return study


def launcher_words(ranks: int = 2) -> str:
    """The launcher as a person types it from any shell, active virtualenv or not: the torchrun (or, for a trial of
    one rank, the python) beside this interpreter, relative to the repository when it lives there as `train.py`
    does; else the interpreter's own module."""
    name = "python" if ranks == 1 else "torchrun"
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        absolute = beside.absolute()
        return str(absolute.relative_to(REPO_ROOT)) if absolute.is_relative_to(REPO_ROOT) else str(absolute)
    return shlex.quote(sys.executable) + ("" if ranks == 1 else " -m torch.distributed.run")


STUDY_FILE = "study.json"  # in the output directory: the one study whose trial directories it holds


def claim_output_dir(sweep: Sweep) -> None:
    """An output directory holds the trials of one study: trial_000 of a second study would be the first's
    (issue 69: the new trial 0 was refused by train.py as the old one's checkpoints, and the old study's
    trials.tsv and best.json were rewritten with one failed row). The first study to open it is recorded in
    study.json; another is refused here, before any trial starts and before anything is written."""
    root = sweep.run_root
    path = root / STUDY_FILE
    if path.is_file():
        owner = json.loads(path.read_text()).get("study_name")
    elif sweep.storage is None:  # a directory from before study.json: its default storage names its studies
        db = root / "study.db"
        names = optuna.get_all_study_names(f"sqlite:///{db.resolve()}") if db.is_file() else []
        owner = names[0] if len(names) == 1 else "another study" if names or list(root.glob("trial_*")) else None
    else:  # a shared database holds many studies; nothing here says which one made the trial directories
        owner = None
    if owner is not None and owner != sweep.study_name:
        raise UserError(f"{root} holds the trials of study {owner!r}, and this is study {sweep.study_name!r}; give it "
                        f"its own directory (--output_dir={root.parent / sweep.study_name}), or continue {owner!r} "
                        f"with --study_name={owner}")
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"study_name": sweep.study_name, "sweep": str(sweep.path)}) + "\n")


def _die_with_parent() -> None:
    """In the trial's launcher, before exec: SIGTERM when the worker dies (Linux), so torchrun stops its ranks (a
    rank stopped by a signal saves a checkpoint first) instead of training on, orphaned."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class TrialRun:
    number: int
    trial_id: int
    params: dict
    run_dir: Path
    max_steps: int
    claim: Lock
    process: subprocess.Popen | None = None
    log: IO | None = None
    restarts: int = 0
    pruned_at: int | None = None  # the step it was judged hopeless at
    judged: int = 0  # the last step it was judged at
    exit_code: int | None = None
    reported: set = field(default_factory=set)
    handle: object = None  # optuna.trial.Trial: reports and attributes go to the storage through it
    log_from: int = 0  # where this launch's output starts in the trial's log


class Worker:
    """Runs trials of one study, `sweep.parallel` at a time, until the study has all its trials."""

    def __init__(self, sweep: Sweep, study, devices: list[str] | None):
        self.sweep, self.study, self.devices = sweep, study, devices
        self.root = sweep.run_root
        self.running: dict[int, TrialRun] = {}  # slot -> trial with a live process or decisions to make
        self.finishing: list[TrialRun] = []  # processes ended, decisions still waiting on earlier trials
        self.stopping: str | None = None
        self.user_error: str | None = None

    # ------------------------------------------------------------------ launching
    def command(self, run: TrialRun, slot: int | None = None, resume: bool = False) -> tuple[list[str], dict]:
        """(argv, extra environment) of a trial: torchrun with --standalone (a free rendezvous port of its own), or
        for one rank the interpreter itself (train.py runs one rank without a launcher: no torchrun agent, 2-3 s
        and an interpreter less per trial on 2 cores, measured)."""
        sweep = self.sweep
        launcher = [sys.executable] if sweep.ranks_per_trial == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={sweep.ranks_per_trial}"]
        argv = [*launcher, str(REPO_ROOT / "train.py"), "--recipe", sweep.recipe,
                *(["--ds_config", sweep.ds_config] if sweep.ds_config else []), "--output_dir", str(run.run_dir),
                "--resume", "auto" if resume else "never", *override_args(sweep.overrides(run.params))]
        extra = {}
        if self.devices is None:  # CPU ranks: the machine's cores split between the trials at once
            extra["OMP_NUM_THREADS"] = env.omp_threads() or str(
                max(1, len(os.sched_getaffinity(0)) // (sweep.parallel * sweep.ranks_per_trial)))
        elif slot is not None:
            first = slot * sweep.ranks_per_trial
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices[first:first + sweep.ranks_per_trial])
        return argv, extra

    def shown_command(self, run: TrialRun, output_dir: str | None = None) -> str:
        """The command a person types to run this trial again (the CPU thread count included: it changes sums)."""
        argv, extra = self.command(run)
        argv = argv[:]
        argv[argv.index("--output_dir") + 1] = output_dir or str(run.run_dir)
        recipe = Path(self.sweep.recipe)
        argv[argv.index("--recipe") + 1] = str(recipe.relative_to(REPO_ROOT) if recipe.is_relative_to(REPO_ROOT)
                                               else recipe)
        script = argv.index(str(REPO_ROOT / "train.py"))
        argv[script] = "train.py"
        del argv[argv.index("--resume"):argv.index("--resume") + 2]
        prefix = "".join(f"{k}={v} " for k, v in extra.items() if k == "OMP_NUM_THREADS")
        options = argv[3:script] if self.sweep.ranks_per_trial > 1 else []  # torchrun's own: --standalone ...
        return prefix + launcher_words(self.sweep.ranks_per_trial) + " " + shlex.join(options + argv[script:])

    def launch(self, run: TrialRun, slot: int, resume: bool) -> None:
        argv, extra = self.command(run, slot, resume)
        (self.root / "logs").mkdir(exist_ok=True)
        run.log = open(self.root / "logs" / f"trial_{run.number:03d}.log", "a")
        run.log_from = run.log.tell()
        run.log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {'resume' if resume else 'start'}: "
                      f"{' '.join(argv)}\n")
        run.log.flush()
        run.process = subprocess.Popen(argv, cwd=REPO_ROOT, env=os.environ | extra, stdout=run.log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        run.exit_code = None

    def _trial_run(self, trial, claim: Lock) -> TrialRun:
        run_dir = self.root / f"trial_{trial.number:03d}"
        recipe = load_recipe(self.sweep.recipe, self.sweep.overrides(trial.params))
        # FrozenTrial's _trial_id is how Optuna's own ask-and-tell code names a trial to its storage
        return TrialRun(trial.number, trial._trial_id, dict(trial.params), run_dir, recipe.train.max_steps, claim,
                        restarts=int(trial.user_attrs.get("restarts", 0)), reported=set(trial.intermediate_values),
                        judged=judged_step(trial),
                        handle=optuna.trial.Trial(self.study, trial._trial_id))

    def _set(self, run: TrialRun, key: str, value) -> None:
        run.handle.set_user_attr(key, value)

    def next_trial(self, slot: int) -> TrialRun | None:
        """Adopt a RUNNING trial nobody holds (its worker died), else ask a new one while the budget lasts."""
        if self.stopping:
            return None
        with Lock(self.root / ".study.lock"):
            trials = self.study.get_trials(deepcopy=False)
            for trial in trials:
                if trial.state != TrialState.RUNNING or any(r.number == trial.number for r in self._mine()):
                    continue
                claim = Lock(self.root / "claims" / f"trial_{trial.number:03d}.lock")
                if claim.take(wait=False):
                    run = self._trial_run(trial, claim)
                    self._wait_run_dir_free(run)
                    self.launch(run, slot, resume=True)
                    self._say(f"trial {run.number}: resumed from {run.run_dir} (its worker had stopped)")
                    return run
            if self.user_error:
                return None
            if sum(t.state != TrialState.WAITING for t in trials) >= self.sweep.trials:
                return None
            trial = self.study.ask(fixed_distributions=self.sweep.distributions)
            claim = Lock(self.root / "claims" / f"trial_{trial.number:03d}.lock")
            claim.take()
            run = self._trial_run(self.study.get_trials(deepcopy=False)[trial.number], claim)
            self._set(run, "run_dir", str(run.run_dir))
            self._set(run, "command", self.shown_command(run))
            self.launch(run, slot, resume=False)
            self._say(f"trial {run.number}: {_params(run.params)} -> {run.run_dir}")
            return run

    def _wait_run_dir_free(self, run: TrialRun, timeout: float = 300.0) -> None:
        """A trial whose worker died may still be saving (its launcher got SIGTERM): wait for its run lock."""
        if not run.run_dir.exists():
            return
        lock, deadline = Lock(run.run_dir / run_lock.LOCK_FILE), time.time() + timeout
        while not lock.take(wait=False):
            if time.time() > deadline:
                raise UserError(f"{run.run_dir} stays in use by another process; stop it, then run the sweep again")
            time.sleep(POLL_S)
        lock.release()

    def _mine(self) -> list[TrialRun]:
        return list(self.running.values()) + self.finishing

    # ------------------------------------------------------------------ watching
    def _evals(self, run: TrialRun) -> list[tuple[int, float]]:
        rows = []
        path = run.run_dir / "metrics.jsonl"
        if not path.exists():
            return rows
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line being written
                continue
            if self.sweep.metric in row and row["step"] > 0:  # step 0's evaluation is before any training
                rows.append((row["step"], float(row[self.sweep.metric])))
        return sorted(dict(rows).items())

    def judge(self, run: TrialRun) -> bool:
        """Report the trial's new evaluations and judge each in order; False while one waits on earlier trials."""
        for step, value in self._evals(run):
            if run.pruned_at is not None:
                return True
            if step <= run.judged:
                continue
            if step not in run.reported:
                run.handle.report(value, step)
                run.reported.add(step)
            trials = self.study.get_trials(deepcopy=False)
            me = trials[run.number]
            if not ready_to_judge(trials, run.number, step):
                return False
            seen = copy.copy(me)
            seen.intermediate_values = {t: v for t, v in me.intermediate_values.items() if t <= step}
            if step < run.max_steps and self.study.pruner.prune(Peers(self.study, trials[:run.number], step), seen):
                run.pruned_at = step
                self._set(run, "pruned_at", step)
                (run.run_dir / STOP_FILE).touch()
                self._say(f"trial {run.number}: pruned at step {step} ({self.sweep.metric}={value:.4g}); it saves a "
                          f"checkpoint and stops")
            self._set(run, "judged_step", step)
            run.judged = step
        return True

    def finish(self, run: TrialRun) -> None:
        """Tell the study how the trial ended; release it."""
        code = run.exit_code
        self._set(run, "exit_code", code)
        evals = self._evals(run)
        if run.pruned_at is not None:
            self.study.tell(run.number, state=TrialState.PRUNED)
        elif code == EXIT_OK and evals and evals[-1][0] == run.max_steps:
            self.study.tell(run.number, evals[-1][1])
            self._say(f"trial {run.number}: {self.sweep.metric}={evals[-1][1]:.6g} after {run.max_steps} steps")
        else:
            why = (f"finished without logging {self.sweep.metric} at step {run.max_steps}" if code == EXIT_OK
                   else f"exit {code}")
            self._set(run, "failure", why)
            self.study.tell(run.number, state=TrialState.FAIL)
            self._say(f"trial {run.number}: failed ({why}); its log: {self.root / 'logs'}/trial_{run.number:03d}.log")
            if code == EXIT_USER_ERROR:
                self.user_error = _last_error(self.root / "logs" / f"trial_{run.number:03d}.log")
        run.claim.release()

    def poll(self, slot: int, run: TrialRun) -> bool:
        """True when the slot is free again."""
        code = run.process.poll()
        if code is None:
            self.judge(run)
            return False
        run.log.close()
        code = rank_exit_code(run, code)
        run.exit_code = code
        if self.stopping and run.pruned_at is None and code != EXIT_OK:
            run.claim.release()  # left RUNNING (saved, or killed before it could): the next start resumes it
            self._say(f"trial {run.number}: stopped with a checkpoint; the sweep resumes it when started again")
            return True
        retry = code not in FINAL | {EXIT_OK} and run.pruned_at is None and run.restarts < self.sweep.retries
        if retry and not self.stopping:
            run.restarts += 1
            self._set(run, "restarts", run.restarts)
            self._say(f"trial {run.number}: exit {code}; resuming it from its checkpoint ({run.restarts} of "
                      f"{self.sweep.retries} retries)")
            self.launch(run, slot, resume=True)
            return False
        self.finishing.append(run)
        return True

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        slots = list(range(self.sweep.parallel))
        while True:
            for slot in slots:
                run = self.running.get(slot)
                if run is not None and self.poll(slot, run):
                    del self.running[slot]
            for run in list(self.finishing):
                if self.judge(run):
                    self.finishing.remove(run)
                    self.finish(run)
            for slot in slots:
                if slot not in self.running:
                    run = self.next_trial(slot)
                    if run is None:
                        break
                    self.running[slot] = run
            if not self.running and not self.finishing:
                break
            time.sleep(POLL_S)
        if self.user_error:
            raise UserError(self.user_error)
        if self.stopping:
            return EXIT_STOPPED
        states = {t.state for t in self.study.get_trials(deepcopy=False)}
        return EXIT_FAILED if TrialState.FAIL in states and TrialState.COMPLETE not in states else EXIT_OK

    def _on_signal(self, signum, frame) -> None:
        if self.stopping:
            return
        self.stopping = signal.Signals(signum).name
        print(f"sweep: {self.stopping}: asking the running trials to save and stop (run the sweep again to "
              f"continue)", file=sys.stderr, flush=True)
        for run in self.running.values():
            if run.run_dir.exists():
                (run.run_dir / STOP_FILE).touch()
            elif run.process is not None:
                run.process.terminate()

    def _say(self, text: str) -> None:
        print(f"sweep: {text}", file=sys.stderr, flush=True)


def rank_exit_code(run: TrialRun, code: int) -> int:
    """torchrun exits 1 whatever its ranks exited with (a one-rank trial, run without it, exits with its own code);
    its failure report names the first failed rank's code (2: the trial's input was refused, 65: steps were not
    finite...), which says whether resuming could help."""
    if code != 1:
        return code
    with open(run.log.name, errors="replace") as log:
        log.seek(run.log_from)
        found = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", log.read(), re.M)
    return int(found[0]) if found else code


def _params(params: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error: ")]
    return lines[-1][len("error: "):] if lines else f"a trial failed on its input; see {log}"


def devices() -> list[str] | None:
    """The GPUs trials are given (disjoint sets), or None on a machine without them (CPU ranks)."""
    visible = env.visible_gpus()
    if visible is not None:
        return visible or None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    count = sum(line.startswith("GPU ") for line in out.splitlines())
    return [str(i) for i in range(count)] or None


def check_devices(sweep: Sweep, gpus: list[str] | None) -> None:
    if gpus is not None and sweep.parallel * sweep.ranks_per_trial > len(gpus):
        raise UserError(f"parallel={sweep.parallel} trials of ranks_per_trial={sweep.ranks_per_trial} need "
                        f"{sweep.parallel * sweep.ranks_per_trial} GPUs; this machine shows {len(gpus)}: lower "
                        f"parallel or ranks_per_trial")

