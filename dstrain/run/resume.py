"""Choosing where to resume, adapting to another world size, and DeepSpeed's universal conversion.

A checkpoint from another data-parallel size is converted once by DeepSpeed's universal-checkpoint tool into
checkpoints/step_N.universal/ (beside the checkpoint, never inside it) and loaded from there; the global batch
is kept (grad_accum_steps is re-derived) and the data position is the sample count in the manifest, so no
sample is skipped or seen twice.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import psutil

from ..config import TrainConfig
from ..errors import AlreadyFinished, UserError
from ..parallel.dist import DistContext, barrier
from ..parallel.layout import Layout, batch_hint
from ..paths import local_or_hub
from .checkpoint import COMPLETE, Resume, complete_checkpoints, universal_conversion, verify, write_atomic


def resolve_resume(mode: str, root: Path) -> Path | None:
    """The checkpoint to resume from for --resume {auto,never,PATH}, decided before anything is built."""
    existing = complete_checkpoints(root)
    if mode == "auto":
        return existing[-1] if existing else None
    if mode == "never":
        if existing:
            raise UserError(f"{root} already holds checkpoints and --resume never would overwrite them; use "
                            f"--resume auto to continue, or choose a new --output_dir")
        return None
    path = Path(mode)
    if path.is_dir() and not (path / COMPLETE).exists() and complete_checkpoints(path):
        path = complete_checkpoints(path)[-1]  # a checkpoints/ directory: take its newest
    if not (path / COMPLETE).is_file():
        raise UserError(f"--resume {mode}: not a complete checkpoint (no {COMPLETE}); pass a "
                        f"checkpoints/step_* directory, or --resume auto")
    return path


# What makes a run directory one run: a checkpoint trained on other weights, data or sequence layout cannot be
# continued by this recipe (its optimizer state, data position and loss curve belong to the other run)
_FORMAT_FIELDS = {"text": ("text_field",), "prompt_response": ("prompt_field", "response_field"),
                  "alpaca": ("instruction_field", "input_field", "output_field"), "chat": ("messages_field",),
                  "preference": ("prompt_field", "chosen_field", "rejected_field")}


def run_identity(recipe: dict, optimizer: str | None = None) -> dict:
    """The recipe keys a run directory is bound to, from Recipe.to_dict() or a saved recipe.yaml; `optimizer`, the
    one the run trains with (ds_config.optimizer_of: AdamW's and Muon's states do not load into each other)."""
    model, data = recipe.get("model") or {}, recipe.get("data") or {}

    def where(name):
        return None if name is None else os.path.realpath(local_or_hub(name)) if Path(
            local_or_hub(name)).exists() else name

    fmt = data.get("format", "text")
    out = {"model.name_or_path": where(model.get("name_or_path")),
           "model.tokenizer": where(model.get("tokenizer") or model.get("name_or_path")),
           "model.config_overrides": model.get("config_overrides") or {},
           "data.format": fmt, "data.path": where(data.get("path")), "data.name": data.get("name"),
           "train.seq_len": (recipe.get("train") or {}).get("seq_len")}
    for key in _FORMAT_FIELDS.get(fmt, ()):
        out[f"data.{key}"] = data.get(key)
    if "chat_template" in data:
        out["data.chat_template"] = data.get("chat_template")
    lora = recipe.get("lora") or {}
    out["lora.r"] = lora.get("r") or 0  # a LoRA checkpoint holds adapters only: another r or targets is another run
    if out["lora.r"]:
        out.update({"lora.target_modules": lora.get("target_modules"), "lora.quantize": lora.get("quantize")})
    if optimizer:
        out["train.optimizer"] = optimizer
    return out


def check_same_run(resume: Resume, identity: dict, run_dir: Path) -> None:
    """Refuse, before anything is written, to continue a checkpoint of another run (other model, data,
    format or seq_len): its optimizer state, data position and loss curve belong to that run."""
    saved = resume.manifest.get("run")
    if saved is None and (run_dir / "recipe.yaml").is_file():  # checkpoints from before the manifest kept it
        import yaml
        saved = run_identity(yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {})
    if not saved:
        return
    differ = [key for key in identity if key in saved and saved[key] != identity[key]]
    if differ:
        key = differ[0]
        changes = f"{key} {_short(saved[key])} -> {_short(identity[key])}" + (
            f" and {len(differ) - 1} more" if len(differ) > 1 else "")
        if run_dir.resolve() not in resume.path.resolve().parents:  # --resume named another run's checkpoint
            origin = resume.path.resolve().parent.parent
            model = f" --model.name_or_path={saved['model.name_or_path']}" if "model.name_or_path" in differ else ""
            raise UserError(f"--resume {resume.path} is a checkpoint of another run ({changes}); continue that run "
                            f"with --output_dir {origin} and its recipe ({origin / 'recipe.yaml'}), or start this one "
                            f"from its weights with --init_from {resume.path}{model}")
        raise UserError(f"{run_dir} holds another run ({changes}); use a new --output_dir, adding "
                        f"--init_from {run_dir} to start from its weights")


def _short(value) -> str:
    text = str(value)
    return ".../" + "/".join(Path(text).parts[-2:]) if text.startswith("/") and len(Path(text).parts) > 3 else text


def resolve_init_from(path: str | None) -> Path | None:
    """--init_from: the newest complete checkpoint of a run directory, a checkpoints/ folder, or a step_N."""
    if path is None:
        return None
    given = Path(path)
    found = [given] if (given / COMPLETE).is_file() else (complete_checkpoints(given / "checkpoints")
                                                           or complete_checkpoints(given))
    if not found:
        raise UserError(f"--init_from {path}: no complete checkpoint there; pass a run directory or a "
                        f"checkpoints/step_* directory")
    ckpt = found[-1]
    if not (ckpt.parent.parent / "model_config" / "config.json").is_file():
        raise UserError(f"--init_from {path}: {ckpt.parent.parent / 'model_config'} is missing; pass a checkpoint "
                        f"inside a run directory written by train.py")
    return ckpt


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "n_embd", "n_layer", "n_head",
               "n_inner", "tie_word_embeddings")


def check_init_from(ckpt: Path, config) -> None:
    """The checkpoint's model must have the recipe model's shapes (its weights are loaded into it)."""
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(ckpt.parent.parent / "model_config").to_dict()
    ours = config.to_dict()
    differ = [k for k in _SHAPE_KEYS if theirs.get(k) != ours.get(k)]
    if differ:
        changes = ", ".join(f"{k} {theirs.get(k)} -> {ours.get(k)}" for k in differ[:3])
        raise UserError(f"--init_from {ckpt}: its model differs from model.name_or_path's ({changes}); point "
                        f"model.name_or_path at the same architecture")


def materialize_init_from(ckpt: Path, run_dir: Path, ctx: DistContext, log=print) -> Path:
    """The checkpoint's full weights as a Hugging Face directory in run_dir/init_weights (written once, by
    rank 0; the others wait): transformers then loads it as any model, under every strategy and world size,
    so a new run starts from exactly what that checkpoint holds."""
    from .export import export_hf

    out = run_dir / "init_weights"
    if ctx.is_main and not (out / "config.json").is_file():
        log(f"writing the weights of {ckpt} to {out} to start from them")
        import torch
        export_hf(ckpt, out, torch.float32)  # renamed into place whole: config.json means complete
    while not (out / "config.json").is_file():  # no barrier: a big export may outlast the collective timeout
        time.sleep(0.5)
    return out


def started_from(run_dir: Path) -> Path | None:
    """run_dir/init_weights when the run began with --init_from (materialize_init_from wrote it), else None."""
    out = run_dir / "init_weights"
    return out if (out / "config.json").is_file() else None


def choose(mode: str, root: Path, ctx: DistContext, check: bool) -> Resume | None:
    """The newest verified checkpoint to resume from, touching nothing: damaged newer ones are listed in
    Resume.damaged (set_aside moves them once every input has been checked); an explicit path that is
    damaged is refused."""
    first = resolve_resume(mode, root)
    if first is None:
        return None
    candidates = list(reversed(complete_checkpoints(root))) if mode == "auto" else [first]
    damaged: list[tuple[Path, str]] = []
    for path in candidates:
        problems = verify(path, ctx) if check else []
        if not problems:
            return Resume(path, json.loads((path / COMPLETE).read_text()), damaged=damaged)
        detail = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        if mode != "auto":
            raise UserError(f"checkpoint {path} is damaged: {detail}; resume from another one, or pass "
                            f"--checkpoint.verify=false to load it anyway")
        damaged.append((path, detail))
    raise UserError(f"every checkpoint in {root} is damaged ({damaged[0][0].name}: {damaged[0][1]}); start a new "
                    f"--output_dir")


def check_not_finished(run_dir: Path, start: Resume | None, recipe) -> None:
    """A run that finished (summary.json says so, its last checkpoint at train.max_steps, its export written where
    the recipe exports) started again stays as it finished: before, a relaunch rewrote its recipe.yaml,
    ds_config.json, summary.json (tokens/s and MFU null) and model_config/, and under another world size converted
    its checkpoint (issue 85). A run whose export is missing goes on, and exports."""
    summary = run_dir / "summary.json"
    if start is None or start.manifest.get("step", 0) < recipe.train.max_steps or not summary.is_file():
        return
    try:
        status = json.loads(summary.read_text()).get("status")
    except ValueError:
        return
    if status == "finished" and (not recipe.checkpoint.export_hf or (run_dir / "hf").is_dir()):
        raise AlreadyFinished(f"{run_dir} holds this run finished at step {start.manifest['step']} (train.max_steps="
                              f"{recipe.train.max_steps}); nothing to do: raise train.max_steps to train on, or give "
                              f"another --output_dir")


def set_aside(resume: Resume | None, ctx: DistContext, log=print) -> None:
    """Rename the damaged checkpoints newer than the chosen one to step_N.corrupt, so later runs skip them."""
    for path, detail in resume.damaged if resume else []:
        if ctx.is_main:
            aside = path.with_name(path.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            log(f"warning: checkpoint {path} is damaged ({detail}); moved it to {aside.name} and resumed from "
                f"{resume.path.name}")
    if resume and resume.damaged:
        barrier()


def adapt_to_world(resume: Resume, train: TrainConfig, layout: Layout, log=print) -> tuple[TrainConfig, Resume]:
    """The checkpoint's global batch kept on a different data-parallel size: a new TrainConfig with
    grad_accum_steps re-derived, and the Resume marked universal when its optimizer shards need converting."""
    manifest = resume.manifest
    global_batch = manifest.get("global_batch")
    saved_dp = manifest.get("data_parallel", manifest.get("world_size"))
    data_parallel = layout.data_parallel
    saved_sp = manifest.get("sequence_parallel", 1)
    if saved_sp != layout.sequence_parallel:
        raise UserError(f"checkpoint {resume.path} was trained with sequence_parallel_size={saved_sp} and this run has "
                        f"{layout.sequence_parallel}; resume with the same sequence_parallel_size")
    saved_ep = manifest.get("expert_parallel")  # None: saved before it was recorded
    if saved_ep is not None and bool(saved_ep) != bool(layout.expert_parallel):
        # AutoEP's checkpoint holds each block's experts as w1/w2/w3 under its own module names, a dense one the
        # model's gate_up_proj/down_proj: neither loads into the other (IndexError in the load, seen)
        raise UserError(f"checkpoint {resume.path} was trained " + (
            f"with expert parallelism (autoep_size={saved_ep}) and this run has none; resume with an "
            f"expert_parallel section (autoep_size=1 on one rank), or export it (python -m dstrain.export) and "
            f"train on from hf/" if saved_ep else
            f"without expert parallelism and this run has autoep_size={layout.expert_parallel}; resume without the "
            f"expert_parallel section, or export it and train on from hf/ with it"))
    # another EP size regroups the experts even on the same ranks: DeepSpeed loads a rank's own expert files by its
    # new EP rank without a word (an EP 2 checkpoint resumed on the same 2 ranks with autoep_size=1 trained on,
    # 4.0e-4 off the uninterrupted run), so the checkpoint goes through the universal conversion as for a new world
    ep_changed = bool(saved_ep) and saved_ep != layout.expert_parallel
    regrouped = bool(saved_ep) and (ep_changed or saved_dp != data_parallel)  # the experts need the conversion
    lora_r = (manifest.get("run") or {}).get("lora.r")
    if regrouped and lora_r:
        # DeepSpeed's conversion wants every AutoEP expert among the optimizer's parameters ("AutoEP expert
        # parameter ... is missing from checkpoint parameter shapes", seen): LoRA's experts are frozen base
        raise UserError(f"checkpoint {resume.path} trained LoRA (r={lora_r}) beside expert parallelism "
                        f"on {saved_dp} data-parallel ranks with autoep_size={saved_ep}; it resumes only on that "
                        f"layout (DeepSpeed's universal conversion cannot regroup frozen experts): launch "
                        f"{manifest.get('world_size')} ranks with autoep_size={saved_ep}, or export it and train on")
    if regrouped and manifest.get("zero_stage") == 0:
        # ZeRO-0 under AutoEP keeps each EP rank's optimizer whole (expp_rank_N_mp_rank_00_optim_states.pt), which
        # DeepSpeed's universal conversion does not read (KeyError 'optimizer_state_dict', seen)
        raise UserError(f"checkpoint {resume.path} (ZeRO-0 with expert parallelism, autoep_size={saved_ep} on "
                        f"{saved_dp} ranks) resumes only on that layout: launch {manifest.get('world_size')} ranks "
                        f"with autoep_size={saved_ep}, or train with ZeRO-1/2/3, whose checkpoints resume on another "
                        f"world and EP size")
    saved_replicas = manifest.get("replicas", 1)
    if saved_replicas > 1 or layout.replicas > 1:
        return _adapt_replicas(resume, train, layout, saved_replicas, log)
    # DeepSpeed counts a ring's ranks as data-parallel ones: its shards follow data x context parallelism
    saved_cp = manifest.get("context_parallel", 1)
    saved_engine, engine = saved_dp * saved_cp, data_parallel * layout.context_parallel
    if saved_dp == data_parallel and saved_engine == engine and not ep_changed:
        _same_global_batch(resume, train, layout)
        return train, resume
    if layout.splits_model:
        raise UserError(f"checkpoint {resume.path} was saved with {saved_dp} data-parallel replicas and this run "
                        f"has {data_parallel}; pipeline and tensor-parallel checkpoints resume only on the same "
                        f"layout, so launch {manifest.get('world_size')} ranks")
    if saved_engine != engine and layout.sequence_parallel > 1 and \
            not list(resume.path.glob("zero_pp_rank_*_model_states.pt")):
        # ZeRO-0/1/2 under Ulysses save model states per sequence-parallel rank, which DeepSpeed's universal
        # conversion (ds_to_universal) reads as tensor-parallel shards and refuses; ZeRO-3's per-rank files convert
        raise UserError(f"checkpoint {resume.path} (ZeRO-0/1/2 with sequence_parallel_size={saved_sp}) resumes only on "
                        f"the same world size: launch {manifest.get('world_size')} ranks, or train with a ZeRO-3 "
                        f"config (sp2_zero3.json), whose checkpoints resume on any multiple of the sp size")
    accum = _accumulation(resume, train, layout)
    ring = (f" and ring attention from {saved_cp} to {layout.context_parallel} ranks"
            if saved_cp != layout.context_parallel else "")
    ring += f" and expert parallelism from autoep_size={saved_ep} to {layout.expert_parallel}" if ep_changed else ""
    log(f"world changed from {saved_dp} to {data_parallel} data-parallel ranks{ring}: " + (
        f"grad_accum_steps {train.grad_accum_steps} -> {accum} keeps the global batch at {global_batch}"
        if accum != train.grad_accum_steps else f"the global batch stays {global_batch}"))
    # DeepSpeed's shards convert when its own data-parallel size changes (stage 0 fp32 needs no conversion)
    universal = (saved_engine != engine or ep_changed) and bool(list(resume.path.glob("*optim_states.pt")))
    return replace(train, grad_accum_steps=accum), replace(resume, universal=universal)


# How DeepSpeed lays an optimizer's state out in a checkpoint, by the optimizer it builds (engine.py's
# _do_optimizer_sanity_check): ZeRO-3 partitions weights and state (zero_pp_rank_*_model_states.pt beside the
# optimizer files); ZeRO-1/2 partition the state (zero_pp_rank_*_optim_states.pt); ZeRO-1 in bf16 with fp32 gradient
# accumulation is the BF16 optimizer (bf16_zero_pp_rank_*); ZeRO-0 keeps PyTorch's optimizer (or its fp16/bf16
# wrapper) whole inside mp_rank_00_model_states.pt. A checkpoint loads directly only into the layout it was saved in.
_LAYOUT_NAMES = {"zero3": "ZeRO-3", "zero12": "ZeRO-1/2", "bf16_zero1": "ZeRO-1 with the BF16 optimizer",
                 "plain": "ZeRO-0"}


def optimizer_layout(ds_cfg: dict) -> str:
    """The checkpoint layout the engine built from this resolved DeepSpeed config will save and load."""
    from ..parallel.ds_config import precision, zero_stage

    stage, zero = zero_stage(ds_cfg), ds_cfg.get("zero_optimization") or {}
    if stage >= 3:
        return "zero3"
    if stage >= 1:
        accum = str((ds_cfg.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
        offload = (zero.get("offload_optimizer") or {}).get("device") not in (None, "none")
        bf16_optimizer = stage == 1 and precision(ds_cfg) == "bf16" and accum in ("fp32", "float32", "float") \
            and not offload
        return "bf16_zero1" if bf16_optimizer else "zero12"
    return "plain"


def saved_layout(path: Path) -> str:
    """The layout a checkpoint directory was saved in, read from its file names (DiLoCo's are in a folder per
    replica)."""
    if list(path.rglob("zero_pp_rank_*_model_states.pt")):
        return "zero3"
    if list(path.rglob("bf16_zero_pp_rank_*optim_states.pt")):
        return "bf16_zero1"
    return "zero12" if list(path.rglob("*zero_pp_rank_*optim_states.pt")) else "plain"


_STAGE_OF_LAYOUT = {"zero3": 3, "zero12": None, "bf16_zero1": 1, "plain": 0}  # None: 1 or 2, one layout


def adapt_to_stage(resume: Resume, ds_cfg: dict, optimizer: str | None, layout: Layout, log=print) -> Resume:
    """A checkpoint saved under another ZeRO stage (after an out-of-memory, say): its optimizer state converts
    through DeepSpeed's universal checkpoint into any ZeRO-1/2/3 layout, and into ZeRO-0 in fp32 (PyTorch's own
    AdamW, loaded by ds_internals). What no converter carries is refused here, before anything is built. A resume
    on the stage it was saved with is left as it was."""
    from ..parallel.ds_config import precision, zero_stage

    saved, ours = saved_layout(resume.path), optimizer_layout(ds_cfg)
    was, stage = resume.manifest.get("zero_stage", _STAGE_OF_LAYOUT[saved]), zero_stage(ds_cfg)
    if saved == ours or was == stage or (was is None and stage in (1, 2)):
        return resume
    before = f"ZeRO-{was}" if was is not None else _LAYOUT_NAMES[saved]
    now = f"ZeRO-{stage}"
    weights = f"start a new --output_dir from its weights alone with --init_from {resume.path}"
    if layout.splits_model or layout.replicas > 1 or resume.manifest.get("replicas", 1) > 1:
        raise UserError(f"checkpoint {resume.path} was saved under {before} and this run is {now}; pipeline, "
                        f"tensor-parallel and DiLoCo checkpoints resume on the stage they were saved with: use its "
                        f"DeepSpeed config, or {weights}")
    if saved == "plain":
        raise UserError(f"checkpoint {resume.path} was saved under ZeRO-0, whose optimizer state DeepSpeed's universal "
                        f"checkpoint cannot read, and this run is {now}; continue it under ZeRO-0 (the DeepSpeed "
                        f"config it was trained with), or {weights}")
    if ours == "plain" and precision(ds_cfg) != "fp32":
        raise UserError(f"checkpoint {resume.path} was saved under {before}, and ZeRO-0 in {precision(ds_cfg)} keeps "
                        f"its optimizer in DeepSpeed's fp16/bf16 wrapper, which cannot load a universal checkpoint; "
                        f"continue under ZeRO-0 with --train.precision=fp32, under ZeRO-1/2/3, or {weights}")
    if ours == "plain" and optimizer == "muon":
        raise UserError(f"checkpoint {resume.path} was saved under {before}; Muon's state converts between ZeRO-1/2/3 "
                        f"only: continue under zero1.json, zero2.json or zero3.json, or {weights}")
    log(f"ZeRO stage changed from {before} to {now}: the optimizer state is converted through DeepSpeed's universal "
        f"checkpoint and continues exactly")
    return replace(resume, universal=True, into_plain=ours == "plain")


def _same_global_batch(resume: Resume, train: TrainConfig, layout: Layout) -> None:
    """On the checkpoint's data-parallel size the recipe must make up its global batch as it is."""
    global_batch, ours = resume.manifest.get("global_batch"), layout.global_batch(train.micro_batch_size,
                                                                                    train.grad_accum_steps)
    if global_batch != ours:
        raise UserError(f"checkpoint {resume.path} was trained with a global batch of {global_batch} samples, this "
                        f"run has {ours}; keep micro_batch_size x grad_accum_steps x data-parallel size unchanged "
                        f"to resume exactly, or start a new --output_dir")


def _accumulation(resume: Resume, train: TrainConfig, layout: Layout) -> int:
    """grad_accum_steps that keeps the checkpoint's global batch on this layout, or one line saying why none can."""
    global_batch = resume.manifest.get("global_batch")
    accum = layout.accumulation_for(global_batch, train.micro_batch_size)
    if accum is None:
        raise UserError(f"checkpoint {resume.path} has a global batch of {global_batch} samples, which "
                        f"{layout.data_parallel} ranks x micro_batch_size {train.micro_batch_size} cannot make up; "
                        f"{batch_hint(global_batch, layout.data_parallel)}")
    return accum


def _adapt_replicas(resume: Resume, train: TrainConfig, layout: Layout, saved_replicas: int,
                    log=print) -> tuple[TrainConfig, Resume]:
    """A DiLoCo checkpoint (components/diloco.py) on more or fewer replicas of the same size: whole replicas join or
    leave, as nodes do. Each replica's engine state is DeepSpeed's own checkpoint of a replica of that size, so
    replica k loads replica k mod (saved replicas): a new replica starts from replica 0's inner state (AdamW's
    moments, its weights), a removed one's is dropped. The shared weights and the outer momentum are the same on
    every rank and are kept; the rounding carried over (bf16/int8) starts again from zero. The global batch is
    kept, so each replica's share, and its grad_accum_steps, change."""
    manifest = resume.manifest
    world, global_batch = manifest.get("world_size"), manifest.get("global_batch")
    if (saved_replicas > 1) != (layout.replicas > 1):
        raise UserError(f"checkpoint {resume.path} was trained " + (
            f"with DiLoCo ({saved_replicas} replicas); resume it with the diloco section it was trained with"
            if saved_replicas > 1 else "without DiLoCo; resume it with diloco.every=0") +
            f", or start a new --output_dir with --init_from {resume.path}")
    saved_size = world // saved_replicas
    if saved_size != layout.replica_size:
        raise UserError(f"checkpoint {resume.path} holds DiLoCo replicas of {saved_size} rank(s) and this run makes "
                        f"replicas of {layout.replica_size}; add or remove whole replicas (world size a multiple of "
                        f"{saved_size}, diloco.replicas = world / {saved_size})")
    accum = _accumulation(resume, train, layout)
    if saved_replicas == layout.replicas:
        _same_global_batch(resume, train, layout)
        return train, resume
    joined = ", ".join(f"{k} (a copy of replica {k % saved_replicas})"
                       for k in range(saved_replicas, layout.replicas))
    left = ", ".join(str(k) for k in range(layout.replicas, saved_replicas))
    log(f"DiLoCo replicas changed from {saved_replicas} to {layout.replicas}: " + (
        f"replica {joined} joined" if joined else f"replica {left} left, its inner state dropped") +
        f"; shared weights and outer momentum kept, the carried rounding reset; grad_accum_steps "
        f"{train.grad_accum_steps} -> {accum} keeps the global batch at {global_batch}")
    return replace(train, grad_accum_steps=accum), resume


def to_universal(resume: Resume, ctx: DistContext, log=print) -> None:
    """Convert a partitioned checkpoint once (on rank 0) into checkpoints/step_N.universal/; the others wait.
    Called only after every input was checked, so a run that fails on bad input converts nothing."""
    out = resume.universal_dir
    failed = out.with_name(out.name + ".failed")
    started = psutil.Process().create_time()
    if ctx.is_main and not out.is_dir():
        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        failed.unlink(missing_ok=True)
        log(f"converting {resume.path} to a universal checkpoint for the new layout")
        began = time.time()
        from ..parallel import ds_internals

        shadow = out.with_name(f".muon-{out.name}")  # Muon's state rewritten for the converter (ds_internals)
        shutil.rmtree(shadow, ignore_errors=True)
        muon = ds_internals.muon_universal_input(resume.path, shadow)
        proc = universal_conversion(shadow if muon else resume.path, tmp)
        if muon and proc.returncode == 0:
            ds_internals.muon_universal_output(shadow, tmp, muon)
        shutil.rmtree(shadow, ignore_errors=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            write_atomic(failed, f"DeepSpeed's universal-checkpoint conversion of {resume.path} failed: "
                                  f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}; resume on "
                                  f"{resume.manifest.get('world_size')} ranks instead")
        else:
            # the tool also names its output in a `latest_universal` file beside it; the tag is passed
            # explicitly on load, so that file (naming the temporary folder) only misleads
            (tmp.parent / "latest_universal").unlink(missing_ok=True)
            ds_internals.universal_for_any_stage(tmp)
            os.rename(tmp, out)
            log(f"converted in {time.time() - began:.1f} s")
    if ctx.is_main and out.is_dir():
        from ..parallel import ds_internals
        ds_internals.universal_for_any_stage(out)  # a folder converted before this was done (idempotent)
    while not out.is_dir():  # no barrier: a big conversion may outlast the collective timeout
        if failed.is_file() and failed.stat().st_mtime >= started:  # not one from an earlier run
            raise UserError(failed.read_text())  # every rank reports the same failure and leaves
        time.sleep(0.5)
    barrier()  # the folder is complete for every layout before anyone loads

