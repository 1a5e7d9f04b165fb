"""Sweeps without launching a trial: the sweep file's checks (one line each, before anything is made), the exact
overrides a trial gets, parameters drawn by trial number, pruning judged in trial order (dstrain/sweep/).
The launched studies (uninterrupted, killed and restarted, a SLURM array) are in tests/cluster/test_sweep.py."""
from __future__ import annotations

import json
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from dstrain.config import parse_overrides
from dstrain.errors import UserError
from dstrain.sweep import spec, study
from tests.helpers import ROOT, doc_commands

GOOD = """recipe: tiny/pretrain
fixed: {train.max_steps: 40, eval.every: 10}
space:
  train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}
  train.warmup_steps: {low: 0, high: 20}
trials: 6
"""


def write(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_the_shipped_sweeps_and_the_docs_commands_load():
    shipped = sorted((ROOT / "sweeps").glob("*.yaml"))
    assert shipped
    for path in shipped:
        sweep = spec.load(path)
        assert sweep.trials >= 1 and sweep.space
    commands = [c for _, c in doc_commands() if "dstrain.sweep" in c]
    assert commands, "the docs show no sweep command"
    for command in commands:
        words = command.split()
        args = words[words.index("dstrain.sweep") + 1:]
        spec.load(args[0], [a for a in args[1:] if a.startswith("--") and a not in ("--report", "--check")])


@pytest.mark.parametrize("change,message", [
    ("trails: 6\n", "unknown key 'trails' (did you mean 'trials'?)"),
    ("space: {train.lr: {low: 1.0e-3, high: 1.0e-3}}\n", "space.train.lr is an empty range (low=0.001, high=0.001)"),
    ("space: {train.lr: []}\n", "space.train.lr is an empty list"),
    ("metric: eval_accuracy\n", "metric 'eval_accuracy' is never logged by this recipe's evaluations"),
    ("space: {train.lrr: [1.0e-3, 2.0e-3]}\n", "unknown recipe key 'train.lrr' (did you mean 'lr'?)"),
    ("space: {train.lr: {low: 0, high: 1.0e-2}}\n", "space.train.lr=0.0: train.lr=0.0 must be positive"),
    ("space: {train.lr: {low: 0, high: 1.0e-2, log: true}}\n", "a log range needs low > 0"),
    ("space: {lr: [1.0e-3]}\n", "'lr' at the top level (it belongs in the train section"),
    ("sampler: grid\n", "sampler=grid needs a list of values for every key; space.train.lr is a range"),
    ("fixed: {eval.every: 0}\n", "eval.every is 0: a trial reports its metric only at the end"),
    ("pruner: {type: hyperband}\n", "pruner.type='hyperband' is not one of median, successive_halving, none"),
    ("parallel: 0\n", "parallel=0 must be an integer >= 1"),
    ("recipe: tiny/pretrainn\n", "recipe 'tiny/pretrainn' not found (did you mean 'tiny/pretrain.yaml'?)"),
    # issue 69: the hint named the first space key (`space.lora.r=4: unknown recipe key 'train.learning_rate'`)
    ("space: {lora.r: [4, 8], train.learning_rate: [1.0e-3]}\n",
     "space.train.learning_rate: unknown recipe key 'train.learning_rate' (here it is 'train.lr')"),
    ("space: {lora.rank: [4, 8]}\n", "space.lora.rank: unknown recipe key 'lora.rank' (here it is 'lora.r')"),
    ("fixed: {train.learning_rate: 1.0e-3}\n", "fixed.train.learning_rate: unknown recipe key"),
])
def test_a_bad_sweep_file_is_one_line(tmp_path, change, message):
    key = change.split(":")[0]
    text = "\n".join(line for line in GOOD.splitlines() if not line.startswith(key)
                     and not (key == "space" and line.startswith("  "))) + "\n" + change
    with pytest.raises(UserError) as error:
        spec.load(write(tmp_path, text))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_bad_sweep_file_exits_2_before_anything_is_made(tmp_path):
    """The command a person runs: one line on stderr, exit 2, no output directory, no database."""
    path = write(tmp_path, GOOD.replace("trials: 6", "trials: 6\nmetric: eval_acc"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dstrain.sweep", str(path), f"--output_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: metric 'eval_acc' is never logged")
    assert not out.exists()


def test_metric_names_follow_the_objective(tmp_path):
    dpo = write(tmp_path, GOOD.replace("tiny/pretrain", "tiny/dpo").replace("trials: 6", "trials: 6\nmetric: "
                                                                             "eval_rewards/accuracies"))
    assert spec.load(dpo).metric == "eval_rewards/accuracies"
    with pytest.raises(UserError, match="they log eval_loss, eval_rewards/chosen"):
        spec.load(dpo, ["--metric=perplexity"])  # a preference run has no perplexity
    grpo = write(tmp_path, GOOD.replace("tiny/pretrain", "tiny/grpo").replace("trials: 6", "trials: 6\nmetric: "
                                                                               "eval_rewards/exact_answer/mean"))
    assert spec.load(grpo, ["--fixed.data.val_fraction=0.2"]).metric == "eval_rewards/exact_answer/mean"
    # issue 69: tiny/grpo carves out no validation data, so its trials would log no eval_* figure; --check passed
    # it and both trials failed after 77 s with nothing naming data.val_fraction
    with pytest.raises(UserError, match=r"metric 'eval_reward' comes from evaluation, and the trial would have none: "
                                        r"data.val_fraction is 0 and data/tiny_grpo has no validation split; set "
                                        r"data.val_fraction"):
        spec.load(grpo, ["--metric=eval_reward"])


def test_rl_evaluation_keys_are_what_its_metrics_log():
    """objectives.rl.EVAL_KEYS (what the sweep checks a metric against) equals the keys RL.metrics returns."""
    import fnmatch
    from types import SimpleNamespace

    from dstrain.config import RLSection
    from dstrain.objectives.rl import EVAL_KEYS, RL
    for cfg in (RLSection(reward_funcs=["exact_answer"]), RLSection(reward_funcs=["exact_answer"], beta=0.04),
                RLSection(teacher="recipes/tiny/model")):
        rl = RL(cfg)
        rl.rewards = [SimpleNamespace(name=f) for f in cfg.reward_funcs]
        logged = set(rl.metrics([1.0] * (14 + 3 * len(rl.rewards)), {"completions": 1.0}))
        logged -= {"rollout_s", "rollout_tokens_per_s"}  # speed figures, not something to optimise
        wanted = [key for key, when in EVAL_KEYS.items() if when(cfg)]
        assert all(any(fnmatch.fnmatchcase(k, w) for w in wanted) for k in logged), (logged, wanted)
        assert all(any(fnmatch.fnmatchcase(k, w) for k in logged) for w in wanted), (logged, wanted)


@pytest.mark.parametrize("value", [1e-5, 0.1 + 0.2, 3e-3, 2.5e-10, 1e20, 7, "cosine", True, None, [1, 2], 0.0])
def test_a_trial_override_reads_back_exactly(value):
    """The value train.py parses from a trial's --key=value is the sampled one, to the last bit."""
    assert parse_overrides(study.override_args({"train": {"x": value}}))["train"]["x"] == value


def _ask(storage: str, sampler: str, numbers: int) -> list[dict]:
    s = optuna.load_study(study_name="s", storage=storage, sampler=study.trial_seeded_sampler(sampler, 7))
    dists = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
             "w": optuna.distributions.IntDistribution(0, 20)}
    out = []
    for _ in range(numbers):
        trial = s.ask(dists)
        out.append(trial.params)
        s.tell(trial, 1.0)
    return out


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_trials_parameters_depend_on_its_number_not_on_who_asked(tmp_path, sampler):
    """Trials 0-3 asked by one process, and 0-1 by one then 2-3 by another (a restarted worker, a second SLURM
    task): the same parameters. Optuna's own seeded sampler in the second process starts its generator again and
    draws trial 2 as trial 0 was drawn."""
    urls = [f"sqlite:///{tmp_path}/{name}.db" for name in ("one", "two", "plain")]
    for url in urls:
        optuna.create_study(study_name="s", storage=url)
    once = _ask(urls[0], sampler, 4)
    twice = _ask(urls[1], sampler, 2) + _ask(urls[1], sampler, 2)
    assert once == twice
    assert len({p["lr"] for p in once}) == 4
    plain = optuna.load_study(study_name="s", storage=urls[2], sampler=optuna.samplers.RandomSampler(seed=7))
    first = plain.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}).params
    again = optuna.load_study(study_name="s", storage=urls[2], sampler=optuna.samplers.RandomSampler(seed=7))
    assert again.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}).params == first


def _trial(number: int, state, values: dict, judged: int = 0):
    trial = create_trial(state=TrialState.COMPLETE, value=1.0, intermediate_values=values,
                         user_attrs={"judged_step": judged} if judged else {})
    trial.number, trial.state = number, state
    if state != TrialState.COMPLETE:
        trial.value = None
    return trial


def test_pruning_waits_for_the_trials_before_and_judges_against_them():
    """Trial 2 at step 20 waits while trial 1 runs unjudged there; then it is judged against trials 0 and 1 at step
    20 (running or not, their values up to 20 only). Optuna's MedianPruner on the live study would see no finished
    trial and let trial 2 run: what it sees depends on which trials had finished."""
    t0 = _trial(0, TrialState.COMPLETE, {10: 5.0, 20: 4.0, 30: 3.0}, judged=30)
    t1 = _trial(1, TrialState.RUNNING, {10: 5.1, 20: 4.1}, judged=10)
    t2 = _trial(2, TrialState.RUNNING, {10: 5.5, 20: 4.9})
    assert not study.ready_to_judge([t0, t1, t2], 2, 20)
    assert study.ready_to_judge([t0, t1, t2], 2, 10)
    t1.user_attrs["judged_step"] = 20
    assert study.ready_to_judge([t0, t1, t2], 2, 20)

    class Live:
        direction = optuna.study.StudyDirection.MINIMIZE

        def get_trials(self, deepcopy=True, states=None):
            return [t for t in (t0, t1, t2) if states is None or t.state in states]

    peers = study.Peers(Live(), [t0, t1], 20)
    assert [t.intermediate_values for t in peers.get_trials(states=(TrialState.COMPLETE,))] == \
        [{10: 5.0, 20: 4.0}, {10: 5.1, 20: 4.1}]
    median = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=20)
    assert median.prune(peers, t2)
    assert not median.prune(Live(), t2)  # one COMPLETE trial < startup_trials: Optuna alone would not judge
    better = _trial(2, TrialState.RUNNING, {10: 5.5, 20: 3.9})
    assert not median.prune(peers, better)
    assert not median.prune(study.Peers(Live(), [t0], 20), t2)  # one trial before it: still starting up


def test_a_study_is_bound_to_its_sweep_file(tmp_path):
    sweep = spec.load(write(tmp_path, GOOD), [f"--output_dir={tmp_path / 'out'}"])
    first = study.open_study(sweep)
    assert first.user_attrs["sweep"]["space"]["train.lr"]["log"] is True
    assert study.open_study(spec.load(sweep.path, [f"--output_dir={tmp_path / 'out'}", "--parallel=4"]))
    with pytest.raises(UserError, match=r"was made from another sweep \(seed differ\)"):
        study.open_study(spec.load(sweep.path, [f"--output_dir={tmp_path / 'out'}", "--seed=1"]))


def test_a_second_study_in_an_old_output_directory_is_refused_and_touches_nothing(tmp_path):
    """Issue 69: after the refusal's own advice (a new study_name), `python -m dstrain.sweep b.yaml --output_dir=<the
    first's> --study_name=b` put its trial 0 into the first study's trial_000 and rewrote the first's trials.tsv and
    best.json with one failed row. The command as the user ran it: one line, exit 2, every file as it was."""
    from dstrain.sweep import report

    out = tmp_path / "out"
    first = spec.load(write(tmp_path, GOOD), [f"--output_dir={out}"])
    report.write(first, study.open_study(first))
    (out / "trial_000").mkdir()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    renamed = tmp_path / "lora.yaml"  # a renamed copy: the study name defaults to the file's
    renamed.write_text(GOOD)
    for extra in ([], ["--study_name=lora_r32"]):
        proc = subprocess.run([sys.executable, "-m", "dstrain.sweep", str(renamed), f"--output_dir={out}", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        name = extra[0].split("=")[1] if extra else "lora"
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {out} holds the trials of study 's', and this is study '{name}'; give "
                                      f"it its own directory (--output_dir={tmp_path / name})"), proc.stderr
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert study.open_study(spec.load(first.path, [f"--output_dir={out}"]))  # the first continues as before


def test_a_second_study_in_a_shared_storage_is_refused_by_the_directorys_study_file(tmp_path):
    """With an outside --storage (the docs' PostgreSQL across nodes; an SQLite file outside the directory here) the
    database holds many studies and cannot say whose trial directories these are: study.json, written by the first
    study to open the directory, does. Issue 83: with it never written a second study was accepted into the first's
    directory (its trial_000 the first's) and no test noticed."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    out = tmp_path / "out"
    first = spec.load(write(tmp_path, GOOD), [f"--output_dir={out}", f"--storage={storage}"])
    study.open_study(first)
    assert json.loads((out / study.STUDY_FILE).read_text())["study_name"] == first.study_name
    other = spec.load(first.path, [f"--output_dir={out}", f"--storage={storage}", "--study_name=other"])
    with pytest.raises(UserError, match=f"{out} holds the trials of study 's', and this is study 'other'"):
        study.open_study(other)
    assert study.open_study(spec.load(first.path, [f"--output_dir={tmp_path / 'other'}", f"--storage={storage}",
                                                   "--study_name=other"]))  # its own directory: fine


def test_the_best_command_runs_from_a_shell_without_the_virtualenv(tmp_path):
    """Issue 69: the printed command began with a bare `torchrun`, on PATH only with the virtualenv active. A trial of
    one rank runs as `python train.py` (no torchrun agent): the python beside the sweep's interpreter."""
    run = study.TrialRun(0, 0, {"train.lr": 1e-3, "train.warmup_steps": 5}, tmp_path / "out/trial_000", 40, None)
    for ranks, check in ((2, "--nproc-per-node"), (1, "import torch, deepspeed")):
        sweep = spec.load(write(tmp_path, GOOD), [f"--output_dir={tmp_path / 'out'}", f"--ranks_per_trial={ranks}"])
        words = study.Worker(sweep, None, None).shown_command(run).split()
        launcher = words[1]
        assert launcher not in ("torchrun", "python") and words.index("train.py") == (4 if ranks > 1 else 2), words
        probe = "--help" if ranks > 1 else f"-c '{check}; print(\"{check}\")'"
        proc = subprocess.run(f"{launcher} {probe}", shell=True, cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert proc.returncode == 0 and check in proc.stdout, proc.stderr[-2000:]


def test_a_grid_is_asked_in_file_order(tmp_path):
    text = GOOD.replace("  train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}\n  train.warmup_steps: {low: 0, high: "
                        "20}", "  train.lr: [1.0e-3, 3.0e-3]\n  train.warmup_steps: [0, 5, 10]").replace("trials: 6\n",
                                                                                                    "")
    sweep = spec.load(write(tmp_path, text), [f"--output_dir={tmp_path / 'out'}"])
    assert sweep.sampler == "grid" and sweep.trials == 6
    s = study.open_study(sweep)
    asked = [s.ask(sweep.distributions).params for _ in range(6)]
    assert asked == sweep.grid and asked[1] == {"train.lr": 1e-3, "train.warmup_steps": 5}


def test_the_docs_figures_are_the_benchmarks():
    """docs/sweeps.md quotes bench/sweep.py's saved run (docs/sweep_bench.json): times, steps, prunings."""
    import json
    bench = json.loads((ROOT / "docs/sweep_bench.json").read_text())
    ways, ratios = bench["ways"], bench["ratios"]
    shipped, alone, unpruned = ways["as shipped"], ways["one at a time"], ways["no pruning"]
    page = " ".join((ROOT / "docs/sweeps.md").read_text().split())
    said = (f"6 trials in {shipped['seconds']:.1f} s, 2 at a time ({alone['seconds']:.1f} s one at a time: "
            f"{ratios['one at a time / as shipped']:.2f}x). Median pruning stopped {shipped['pruned']} trials: "
            f"{shipped['steps']} optimizer steps in all instead of {unpruned['steps']} without it, yet the sweep took "
            f"only {ratios['no pruning / as shipped']:.2f}x as long without it")
    assert said in page, said
    pruned = {t["trial"]: t for t in shipped["trials"] if t["state"] == "pruned"}
    won = pruned[unpruned["best_trial"]]
    assert (f"trial {unpruned['best_trial']} reached {unpruned['best_eval_loss']:.4f} against the best finished "
            f"trial's {shipped['best_eval_loss']:.4f} (its warm-up was {won['params']['train.warmup_steps']} steps"
            ) in page
    assert f"best: trial {shipped['best_trial']}, eval_loss={shipped['best_eval_loss']:.6g} " in page  # the example


def test_trials_at_once_get_disjoint_gpus_and_cpu_ranks_split_the_cores(tmp_path, monkeypatch):
    sweep = spec.load(write(tmp_path, GOOD), [f"--output_dir={tmp_path / 'out'}", "--parallel=2",
                                              "--ranks_per_trial=2"])
    run = study.TrialRun(3, 0, {"train.lr": 1e-3, "train.warmup_steps": 5}, tmp_path / "out/trial_003", 40, None)
    gpus = study.Worker(sweep, None, [str(i) for i in range(4)])
    argv, extra = gpus.command(run, slot=1)
    assert extra == {"CUDA_VISIBLE_DEVICES": "2,3"} and "--nproc_per_node=2" in argv
    assert argv[argv.index("--output_dir") + 1] == str(run.run_dir) and "--train.lr=0.001" in argv
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(study.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert study.Worker(sweep, None, None).command(run, slot=1)[1] == {"OMP_NUM_THREADS": "4"}
    with pytest.raises(UserError, match="parallel=2 trials of ranks_per_trial=2 need 4 GPUs; this machine shows 2"):
        study.check_devices(sweep, ["0", "1"])
    shown = gpus.shown_command(run, "runs/again")
    assert shown.startswith(f"{study.launcher_words()} --standalone --nproc_per_node=2 train.py --recipe "
                            "recipes/tiny/pretrain.yaml --output_dir runs/again --train.max_steps=40")


def test_a_trials_exit_code_is_its_ranks_not_torchruns(tmp_path):
    """torchrun exits 1 for any failed rank; the code that says whether to resume (2: refused input, not retried) is
    in its failure report, read from this launch's part of the trial's log only."""
    log = tmp_path / "trial.log"
    log.write_text("  exitcode  : 65 (pid: 1)\n")  # an earlier launch's
    with open(log, "a") as handle:
        run = study.TrialRun(0, 0, {}, tmp_path, 40, None, log=handle, log_from=handle.tell())
        handle.write("error: train.seq_len=100000 exceeds ...\nRoot Cause (first observed failure):\n[0]:\n"
                     "  exitcode  : 2 (pid: 6573)\n[1]:\n  exitcode  : -15 (pid: 6574)\n")
    assert study.rank_exit_code(run, 1) == 2
    assert study.rank_exit_code(run, 0) == 0 and study.rank_exit_code(run, -9) == -9
    run.log_from = log.stat().st_size
    assert study.rank_exit_code(run, 1) == 1  # nothing said: a crash of torchrun itself
