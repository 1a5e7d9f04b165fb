"""Load a DeepSpeed JSON, validate its keys, fill every "auto" from the recipe, check batch arithmetic.

The recipe owns the batch sizes, optimizer hyper-parameters, LR schedule, clipping and precision; the
shipped JSONs say "auto" for all of them so the two can never disagree. An explicit value in the JSON
that contradicts the recipe is an error, not a silent winner.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import REPO_ROOT, Recipe, find_file, merge
from ..errors import UserError, closest
from .layout import Layout, parallel_sizes

DS_CONFIGS_DIR = REPO_ROOT / "ds_configs"

# Top-level keys DeepSpeed 0.19 reads (runtime/config.py and the section configs it imports).
TOP_LEVEL_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "fp16", "bf16", "bfloat16", "torch_autocast", "amp", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
    "seq_parallel_communication_data_type", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "disable_allgather", "disable_python_gc", "activation_checkpointing", "flops_profiler", "comms_logger",
    "tensorboard", "wandb", "csv_monitor", "comet", "checkpoint", "data_types", "dataloader_drop_last",
    "pipeline", "tensor_parallel", "sparse_attention", "data_efficiency", "curriculum_learning",
    "compression_training", "autotuning", "aio", "elasticity", "hybrid_engine", "compile", "weight_quantization",
    "sparse_gradients", "nebula", "timers", "log_level", "use_data_before_expert_parallelism",
    "managed_gradient_accumulation", "eigenvalue", "progressive_layer_drop", "quantize_training",
    "graph_harvesting", "sequence_parallel_size", "expert_parallel", "zenflow", "datastates_ckpt",
    "check_overflow", "vocabulary_size", "mics_shard_size", "mics_hierarchical_params_gather",
    # this repository's, beside DeepSpeed's sequence_parallel_size: ring attention's degree (DeepSpeed ignores it)
    "context_parallel_size",
}


def _section_models() -> dict[str, Any]:
    """Pydantic models DeepSpeed validates sections with; their field names and aliases are the valid keys."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
        "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "tensor_parallel": TPTrainingConfig,
        "compile": CompileConfig,
        "comms_logger": CommsLoggerConfig,
    }


def _sections(cfg: dict) -> list[tuple[str, Any, dict]]:
    """(dotted name, DeepSpeed's pydantic model, the section) for each validated section the config has."""
    out = []
    for dotted, model in _section_models().items():
        node: Any = cfg
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            out.append((dotted, model, node))
    return out


def _model_keys(model: Any) -> set[str]:
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        if info.alias:
            keys.add(info.alias)
    return keys


def validate_keys(cfg: dict) -> None:
    """Unknown or misspelled keys are errors that name the closest valid key."""
    if MOVED_KEY in cfg:
        raise UserError(moved_compression(cfg[MOVED_KEY]))
    for key in cfg:
        if key not in TOP_LEVEL_KEYS:
            raise UserError(f"unknown DeepSpeed config key '{key}'{closest(key, TOP_LEVEL_KEYS)}")
    for key in cfg.get("pipeline") or {}:
        if key not in PIPELINE_KEYS:
            raise UserError(f"unknown DeepSpeed config key 'pipeline.{key}'{closest(key, PIPELINE_KEYS)}")
    for dotted, model, node in _sections(cfg):
        valid = _model_keys(model)
        for key in node:
            if key not in valid:
                raise UserError(f"unknown DeepSpeed config key '{dotted}.{key}'{closest(key, valid)}")


# The repository's own gradient compression lived in the DeepSpeed JSON until issue 30 made it a recipe section
# (`compression`: our settings beside our others, DeepSpeed's JSON only DeepSpeed's). Old JSONs and the three
# shipped files that carried it are refused with the command line that replaces them.
MOVED_KEY = "gradient_compression"
REMOVED_CONFIGS = {"zero1_powersgd": ("zero1.json", "powersgd"), "zero0_powersgd": ("zero0.json", "powersgd"),
                   "zero1_sign": ("zero1.json", "sign")}


def moved_compression(section: Any) -> str:
    settings = section if isinstance(section, dict) else {}
    flags = " ".join(f"--compression.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items())
    return (f"'{MOVED_KEY}' moved out of the DeepSpeed JSON into the recipe's compression section: remove it from the "
            f"JSON and pass {flags or '--compression.method=powersgd'} (or set compression: in the recipe)")


def resolve_path(name: str | Path) -> Path:
    """A path as given, or a file name looked up in ds_configs/ (with or without .json)."""
    stem = Path(str(name)).name.removesuffix(".json")
    if stem in REMOVED_CONFIGS and not Path(name).is_file() and not (DS_CONFIGS_DIR / f"{stem}.json").is_file():
        config, method = REMOVED_CONFIGS[stem]
        raise UserError(f"ds_configs/{stem}.json is gone: gradient compression is a recipe setting now; use "
                        f"--ds_config {config} --compression.method={method}")
    return find_file(name, DS_CONFIGS_DIR, ".json", "DeepSpeed config")


def load(name: str | Path, overrides: dict | None = None) -> dict:
    """The JSON, with `--ds.zero_optimization.stage=3`-style overrides merged in, keys validated."""
    path = resolve_path(name)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"DeepSpeed config {path} should be a JSON object")
    cfg = merge(cfg, overrides or {})
    validate_keys(cfg)
    return cfg


@dataclass(frozen=True)
class DeviceCaps:
    name: str = "cpu"
    bf16: bool = True
    fp16: bool = False

    @classmethod
    def detect(cls) -> DeviceCaps:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        return cls(name=acc.device_name(), bf16=bool(acc.is_bf16_supported()), fp16=bool(acc.is_fp16_supported()))


def _is_auto(value: Any) -> bool:
    return value == "auto"


def _fill(section: dict, key: str, value: Any, where: str, recipe_key: str) -> None:
    """Set section[key] from the recipe when missing or "auto"; an explicit different value is an error."""
    current = section.get(key, "auto")
    if _is_auto(current):
        section[key] = value
    elif current != value:
        raise UserError(f"DeepSpeed config {where}.{key}={current!r} disagrees with recipe {recipe_key}={value!r}; "
                        f"set it to \"auto\" in the JSON so the recipe decides")


def _precision(cfg: dict, recipe: Recipe, caps: DeviceCaps) -> str:
    wanted = recipe.train.precision
    bf16 = (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled", False)
    fp16 = (cfg.get("fp16") or {}).get("enabled", False)
    if bf16 is True and fp16 is True:  # DeepSpeed refuses it too, but only after the run dir was rewritten
        raise UserError("the DeepSpeed config enables both fp16 and bf16; keep one (bf16 on GPUs that have it) "
                        "or set both to \"auto\" and choose with --train.precision")
    if wanted == "auto":
        wanted = "bf16" if bf16 in (True, "auto") else "fp16" if fp16 in (True, "auto") else "fp32"
        if wanted == "bf16" and caps.name == "cpu":
            # The CPU accelerator emulates bf16: measured ~10x slower than fp32 here (docs/strategies.md, "Precision").
            wanted = "fp32"
    if wanted == "fp16" and not caps.fp16:
        raise UserError(f"fp16 is not supported on this device ({caps.name}); use a bf16 config such as "
                        f"zero2.json or pass --train.precision=bf16")
    if wanted == "bf16" and not caps.bf16:
        raise UserError(f"bf16 is not supported on this device ({caps.name}); use an *_fp16.json config or "
                        f"pass --train.precision=fp16")
    cfg.pop("bfloat16", None)
    cfg.setdefault("bf16", {})["enabled"] = wanted == "bf16"
    cfg.setdefault("fp16", {})["enabled"] = wanted == "fp16"
    return wanted


ZEROPP_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def check_zeropp(cfg: dict, caps: DeviceCaps, ranks_per_node: int | None = None) -> None:
    """ZeRO++ (qwZ, qgZ, hpZ) runs CUDA kernels; on another device it would fail deep inside the engine."""
    zero = cfg.get("zero_optimization") or {}
    used = [k for k in ZEROPP_KEYS[:2] if zero.get(k) is True]
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz == "auto":  # the secondary weight partition lives within a node
        hpz = zero["zero_hpz_partition_size"] = ranks_per_node or 1
    if not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 0:
        raise UserError(f"zero_optimization.zero_hpz_partition_size={hpz!r} should be a whole number of ranks "
                        f"(the GPUs of one node) or \"auto\"")
    if hpz > 1:
        used.append(ZEROPP_KEYS[2])
    if not used:
        return
    if caps.name != "cuda":
        raise UserError(f"ZeRO++ ({', '.join('zero_optimization.' + k for k in used)}) needs CUDA GPUs; this device "
                        f"is {caps.name}: use zero3.json, or zero1_bf16comm.json / --compression.method=powersgd "
                        f"for less traffic on any device")
    if int(zero.get("stage", 0)) != 3:
        raise UserError(f"ZeRO++ ({', '.join(used)}) works with ZeRO stage 3 only; set zero_optimization.stage=3")


def _find_auto(node: Any, path: str = "") -> str | None:
    if _is_auto(node):
        return path or "<root>"
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_auto(value, f"{path}.{key}" if path else key)
            if found:
                return found
    return None


def offloads_optimizer(cfg: dict) -> bool:
    device = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return device in ("cpu", "nvme")


def uses_recipe_schedule(cfg: dict) -> bool:
    """True when the resolved config left the LR schedule to the recipe (dstrain.trainer.schedule)."""
    return "scheduler" not in cfg


def optimizer_of(cfg: dict, train) -> str:
    """`muon` or `adamw`: train.optimizer, or with `auto` the DeepSpeed JSON's type. train.optimizer=muon turns the
    JSON's AdamW into Muon: the shipped JSONs name AdamW only because the Hugging Face Trainer needs a type (their
    hyper-parameters are all "auto", the recipe's); any other named optimizer is a contradiction."""
    named = str((cfg.get("optimizer") or {}).get("type", "auto"))
    if train.optimizer != "auto":
        if train.optimizer == "muon" and named.lower() not in ("auto", "muon", "adamw", "adam"):
            raise UserError(f"train.optimizer=muon but the DeepSpeed config's optimizer type is {named!r}; set it "
                            "to \"auto\" (or \"Muon\") in the JSON")
        if train.optimizer == "adamw" and named.lower() == "muon":
            raise UserError("train.optimizer=adamw but the DeepSpeed config's optimizer type is Muon; drop one of "
                            "the two (train.optimizer=auto follows the JSON)")
        return train.optimizer
    return "muon" if named.lower() == "muon" else "adamw"


def clipping_of(train, choice: str) -> float:
    """train.max_grad_norm, or when unset 1.0 (0 under Muon: see _muon)."""
    if train.max_grad_norm is not None:
        return float(train.max_grad_norm)
    return 0.0 if choice == "muon" else 1.0


def _muon(cfg: dict, train) -> None:
    """DeepSpeed's Muon, filled from the recipe and refused where DeepSpeed 0.19.8 would do something else.

    lr is the shared value DeepSpeed falls back to; muon_lr and adam_lr are what each half uses (both scaled by
    the schedule: dstrain.trainer.schedule's LambdaLR multiplies each parameter group's own lr)."""
    params = cfg["optimizer"]["params"]
    _fill(params, "adam_lr", train.lr, "optimizer.params", "train.lr")
    _fill(params, "muon_lr", train.muon_lr, "optimizer.params", "train.muon_lr")
    _fill(params, "momentum", train.muon_momentum, "optimizer.params", "train.muon_momentum")
    stage = zero_stage(cfg)
    clipping = cfg.get("gradient_clipping", "auto")
    clipping = clipping_of(train, "muon") if _is_auto(clipping) else float(clipping)
    if stage >= 1 and clipping > 0:
        raise UserError(f"gradient clipping ({clipping:g}) with Muon under ZeRO-{stage}: DeepSpeed 0.19.8 clips "
                        "Muon's orthogonalised update, not the gradient, dividing every Muon step by the update's "
                        "norm (hundreds for a 1B model); set --train.max_grad_norm=0 (Muon's step has a fixed size "
                        "already) or use ZeRO-0, which clips the gradient")
    sizes = parallel_sizes(cfg)
    for size, what in ((sizes.pipeline, "pipeline stages"), (sizes.tensor, "tensor parallelism (AutoTP)")):
        if size > 1:
            raise UserError(f"Muon with {what} ({size}) is not supported: each rank would orthogonalise its own "
                            "shard of a matrix, not the matrix; use ZeRO-1/2/3 for Muon, or train.optimizer=adamw")
    if stage == 3:
        zero = cfg.setdefault("zero_optimization", {})
        if zero.get("reduce_scatter", "auto") is True:
            raise UserError("zero_optimization.reduce_scatter=true with Muon under ZeRO-3: DeepSpeed needs each "
                            "whole gradient to orthogonalise it; remove the key (dstrain sets it to false for Muon)")
        zero["reduce_scatter"] = False


def precision(cfg: dict) -> str:
    """bf16, fp16 or fp32: what the resolved config computes in."""
    if (cfg.get("bf16") or {}).get("enabled"):
        return "bf16"
    return "fp16" if (cfg.get("fp16") or {}).get("enabled") else "fp32"


def zero_stage(cfg: dict) -> int:
    return int((cfg.get("zero_optimization") or {}).get("stage", 0))


def zero3_sizes(hidden_size: int) -> dict:
    """ZeRO-3 sizes scaled to the model (its "auto" values). Buckets and persistence follow transformers'
    rule (h^2, 0.9 h^2, 10 h); live parameters, reuse distance and optimizer sub-groups are capped at about
    one decoder layer (a Llama layer holds ~12-13 h^2 parameters). Peak memory at 100M parameters, as a
    multiple of the ZeRO paper's 16/N bytes per parameter: 2.0x with fixed 1e8-element sizes, 1.33x with
    24 h^2 caps, see docs/benchmarks.md for 12 h^2. Larger caps prefetch more: raise them in the JSON
    when GPU memory is plentiful and throughput matters more."""
    h2 = hidden_size * hidden_size
    return {"reduce_bucket_size": h2, "stage3_prefetch_bucket_size": int(0.9 * h2),
            "stage3_param_persistence_threshold": 10 * hidden_size, "stage3_max_live_parameters": 12 * h2,
            "stage3_max_reuse_distance": 12 * h2, "sub_group_size": 12 * h2}


def check_pipeline(cfg: dict) -> None:
    """Reject what DeepSpeed's pipeline engine cannot do, before anything is built."""
    sizes = parallel_sizes(cfg)
    stages = sizes.pipeline
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    if stages > 1 and stage > 1:
        raise UserError(f"pipeline stages ({stages}) work with ZeRO stage 0 or 1, not {stage}; use ds_configs/"
                        f"pipe2_zero1.json or set zero_optimization.stage to 1")
    if stages > 1 and sizes.tensor > 1:
        raise UserError("pipeline stages together with tensor_parallel.autotp_size are not supported; use one")


def check_tensor_parallel(cfg: dict) -> None:
    """AutoTP's vocabulary-parallel head leaves each rank the logits of its share of the vocabulary; DeepSpeed unset
    (null) turns it on for a tied head whose model plans a row-wise embedding (Gemma 3, Cohere), and every loss here
    reads the whole logits: the run ended in `IndexError: Target 518 is out of bounds` at its first step. Set to
    false when unset (the head's output gathered); true is refused."""
    if parallel_sizes(cfg).tensor <= 1:
        return
    tp = cfg["tensor_parallel"]
    if tp.get("vocab_parallel_lm_head") is True:
        raise UserError("tensor_parallel.vocab_parallel_lm_head=true leaves each rank its share of the vocabulary's "
                        "logits, and train.py's losses read whole logits; set it to false")
    tp["vocab_parallel_lm_head"] = False


# the keys DeepSpeed's pipeline section takes (deepspeed.runtime.pipe; it has no pydantic model to ask)
PIPELINE_KEYS = {"stages", "partition_method", "partition", "seed_layers", "activation_checkpoint_interval",
                 "pipe_partitioned", "grad_partitioned"}


def check_sequence_parallel(cfg: dict) -> None:
    """Ulysses sequence parallelism (sequence_parallel_size) and ring attention (context_parallel_size) combine
    with each other and ZeRO-0/1/2/3 and offload only."""
    sizes = parallel_sizes(cfg)
    for key, size in (("sequence_parallel_size", sizes.sequence), ("context_parallel_size", sizes.context)):
        if size == 1:
            continue
        for other, what in ((sizes.pipeline, "pipeline stages"), (sizes.tensor, "tensor parallelism (AutoTP)")):
            if other > 1:
                raise UserError(f"{key}={size} together with {what} is not supported (the sequence-parallel groups "
                                f"assume data x sequence parallelism only); remove one of the two")


def resolve(raw: dict, recipe: Recipe, world_size: int, caps: DeviceCaps, hidden_size: int | None = None,
            ranks_per_node: int | None = None, replicas: int = 1) -> dict:
    """A complete DeepSpeed config with no "auto" left, consistent with the recipe and the world size;
    hidden_size fills the model-scaled ZeRO-3 sizes, ranks_per_node ZeRO++'s hpZ partition. Under DiLoCo
    (`replicas` > 1) DeepSpeed's train_batch_size is one replica's share of the global batch: its engine is one
    replica's."""
    cfg = copy.deepcopy(raw)
    validate_keys(cfg)
    train = recipe.train
    check_sequence_parallel(cfg)
    layout = Layout.from_ds_config(cfg, world_size, replicas=replicas)
    check_pipeline(cfg)
    check_tensor_parallel(cfg)
    check_zeropp(cfg, caps, ranks_per_node)
    _precision(cfg, recipe, caps)

    _fill(cfg, "train_micro_batch_size_per_gpu", train.micro_batch_size, "", "train.micro_batch_size")
    _fill(cfg, "gradient_accumulation_steps", train.grad_accum_steps, "", "train.grad_accum_steps")
    engine_batch = layout.replica_batch(train.micro_batch_size, train.grad_accum_steps)
    current = cfg.get("train_batch_size", "auto")
    if _is_auto(current):
        cfg["train_batch_size"] = engine_batch
    elif current != engine_batch:
        raise UserError(
            f"train_batch_size={current} but micro_batch_size {train.micro_batch_size} x grad_accum_steps "
            f"{train.grad_accum_steps} x data-parallel world {layout.replica_data_parallel} = {engine_batch}; set "
            f"train_batch_size to \"auto\" or choose train.grad_accum_steps so the product is {current}")

    choice = optimizer_of(cfg, train)
    optimizer = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if _is_auto(optimizer.get("type", "auto")) or choice == "muon":
        optimizer["type"] = "Muon" if choice == "muon" else "AdamW"
    if _is_auto(optimizer.get("params", "auto")):
        optimizer["params"] = {}
    params = optimizer["params"]
    for key, value, recipe_key in (("lr", train.lr, "train.lr"), ("betas", list(train.betas), "train.betas"),
                                   ("eps", train.eps, "train.eps"),
                                   ("weight_decay", train.weight_decay, "train.weight_decay")):
        _fill(params, key, value, "optimizer.params", recipe_key)
    if choice == "muon":
        _muon(cfg, train)
    if caps.name == "cpu" and not offloads_optimizer(cfg) and optimizer["type"].lower() in ("adam", "adamw", "muon"):
        # FusedAdam on the CPU accelerator is a JIT-compiled C++ op; torch's AdamW is the same update (Muon's
        # AdamW half included).
        params.setdefault("torch_adam", True)

    if _is_auto((cfg.get("scheduler") or {"type": "auto"}).get("type", "auto")):
        cfg.pop("scheduler", None)  # dstrain.trainer.schedule builds it from the recipe (see there for why)

    zero = cfg.get("zero_optimization") or {}
    if hidden_size:
        for key, value in zero3_sizes(hidden_size).items():
            if _is_auto(zero.get(key)):
                zero[key] = value
    if train.max_grad_norm is not None or _is_auto(cfg.get("gradient_clipping", "auto")):  # unset: the JSON's
        _fill(cfg, "gradient_clipping", clipping_of(train, choice), "", "train.max_grad_norm")
    cfg.setdefault("steps_per_print", 10 ** 9)  # dstrain's own progress bar reports steps
    cfg.setdefault("wall_clock_breakdown", False)

    leftover = _find_auto(cfg)
    if leftover:
        raise UserError(f"DeepSpeed config key '{leftover}' is \"auto\" but no recipe value fills it; "
                        f"give it a value in the JSON")
    validate_values(cfg)
    return cfg


def validate_values(cfg: dict) -> None:
    """DeepSpeed's own pydantic models check each section's values here, in the validation pass, instead of
    inside deepspeed.initialize after the run directory was written (a pydantic traceback and exit 1, which
    launch/ scripts retry). One line names the key, the value and what DeepSpeed expects."""
    import pydantic

    for dotted, model, node in _sections(cfg):
        try:
            model(**node)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            where = ".".join([dotted, *(str(part) for part in first.get("loc", ()))])
            value = first.get("input")
            shown = f"={value!r}" if not isinstance(value, dict) else ""
            raise UserError(f"DeepSpeed config {where}{shown} is not valid: {first.get('msg', error)}; "
                            f"fix it in the JSON or the --ds.{where}=... override") from None


def write(cfg: dict, path: Path) -> None:
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
