"""Recipe schema: defaults < recipe YAML < dotted CLI overrides, validated with helpful errors.

A recipe is a YAML file with the sections below; every key is documented in README.md.
`--train.max_steps=20` style overrides reach any key. Unknown keys are errors naming the closest one.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError, closest

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "tiny" / "pretrain.yaml"


@dataclass
class ModelConfig:
    name_or_path: str = "recipes/tiny/model"  # hub id or local directory
    from_scratch: str = "auto"  # auto: random init when the directory holds a config but no weights
    tokenizer: str | None = None  # defaults to name_or_path
    config_overrides: dict = field(default_factory=dict)  # e.g. {num_hidden_layers: 2} on top of config.json
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # e.g. sdpa, eager, flash_attention_2

    def __post_init__(self) -> None:
        self.from_scratch = str(self.from_scratch).lower()
        _one_of("model.from_scratch", self.from_scratch, ("auto", "true", "false"))


@dataclass
class DataConfig:
    path: str = "data/tiny"  # hub id, local file (json/jsonl/csv/parquet/txt), directory, saved dataset, prepared dir
    # prepared corpora read by weight over the whole run: [{path: DIR, weight: 0.7}, ...] (then data.path is not read)
    mix: list = field(default_factory=list)
    name: str | None = None  # hub dataset configuration name
    format: str = "text"  # text (packed pretraining) | prompt_response | chat (SFT, loss on responses)
    # several examples per row (SFT), or documents kept apart within rows (text): position_ids restart at each,
    # attention never crosses them, loss masks unchanged
    packing: bool = False
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"  # role/content messages, or ShareGPT's from/value (roles mapped)
    chat_template: str | None = None  # SFT format: null = the tokenizer's | chatml | llama3 | plain | a .jinja path
    role_map: dict = field(default_factory=dict)  # extra chat roles, e.g. {bot: assistant}
    train_split: str = "train"
    val_split: str | None = "validation"  # used when the dataset has it; else val_fraction is carved out
    val_fraction: float = 0.05
    cache_dir: str | None = None  # tokenized-data cache; default ~/.cache/dstrain/tokenized
    num_proc: int = 1

    def __post_init__(self) -> None:
        _one_of("data.format", self.format, ("text", "prompt_response", "chat"))
        from .chat_templates import check
        check(self.chat_template)
        if not 0.0 <= self.val_fraction < 1.0:
            raise UserError(f"data.val_fraction={self.val_fraction} must be in [0, 1); try 0.05")
        for entry in self.mix:
            if not (isinstance(entry, dict) and set(entry) == {"path", "weight"} and isinstance(entry["path"], str)
                    and isinstance(entry["weight"], (int, float)) and entry["weight"] > 0):
                raise UserError(f"data.mix entry {entry!r} must be {{path: <prepared directory>, weight: <positive "
                                f"number>}}")


@dataclass
class TrainConfig:
    max_steps: int = 200
    micro_batch_size: int = 8  # sequences per rank per forward pass
    grad_accum_steps: int = 1
    seq_len: int = 128
    lr: float = 2e-3
    lr_schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    warmup_steps: int = 10  # capped at max_steps
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.1  # applied to matrices only, never to biases and norms
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    precision: str = "auto"  # auto: the DeepSpeed config's (fp32 on CPU) | bf16 | fp16 | fp32
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile the decoder blocks, in the background while the first steps run eager
    compile_wait: bool = False  # with compile: compile in step 1 instead (every step compiled: reproducible runs)
    loss_chunk_tokens: int = 0  # >0: LM head + cross-entropy fused, this many label tokens at a time (big vocabularies)
    mlp_chunk_tokens: int = 0  # >0: each MLP on this many tokens at a time, recomputed in backward (long sequences)
    seed: int = 42
    exit_at_step: int | None = None  # checkpoint and exit after this step; --resume auto continues later

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "seq_len"):
            if getattr(self, name) < 1:
                raise UserError(f"train.{name}={getattr(self, name)} must be a positive integer")
        if self.lr <= 0:
            raise UserError(f"train.lr={self.lr} must be positive")
        if self.warmup_steps < 0:
            raise UserError(f"train.warmup_steps={self.warmup_steps} must be 0 or more")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"train.betas={self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.exit_at_step is not None and not 0 < self.exit_at_step <= self.max_steps:
            raise UserError(f"train.exit_at_step={self.exit_at_step} must be between 1 and train.max_steps")
        if self.loss_chunk_tokens < 0:
            raise UserError(f"train.loss_chunk_tokens={self.loss_chunk_tokens} must be 0 (off) or a token count, "
                            f"e.g. 4096")
        if self.mlp_chunk_tokens < 0:
            raise UserError(f"train.mlp_chunk_tokens={self.mlp_chunk_tokens} must be 0 (off) or a token count, "
                            f"e.g. 8192")
        if self.compile_wait and not self.compile:
            raise UserError("train.compile_wait=true only applies with train.compile=true; set both or neither")
        _one_of("train.lr_schedule", self.lr_schedule, ("cosine", "linear", "constant"))
        _one_of("train.precision", self.precision, ("auto", "bf16", "fp16", "fp32"))


@dataclass
class EvalConfig:
    every: int = 50  # optimizer steps between evaluations; 0 evaluates only at the end
    max_batches: int | None = None  # cap on validation batches per rank; None = the whole split


@dataclass
class CheckpointConfig:
    every: int = 100  # optimizer steps between checkpoints; one is always saved at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted after a newer one is complete
    export_hf: bool = True  # write <output_dir>/hf at the end
    verify: bool = True  # check the checksums of a checkpoint before resuming from it

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise UserError(f"checkpoint.keep_last={self.keep_last} must be at least 1")


@dataclass
class FaultConfig:
    peer_timeout: float = 60.0  # s without a heartbeat from another rank before it is declared dead
    stall_timeout: float = 1800.0  # s without a finished step, eval or save before the run is declared stuck
    heartbeat_interval: float = 2.0  # s between heartbeats (and checks of the ranks' abort flag)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval <= self.peer_timeout / 3:
            raise UserError(f"fault.heartbeat_interval={self.heartbeat_interval} must be positive and at most a "
                            f"third of fault.peer_timeout={self.peer_timeout}")
        if self.stall_timeout <= 0:
            raise UserError(f"fault.stall_timeout={self.stall_timeout} must be positive (seconds)")


@dataclass
class LogConfig:
    wandb: bool = True  # offline when no WANDB_API_KEY is set
    wandb_project: str = "dstrain"
    tensorboard: bool = False  # TensorBoard event files in <run dir>/tensorboard (`tensorboard --logdir runs`)
    run_name: str | None = None
    progress_bar: bool = True
    plot: bool = True  # loss curve PNG at the end
    comm_bytes: bool = True  # log the bytes each rank sends in collectives per step (ring-algorithm count)
    flops_profile_step: int | None = None  # run DeepSpeed's flops profiler on this step -> flops_profile.txt

    def __post_init__(self) -> None:
        if self.flops_profile_step is not None and self.flops_profile_step < 1:
            raise UserError(f"log.flops_profile_step={self.flops_profile_step} must be a step number >= 1 "
                            f"(or null to leave the profiler off)")


@dataclass
class LoraSection:
    """Low-rank adapters (peft's LoRA) on a frozen base: off while r is 0; `--lora.r=16` turns any recipe into one."""
    r: int = 0  # adapter rank; 0 = off (every weight trains)
    alpha: int = 16  # scale alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # peft's meaning: every linear layer but the output head; or a list of names
    modules_to_save: list | None = None  # modules trained in full beside the adapters, e.g. [lm_head]
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"  # none | all | lora_only
    quantize: str | None = None  # 4bit: QLoRA, the frozen base in 4-bit NF4 (bitsandbytes; CUDA only)
    options: dict = field(default_factory=dict)  # any other field of peft.LoraConfig, passed through as given

    def __post_init__(self) -> None:
        if self.r < 0:
            raise UserError(f"lora.r={self.r} must be 0 (off) or a rank such as 16")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout={self.dropout} must be in [0, 1); try 0.05")
        _one_of("lora.bias", self.bias, ("none", "all", "lora_only"))
        if self.quantize is not None:
            self.quantize = str(self.quantize).lower()
            _one_of("lora.quantize", self.quantize, ("4bit",))
        targets = self.target_modules
        if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                             and all(isinstance(t, str) for t in targets))):
            raise UserError(f"lora.target_modules={targets!r} should be all-linear, a regular expression, or a "
                            f"list of module names such as [q_proj, v_proj]")
        if self.r or self.options:
            self.peft_config()  # peft checks its own options now, before anything is built

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def peft_config(self, base: str | None = None):
        """peft's LoraConfig for this section; a misspelled or invalid option is a one-line UserError."""
        import dataclasses as dc

        from peft import LoraConfig
        names = [f.name for f in dc.fields(LoraConfig)]
        own = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules",
               "modules_to_save": "modules_to_save", "use_rslora": "use_rslora", "use_dora": "use_dora",
               "bias": "bias", "task_type": None, "base_model_name_or_path": None}
        for key in self.options:
            if key in own:
                where = f"lora.{own[key]}" if own[key] else "set by dstrain"
                raise UserError(f"lora.options.{key}: {where}, not an option; remove it from lora.options")
            if key not in names:
                raise UserError(f"lora.options.{key} is not a field of peft's LoraConfig{closest(key, names)}")
        try:
            return LoraConfig(r=max(self.r, 1), lora_alpha=self.alpha, lora_dropout=self.dropout,
                              target_modules=self.target_modules, modules_to_save=self.modules_to_save,
                              use_rslora=self.use_rslora, use_dora=self.use_dora, bias=self.bias,
                              task_type="CAUSAL_LM", base_model_name_or_path=base, **self.options)
        except (TypeError, ValueError) as e:
            raise UserError(f"lora: peft refuses these options: {str(e).splitlines()[0]}") from None


@dataclass
class Recipe:
    ds_config: str = "zero2.json"  # file in ds_configs/ or a path; --ds_config overrides
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    # Real recipes name the cluster they were written for; used to check their batch arithmetic.
    world_size: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _one_of(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}{closest(str(value), choices)}")


def find_file(name: str | Path, directory: Path, suffix: str, what: str) -> Path:
    """A path as given, or a name looked up under directory (with or without the suffix)."""
    for candidate in (Path(name), directory / name, directory / f"{name}{suffix}"):
        if candidate.is_file():
            return candidate
    known = sorted(str(p.relative_to(directory)) for p in directory.rglob(f"*{suffix}"))
    shown = directory.relative_to(REPO_ROOT) if directory.is_relative_to(REPO_ROOT) else directory
    # the list stays off the error line (it grows with every shipped file): `ls` shows it
    raise UserError(f"{what} '{name}' not found{closest(str(name), known)}; pass a path, or a name among the "
                    f"{len(known)} in {shown}/ (ls {shown})")


def resolve_recipe_path(name: str | Path) -> Path:
    return find_file(name, RECIPES_DIR, ".yaml", "recipe")


def parse_overrides(items: list[str]) -> dict:
    """['--train.lr=1e-3', '--model.name_or_path', 'x'] -> nested dict; values parsed as YAML scalars."""
    nested: dict = {}
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise UserError(f"unexpected argument '{item}'; overrides look like --train.max_steps=20")
        key, sep, value = item[2:].partition("=")
        if not sep:
            if i + 1 >= len(items) or items[i + 1].startswith("--"):
                raise UserError(f"override --{key} has no value; write --{key}=VALUE")
            value = items[i + 1]
            i += 1
        i += 1
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override --{key} conflicts with another override of '{part}'")
        node[parts[-1]] = parsed
    return nested


def merge(base: dict, update: dict) -> dict:
    """Nested update: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Coerce/validate a value against a dataclass field's type hint, with a one-line error."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, (int, float, bool)) and not isinstance(value, bool):
        return str(value)
    if hint is str and isinstance(value, bool):
        return str(value).lower()
    expected = {int: int, float: float, str: str, bool: bool, list: list, dict: dict}.get(hint)
    if expected is not None:
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if not ok:
            raise UserError(f"{key}={value!r} should be of type {expected.__name__}")
    return value


# Names users bring from the HF Trainer, axolotl and LLaMA-Factory: pointed at ours instead of at the nearest
# spelling (`learning_rate` is not near `lr`). A bare name is in the same section.
ALIASES = {"learning_rate": "lr", "per_device_train_batch_size": "micro_batch_size",
           "micro_batch": "micro_batch_size", "batch_size": "micro_batch_size",
           "gradient_accumulation_steps": "grad_accum_steps", "gradient_accumulation": "grad_accum_steps",
           "max_seq_length": "seq_len", "max_length": "seq_len", "sequence_len": "seq_len", "cutoff_len": "seq_len",
           "num_train_epochs": "max_steps", "epochs": "max_steps", "num_epochs": "max_steps",
           "warmup_ratio": "warmup_steps", "lr_scheduler_type": "lr_schedule", "lr_scheduler": "lr_schedule",
           "gradient_checkpointing": "activation_checkpointing", "bf16": "precision", "fp16": "precision",
           "model_name_or_path": "name_or_path", "base_model": "name_or_path", "dataset": "path",
           "datasets": "path", "dataset_path": "path", "save_steps": "checkpoint.every",
           "eval_steps": "eval.every", "save_total_limit": "checkpoint.keep_last", "report_to": "log.wandb",
           "lora_r": "r", "lora_rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
           "lora_target": "target_modules", "lora_target_modules": "target_modules",
           "adapter": "lora.r", "finetuning_type": "lora.r", "peft": "lora", "load_in_4bit": "lora.quantize"}
# Keys of features this repository does not have, with what to do instead of a misleading spelling hint.
UNSUPPORTED = {"data.streaming": "streaming datasets are not supported: data is tokenized once into a cache; "
                                 "point data.path at a local copy, or at a subset of its files"}


def _unknown_keys(cls: type, data: Any, prefix: str) -> list[str]:
    """Every unknown key in the tree, each with its hint: a recipe with two typos hears about both."""
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    found = []
    for key, value in data.items():
        if key in names:
            if dataclasses.is_dataclass(hints[key]):
                found += _unknown_keys(hints[key], value, f"{prefix}{key}.")
        elif f"{prefix}{key}" in UNSUPPORTED:
            found.append(f"'{prefix}{key}': {UNSUPPORTED[prefix + key]}")
        elif key in ALIASES:
            target = ALIASES[key] if "." in ALIASES[key] else f"{prefix}{ALIASES[key]}"
            found.append(f"'{prefix}{key}' (here it is '{target}')")
        else:
            found.append(f"'{prefix}{key}'{closest(key, names)}")
    return found


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"'{prefix.rstrip('.')}' should be a mapping of keys, got {data!r}")
    unknown = _unknown_keys(cls, data, prefix) if not prefix else []  # checked once, at the top
    if unknown:
        raise UserError(f"unknown recipe key{'s' if len(unknown) > 1 else ''} {'; '.join(unknown)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(f"{prefix}{key}", value, hint)
    return cls(**kwargs)


def load_recipe(path: str | Path | None, overrides: dict | None = None) -> Recipe:
    """Defaults < YAML file < overrides, validated."""
    raw: dict = {}
    if path is not None:
        recipe_path = resolve_recipe_path(path)
        try:
            raw = yaml.safe_load(recipe_path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"recipe {recipe_path} is not valid YAML{where}: {problem}; fix that line") from None
        if not isinstance(raw, dict):
            raise UserError(f"recipe {recipe_path} should be a mapping with model/data/train sections")
    return _build(Recipe, merge(raw, overrides or {}), "")


def dump_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def local_or_hub(name: str) -> str:
    """A path that exists as given or relative to the repo root (recipes use repo-relative paths), else
    the name unchanged (a Hugging Face Hub id)."""
    for candidate in (Path(name).expanduser(), REPO_ROOT / name):
        if candidate.exists():
            return str(candidate)
    return name
