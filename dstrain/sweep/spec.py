"""A sweep file: a recipe, the keys that vary and how, what to optimise, how many trials and how many at once.

Everything in it is checked here, in one pass, before a study is opened or a trial starts: each key of the search
space is a recipe key (the recipe's own check, with its hints), both ends of every range and every listed value make
a valid recipe, the metric is one the trials' evaluations log, and the knobs are in range.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml

from ..config import Recipe, find_file, load_recipe, merge, parse_overrides, unknown_keys
from ..data.load import has_validation
from ..errors import UserError, closest
from ..paths import REPO_ROOT

SWEEPS_DIR = REPO_ROOT / "sweeps"
SAMPLERS = ("auto", "random", "tpe", "grid")
PRUNERS = ("median", "successive_halving", "none")


@dataclass
class Range:
    """A numeric range: floats, or integers when both ends are integers (and `step`, if given, is one)."""
    low: float
    high: float
    log: bool = False
    step: float | None = None

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high)) and \
            (self.step is None or float(self.step).is_integer())

    def distribution(self):
        if self.integer:
            return optuna.distributions.IntDistribution(int(self.low), int(self.high), log=self.log,
                                                        step=int(self.step or 1))
        return optuna.distributions.FloatDistribution(float(self.low), float(self.high), log=self.log,
                                                      step=self.step)


@dataclass
class Pruner:
    type: str = "median"  # median | successive_halving | none
    startup_trials: int = 2  # median: trials that must have reached a step before any is judged at it
    warmup_steps: int = 0  # median: no trial is judged before this optimizer step
    min_resource: int | str = "auto"  # successive_halving: steps of the first rung
    reduction_factor: int = 3  # successive_halving: the share kept at each rung is 1 / this

    def make(self):
        if self.type == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=self.startup_trials, n_warmup_steps=self.warmup_steps)
        if self.type == "successive_halving":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=self.min_resource,
                                                          reduction_factor=self.reduction_factor)
        return optuna.pruners.NopPruner()


@dataclass
class Sweep:
    """The sweep file's keys (docs/sweeps.md shows each)."""
    recipe: str  # the recipe every trial starts from (a name in recipes/ or a path)
    space: dict  # recipe key -> a list of values, or {low, high, log, step}
    ds_config: str | None = None  # the DeepSpeed JSON (default: the recipe's)
    fixed: dict = field(default_factory=dict)  # recipe keys set the same in every trial
    metric: str = "eval_loss"  # a figure the trials' evaluations log
    direction: str = "minimize"  # minimize | maximize
    sampler: str = "auto"  # auto (grid when every key is a list, else tpe) | random | tpe | grid
    seed: int = 0  # the sampler's seed: a trial's parameters depend on it and the trial's number only
    trials: int | None = None  # how many trials in all (default: the grid's size; required otherwise)
    parallel: int = 1  # trials at once in one `python -m dstrain.sweep` (a SLURM array: per task)
    ranks_per_trial: int = 1  # ranks (GPUs; CPU ranks without GPUs) of each trial
    pruner: Pruner = field(default_factory=Pruner)
    retries: int = 2  # a trial that fails the way a run is restarted for (a dead rank) resumes this many times
    output_dir: str | None = None  # default runs/sweeps/<sweep file name>
    storage: str | None = None  # Optuna storage URL (default sqlite:///<output_dir>/study.db); PostgreSQL across nodes
    study_name: str | None = None  # default: the sweep file's name
    path: Path = Path()  # the sweep file (set by load)

    @property
    def distributions(self) -> dict:
        return {key: optuna.distributions.CategoricalDistribution(value) if isinstance(value, list)
                else value.distribution() for key, value in self.space.items()}

    @property
    def grid(self) -> list[dict] | None:
        """Every combination, in file order, when the sampler is the grid."""
        if self.sampler != "grid":
            return None
        keys = list(self.space)
        return [dict(zip(keys, values)) for values in itertools.product(*(self.space[k] for k in keys))]

    @property
    def run_root(self) -> Path:
        return Path(self.output_dir)

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.run_root / 'study.db').resolve()}"

    def overrides(self, params: dict) -> dict:
        """The recipe overrides of one trial: the fixed keys, then its parameters (and, unless set, the study's name
        as the trial's wandb group)."""
        nested: dict = {}
        group = {} if "log.wandb_group" in self.fixed or "log.wandb_group" in self.space else \
            {"log.wandb_group": self.study_name}
        for key, value in list(self.fixed.items()) + list(params.items()) + list(group.items()):
            node = nested
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return nested

    def fingerprint(self) -> dict:
        """What a study is bound to: a restarted sweep must ask the same questions (output_dir, parallel and
        storage may change between restarts)."""
        return {"recipe": str(Path(self.recipe)), "ds_config": self.ds_config, "fixed": self.fixed,
                "space": {k: v if isinstance(v, list) else dataclasses.asdict(v) for k, v in self.space.items()},
                "metric": self.metric, "direction": self.direction, "sampler": self.sampler, "seed": self.seed,
                "ranks_per_trial": self.ranks_per_trial, "pruner": dataclasses.asdict(self.pruner)}


def _flatten(tree: dict, prefix: str = "", leaves: tuple = ()) -> dict:
    """{train: {lr: x}} and {train.lr: x} alike -> {"train.lr": x}; a mapping with a key in `leaves` is a value."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and not set(value) & set(leaves):
            out.update(_flatten(value, f"{prefix}{key}.", leaves))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _number(where: str, value: Any) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}={value!r} should be a number")
    return value


def _range(key: str, raw: Any) -> Range | list:
    where = f"space.{key}"
    if isinstance(raw, list):
        if not raw:
            raise UserError(f"{where} is an empty list; give the values to try, e.g. [1.0e-3, 3.0e-3]")
        if len({repr(v) for v in raw}) != len(raw):
            raise UserError(f"{where} lists a value twice: {raw}")
        return raw
    if not isinstance(raw, dict):
        raise UserError(f"{where}={raw!r} should be a list of values or a range {{low: A, high: B, log: true}}")
    unknown = set(raw) - {"low", "high", "log", "step"}
    if unknown:
        word = sorted(unknown)[0]
        raise UserError(f"{where} has unknown key '{word}'{closest(word, ['low', 'high', 'log', 'step'])}; a range "
                        f"is {{low, high, log, step}}")
    if "low" not in raw or "high" not in raw:
        raise UserError(f"{where} needs both low and high, e.g. {{low: 1.0e-4, high: 1.0e-2, log: true}}")
    low, high = _number(f"{where}.low", raw["low"]), _number(f"{where}.high", raw["high"])
    step = _number(f"{where}.step", raw["step"]) if raw.get("step") is not None else None
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise UserError(f"{where}.log={log!r} should be true or false")
    if not low < high:
        raise UserError(f"{where} is an empty range (low={low}, high={high}); make low < high, or fix the value in "
                        f"`fixed:`")
    if log and low <= 0:
        raise UserError(f"{where}: a log range needs low > 0 (got {low})")
    if log and step is not None:
        raise UserError(f"{where}: a log range has no step; drop one of them")
    if step is not None and (step <= 0 or step > high - low):
        raise UserError(f"{where}.step={step} must be positive and at most high - low")
    return Range(low, high, log, step)


def _as_int(where: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"{where}={value!r} must be an integer >= {least}")
    return value


def _check_key(where: str, key: str) -> None:
    """A recipe key of the sweep file, with the recipe's own spelling hints (`train.learning_rate`: here `train.lr`)."""
    nested: dict = {}
    node = nested
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = None
    unknown = unknown_keys(Recipe, nested, "")
    if unknown:
        raise UserError(f"{where}.{key}: unknown recipe key {unknown[0]}")


def _check_trial_recipe(sweep: Sweep, params: dict, what: str) -> None:
    """The recipe a trial would run with these parameters, built and checked as train.py checks it."""
    try:
        recipe = load_recipe(sweep.recipe, sweep.overrides(params))
    except UserError as error:
        raise UserError(f"{what}: {error}") from None
    from ..objectives import evaluation_keys
    keys = evaluation_keys(recipe)
    if not has_validation(recipe.data):  # every metric a sweep can read is an evaluation's
        raise UserError(f"{what}: metric {sweep.metric!r} comes from evaluation, and the trial would have none: "
                        f"data.val_fraction is 0 and {recipe.data.path} has no validation split; set "
                        f"data.val_fraction (e.g. 0.05) in `fixed:`, or point data.path at data with a validation "
                        f"file")
    if not any(fnmatch.fnmatchcase(sweep.metric, pattern) for pattern in keys):
        plain = [k for k in keys if "*" not in k]
        raise UserError(f"metric {sweep.metric!r} is never logged by this recipe's evaluations"
                        f"{closest(sweep.metric, plain)}; they log {', '.join(keys)}")
    if recipe.eval.every == 0 and sweep.pruner.type != "none":
        raise UserError("eval.every is 0: a trial reports its metric only at the end, so nothing could be pruned; "
                        "set eval.every in `fixed:` (e.g. a quarter of train.max_steps) or pruner: {type: none}")


def load(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """The sweep file at `path` (or a name in sweeps/), with `--key=value` overrides of its own keys, checked."""
    file = find_file(path, SWEEPS_DIR, ".yaml", "sweep file")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"sweep file {file} is not valid YAML{where}; fix that line") from None
    if not isinstance(raw, dict):
        raise UserError(f"sweep file {file} should be a mapping with recipe, space, trials, ...")
    raw = merge(raw, parse_overrides(overrides or []))
    names = [f.name for f in dataclasses.fields(Sweep) if f.name != "path"]
    for key in raw:
        if key not in names:
            raise UserError(f"sweep file {file}: unknown key '{key}'{closest(key, names)}")
    for key in ("recipe", "space"):
        if key not in raw:
            raise UserError(f"sweep file {file} has no `{key}:`; docs/sweeps.md shows a complete one")
    space_raw = raw["space"]
    if not isinstance(space_raw, dict) or not space_raw:
        raise UserError("space: should map recipe keys to values or ranges, e.g. `train.lr: {low: 1.0e-4, high: "
                        "1.0e-2, log: true}`")
    fixed_raw = raw.get("fixed") or {}
    if not isinstance(fixed_raw, dict):
        raise UserError("fixed: should map recipe keys to values, e.g. `train.max_steps: 100`")
    pruner_raw = raw.get("pruner") or {}
    if isinstance(pruner_raw, str):
        pruner_raw = {"type": pruner_raw}
    pruner_names = [f.name for f in dataclasses.fields(Pruner)]
    for key in pruner_raw:
        if key not in pruner_names:
            raise UserError(f"pruner: unknown key '{key}'{closest(key, pruner_names)}")
    pruner = Pruner(**pruner_raw)
    if pruner.type not in PRUNERS:
        raise UserError(f"pruner.type={pruner.type!r} is not one of {', '.join(PRUNERS)}"
                        f"{closest(str(pruner.type), PRUNERS)}")
    _as_int("pruner.startup_trials", pruner.startup_trials, 0)
    _as_int("pruner.warmup_steps", pruner.warmup_steps, 0)
    _as_int("pruner.reduction_factor", pruner.reduction_factor, 2)
    if pruner.min_resource != "auto":
        _as_int("pruner.min_resource", pruner.min_resource, 1)

    ranges = _flatten(space_raw, leaves=("low", "high", "log", "step"))
    space = {key: _range(key, value) for key, value in ranges.items()}
    fixed = _flatten(fixed_raw)
    both = sorted(set(space) & set(fixed))
    if both:
        raise UserError(f"{both[0]} is both in space and in fixed; keep one")
    sweep = Sweep(recipe=str(raw["recipe"]), space=space, fixed=fixed, pruner=pruner, path=file,
                  **{k: raw[k] for k in ("ds_config", "metric", "direction", "sampler", "seed", "trials", "parallel",
                                         "ranks_per_trial", "retries", "output_dir", "storage", "study_name")
                     if k in raw})
    if sweep.direction not in ("minimize", "maximize"):
        raise UserError(f"direction={sweep.direction!r} should be minimize or maximize")
    if sweep.sampler not in SAMPLERS:
        raise UserError(f"sampler={sweep.sampler!r} is not one of {', '.join(SAMPLERS)}"
                        f"{closest(str(sweep.sampler), SAMPLERS)}")
    all_lists = all(isinstance(v, list) for v in space.values())
    if sweep.sampler == "auto":
        sweep.sampler = "grid" if all_lists else "tpe"
    if sweep.sampler == "grid" and not all_lists:
        key = next(k for k, v in space.items() if not isinstance(v, list))
        raise UserError(f"sampler=grid needs a list of values for every key; space.{key} is a range")
    _as_int("seed", sweep.seed, 0)
    _as_int("parallel", sweep.parallel, 1)
    _as_int("ranks_per_trial", sweep.ranks_per_trial, 1)
    _as_int("retries", sweep.retries, 0)
    if sweep.trials is None:
        if sweep.grid is None:
            raise UserError("trials: is not set; say how many trials to run (a grid runs every combination by "
                            "default)")
        sweep.trials = len(sweep.grid)
    _as_int("trials", sweep.trials, 1)
    sweep.study_name = sweep.study_name or file.stem
    sweep.output_dir = sweep.output_dir or str(Path("runs") / "sweeps" / file.stem)
    sweep.recipe = str(find_file(sweep.recipe, REPO_ROOT / "recipes", ".yaml", "recipe"))
    if sweep.ds_config is not None:
        find_file(sweep.ds_config, REPO_ROOT / "ds_configs", ".json", "ds_config")

    for where, keys in (("fixed", fixed), ("space", space)):  # each key alone, so a hint names the key it is about
        for key in keys:
            _check_key(where, key)
    # Each end of every range and every listed value, each on its own beside the first of the others.
    first = {k: v[0] if isinstance(v, list) else v.low for k, v in space.items()}
    for key, value in space.items():
        for candidate in (value if isinstance(value, list) else [value.low, value.high]):
            if isinstance(value, Range):
                candidate = int(candidate) if value.integer else float(candidate)
            _check_trial_recipe(sweep, first | {key: candidate}, f"space.{key}={candidate!r}")
    if sweep.storage and not sweep.storage.startswith(("sqlite:", "postgresql", "mysql")):
        raise UserError(f"storage={sweep.storage!r} is not a database URL Optuna opens (sqlite:///path, "
                        f"postgresql://..., mysql://...)")
    return sweep
