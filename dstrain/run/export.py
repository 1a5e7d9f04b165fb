"""`python -m dstrain.export RUN_DIR|CHECKPOINT [--out DIR]`: a Hugging Face model from any checkpoint
(and, for a LoRA run, its adapter in PEFT's format beside it)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..components.lora import LORA_DIR
from ..errors import EXIT_USER_ERROR, UserError
from .checkpoint import (
    COMPLETE,
    CONSOLIDATED,
    PIPELINE_NAMES,
    TAG_RE,
    complete_checkpoints,
    replica_tag,
    universal_conversion,
)


def export_dtype(ds_cfg: dict) -> torch.dtype:
    """Export in the precision the engine computed in, so the exported logits are the engine's."""
    from ..parallel.ds_config import precision
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision(ds_cfg), torch.float32)


def _pipeline_state_dict(ckpt: Path, names: dict[str, str]) -> dict[str, torch.Tensor]:
    from ..components.pipeline import strip_wrapper

    state = {}
    for index, prefix in names.items():
        files = sorted(ckpt.glob(f"layer_{int(index):02d}-*model_states.pt"))
        if not files:
            raise UserError(f"{ckpt} lacks pipeline layer {index}; the checkpoint is incomplete")
        layer = torch.load(files[0], map_location="cpu", weights_only=False)
        for key, value in layer.items():
            state[prefix + strip_wrapper(key)] = value
    return state


def at_end(ckpt: Path, out_dir: Path, ds_cfg: dict, ctx, say) -> None:
    """The end of a finished run: rank 0 exports the final checkpoint in the training precision."""
    if ctx.is_main:
        adapter = out_dir.with_name("adapter")
        export_hf(ckpt, out_dir, export_dtype(ds_cfg), adapter)
        say(f"exported {out_dir}" + (f" (merged) and the adapter {adapter}" if adapter.is_dir() else ""))


def _expert_parallel_state_dict(ckpt: Path, states: dict, shapes: dict[str, torch.Size],
                                shared: dict[str, str]) -> dict[str, torch.Tensor]:
    """An AutoEP checkpoint (any ZeRO stage) in transformers' own names and layout. DeepSpeed's zero_to_fp32 cannot
    read one (ZeRO-1/2: it takes the per-expert files for model states; ZeRO-3: NotImplementedError, the experts
    are partitioned over expert replica groups) and save_16bit_model writes only rank 0's experts under AutoEP's
    names, so this is written here, from AutoEP's routed experts as `{block}.experts.w1|w2|w3` [E, F, H] /
    [E, H, F] / [E, F, H] (gate, down, up; _autoep_weights). transformers 5 fuses them as gate_up_proj [E, 2F, H]
    (gate first) and down_proj [E, H, F], or transposed ([E, H, 2F], [E, F, H]) in a few families: `shapes`, the
    target model's, says which (and shapes ZeRO-3's flat tensors). AutoEP's router `{block}.router.gate.weight`
    is the model's `{block}.gate.weight` (`{block}.gate.gate.weight` is the same tensor's other name); `shared`
    maps AutoEP's names of the shared experts to the model's (ds_internals.autoep_shared_names)."""
    blocks = [info["module_path"] for info in states["ds_autoep_layers"]]
    state, experts = {}, {}
    for key, value in _autoep_weights(ckpt, states).items():
        block = next((b for b in blocks if key.startswith(b + ".")), None)
        if block is not None and key.startswith(f"{block}.gate.gate."):
            continue
        if block is not None and key.startswith(f"{block}.experts."):
            experts.setdefault(block, {})[key.rsplit(".", 1)[1]] = value.float()
            continue
        if block is not None and key.startswith(f"{block}.router."):
            # router.gate.weight is gate.weight, DeepSeek's router.e_score_correction_bias its gate.e_score_...
            key = f"{block}.gate." + key[len(f"{block}.router."):].removeprefix("gate.")
        for ours, theirs in shared.items():  # Qwen2-MoE's shared_expert and shared_expert_gate
            if block is not None and key.startswith(f"{block}.{ours}."):
                key = f"{block}.{theirs}." + key[len(f"{block}.{ours}."):]
        target = shapes.get(key)
        state[key] = value.float().reshape(target) if target is not None else value.float()
    for block in blocks:
        parts = experts.get(block, {})
        if set(parts) != {"w1", "w2", "w3"}:
            raise UserError(f"{ckpt} lacks the routed experts of {block} ({sorted(parts)} found); the checkpoint "
                            f"is incomplete")
        fused, down = torch.cat([parts["w1"], parts["w3"]], dim=1), parts["w2"]  # [E, 2F, H], [E, H, F]
        target = shapes.get(f"{block}.experts.gate_up_proj")
        if target is not None and tuple(target) != tuple(fused.shape):  # the transposed layout
            fused, down = fused.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        state[f"{block}.experts.gate_up_proj"], state[f"{block}.experts.down_proj"] = fused, down
    return state


def _autoep_weights(ckpt: Path, states: dict) -> dict[str, torch.Tensor]:
    """Every weight of an AutoEP checkpoint under AutoEP's names, each block's routed experts stacked. ZeRO-0/1/2
    keep the whole module on every rank (in the training precision: what the export is cast to anyway) and write
    each routed expert of every layer to its own file, `{block}.experts.w1|w2|w3.{expert}`. ZeRO-3's module states
    hold only partitions: DeepSpeed's universal conversion gathers them, the experts over the EP group, into fp32
    masters (zero/<name>/fp32.pt); the buffers (DeepSeek's router bias) are whole in the module states."""
    layers = states["ds_autoep_layers"]
    if not list(ckpt.glob("layer_*_expert_*_model_states.pt")):
        return _universal_weights(ckpt, states)
    weights = dict(states["module"])
    for info in layers:
        block, parts = info["module_path"], {w: [] for w in ("w1", "w2", "w3")}
        for expert in range(info["num_experts"]):
            name = ckpt / f"layer_{info['moe_layer_id']}_expert_{expert}_mp_rank_00_model_states.pt"
            if not name.exists():
                raise UserError(f"{ckpt} lacks {name.name}; the checkpoint is incomplete")
            saved = torch.load(name, map_location="cpu", weights_only=False)
            for w in parts:
                parts[w].append(saved[f"{block}.experts.{w}.{expert}"])
        weights = {k: v for k, v in weights.items() if not k.startswith(f"{block}.experts.")}
        weights.update({f"{block}.experts.{w}": torch.stack(parts[w]) for w in parts})
    return weights


def _universal_weights(ckpt: Path, states: dict) -> dict[str, torch.Tensor]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix=".export-", dir=ckpt.parent) as tmp:
        proc = universal_conversion(ckpt, Path(tmp) / "universal")
        if proc.returncode != 0:
            raise UserError(f"DeepSpeed's universal conversion of {ckpt} (how a ZeRO-3 expert-parallel checkpoint "
                            f"is exported) failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        weights = {}
        for folder in sorted((Path(tmp) / "universal" / "zero").iterdir()):
            if (folder / "fp32.pt").is_file():
                value = torch.load(folder / "fp32.pt", map_location="cpu", weights_only=False)
                weights[folder.name] = value["param"] if isinstance(value, dict) else value
    buffers = set(states.get("buffer_names") or ())
    weights.update({k: v for k, v in states["module"].items() if k in buffers})
    return weights


def _autoep_states(ckpt: Path) -> dict | None:
    """The model states of an AutoEP checkpoint (ZeRO-0/1/2 write per-expert files beside them; ZeRO-3's are per
    rank), else None."""
    for name, sign in (("mp_rank_00_model_states.pt", "layer_*_expert_*_model_states.pt"),
                       ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        if list(ckpt.glob(sign)) and (ckpt / name).is_file():
            states = torch.load(ckpt / name, map_location="cpu", weights_only=False)
            if states.get("ds_autoep_layers"):
                return states
    return None


def consolidated_state_dict(ckpt: Path, shapes=None, adapters: bool = False,
                            model_type: str | None = None) -> dict[str, torch.Tensor]:
    """Full weights of a checkpoint without a process group: fp32 masters gathered from ZeRO shards (any
    stage), or for pipeline checkpoints the per-layer module states (the engine's own weights); an expert-parallel
    checkpoint in transformers' layout (`shapes()`: the target model's tensor shapes, asked only for one).
    `adapters`: a LoRA run's, whose trained weights are all in the ZeRO partitions, also under expert parallelism
    (its experts are frozen base: AutoEP's per-expert files hold the base's own, reloaded from the base)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if (ckpt / CONSOLIDATED).exists():
        return torch.load(ckpt / CONSOLIDATED, map_location="cpu", weights_only=False)
    run_dir = ckpt.parent.parent  # run/checkpoints/step_N
    if (ckpt / replica_tag(0)).is_dir():  # DiLoCo: every replica holds the shared weights at a finished run's end
        ckpt = ckpt / replica_tag(0)
    names_file = run_dir / "model_config" / PIPELINE_NAMES
    if list(ckpt.glob("layer_*-model_states.pt")) and names_file.exists():
        return _pipeline_state_dict(ckpt, json.loads(names_file.read_text()))
    states = None if adapters else _autoep_states(ckpt)
    if states is not None:
        from ..parallel import ds_internals
        return _expert_parallel_state_dict(ckpt, states, shapes() if shapes else {},
                                           ds_internals.autoep_shared_names(model_type))
    if list(ckpt.glob("*optim_states.pt")):
        experts = list(ckpt.glob("layer_*_expert_*_model_states.pt"))
        if not experts:
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        # LoRA under expert parallelism: zero_to_fp32 takes every *model_states.pt for a rank's and refuses
        # AutoEP's per-expert files (frozen base here); it reads the rest from a folder of links without them
        with tempfile.TemporaryDirectory() as tmp:
            view = Path(tmp) / ckpt.name
            view.mkdir()
            for f in ckpt.iterdir():
                if f not in experts:
                    (view / f.name).symlink_to(f.resolve())
            return get_fp32_state_dict_from_zero_checkpoint(tmp, tag=ckpt.name)
    # no ZeRO partitions (stage 0 in fp32): the module states hold the full weights
    states = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}


def export_hf(ckpt: Path, out_dir: Path, dtype: torch.dtype = torch.float32, adapter_dir: Path | None = None) -> Path:
    """Write a Hugging Face model directory (safetensors) from a checkpoint; replaces out_dir atomically.
    A LoRA run's checkpoint (model_config/lora/ exists) holds only the adapters: they are loaded onto the base,
    written to adapter_dir in PEFT's format (when given), and merged into out_dir."""
    from transformers import AutoConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from ..vision import frozen_weights, model_class

    unset_hf_deepspeed_config()  # called after training: build a plain model, not a ZeRO-3-partitioned one
    model_files = ckpt.parent.parent / "model_config"
    if not (ckpt / COMPLETE).exists():
        raise UserError(f"{ckpt} is not a complete checkpoint; pass a checkpoints/step_* directory")
    if not model_files.is_dir():
        raise UserError(f"{model_files} is missing; export needs the run directory written by train.py")
    # a model with remote code: the run was started trusting it (model.trust_remote_code, in its recipe.yaml), and
    # model_config/ holds the code it trained with
    remote = _trusted_remote_code(ckpt.parent.parent)
    config = AutoConfig.from_pretrained(model_files, trust_remote_code=remote)
    config.use_cache = True  # run directories written before this was fixed recorded the training setting (off)
    if getattr(config, "quantization_config", None) is not None:
        # a QLoRA run's config records its 4-bit base: the export is the full-precision base with the adapters
        # merged (a 4-bit load here put bitsandbytes layers with plain weights under peft: seen on an H200)
        del config.quantization_config
    auto = model_class(config)  # AutoModelForCausalLM, or AutoModelForImageTextToText

    def shapes() -> dict[str, torch.Size]:  # the target model's tensor shapes: an expert-parallel checkpoint's layout
        with torch.device("meta"):
            built = auto.from_config(config, trust_remote_code=remote)
            return {n: t.shape for n, t in built.state_dict().items()}
    adapters = (model_files / LORA_DIR / "adapter_config.json").exists()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    state = consolidated_state_dict(ckpt, shapes, adapters, getattr(text, "model_type", None))
    if adapters:
        model = _lora_model(model_files, config, state, ckpt, remote)
        trained = {n: p.detach().to(dtype) for n, p in model.named_parameters() if p.requires_grad}
        # adapter_model.safetensors (in the training precision) + adapter_config.json; merged below in fp32
        if adapter_dir is not None:
            _replace_dir(adapter_dir, lambda tmp: model.save_pretrained(tmp, state_dict=trained))
        model = model.merge_and_unload()
    else:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch.float32, trust_remote_code=remote)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        still_meta = [n for n, p in model.named_parameters() if p.is_meta]
        # a vision-language model's frozen tower: not in the checkpoint, read from where the run loaded it
        model.load_state_dict(frozen_weights(model_files, still_meta, remote), strict=False, assign=True)
        model.tie_weights()
        still_meta = [n for n, p in model.named_parameters() if p.is_meta]
        if still_meta or unexpected:
            raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {still_meta}, "
                               f"unexpected {unexpected}")
    model.to(dtype)
    model.config.use_cache = True
    return _replace_dir(out_dir, lambda tmp: _save_model(model, model_files, tmp))


def _lora_model(model_files: Path, config, state: dict, ckpt: Path, remote: bool = False):
    """The base, reloaded from where training loaded it, with the checkpoint's adapters (fp32) on it."""
    from peft import LoraConfig, get_peft_model

    from ..paths import local_or_hub
    from ..vision import model_class

    lora = LoraConfig.from_pretrained(model_files / LORA_DIR)
    base_name = lora.base_model_name_or_path
    try:
        base = model_class(config).from_pretrained(local_or_hub(base_name), config=config, dtype=torch.float32,
                                                    trust_remote_code=remote)
    except OSError as e:
        raise UserError(f"{ckpt} holds LoRA adapters; their base {base_name} cannot be loaded "
                        f"({str(e).splitlines()[0]}): restore it there, or set base_model_name_or_path in "
                        f"{model_files / LORA_DIR / 'adapter_config.json'}") from None
    model = get_peft_model(base, lora)
    where = Path(local_or_hub(base_name))  # adapter/ names its base absolutely, wherever it is loaded from
    model.peft_config["default"].base_model_name_or_path = str(where.resolve()) if where.exists() else base_name
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = trained - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the adapters: missing {sorted(missing)[:4]}, "
                           f"unexpected {sorted(unexpected)[:4]}")
    model.load_state_dict(state, strict=False)
    return model


def _save_model(model, model_files: Path, out: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    model.save_pretrained(out)
    if (model_files / "processor_config.json").exists():  # a vision-language model: its processor, tokenizer in it
        from transformers import AutoProcessor
        AutoProcessor.from_pretrained(model_files).save_pretrained(out)
    else:
        AutoTokenizer.from_pretrained(model_files).save_pretrained(out)
    from ..chat_templates import mistral_file
    found = mistral_file(model_files)
    if found is not None:  # Mistral's own tokenizer file, which its inference reads
        shutil.copy(found, out / found.name)
    if (model_files / "generation_config.json").exists():
        generation = GenerationConfig.from_pretrained(model_files)
        if generation.use_cache is False:
            generation.use_cache = True
        generation.save_pretrained(out)


def _replace_dir(out_dir: Path, write) -> Path:
    """write(tmp) fills a temporary sibling, which then replaces out_dir: a failed export leaves out_dir as it was."""
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    # transformers writes model.safetensors through a private temporary file (mode 0600): give every file the
    # mode a plain write would have, so the people and jobs that share the run can read the model
    umask = os.umask(0)
    os.umask(umask)
    for path in tmp.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
    old = out_dir.with_name(f".old-{out_dir.name}")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _trusted_remote_code(run_dir: Path) -> bool:
    """Whether the run was started with model.trust_remote_code (its recipe.yaml)."""
    import yaml
    recipe = run_dir / "recipe.yaml"
    if not recipe.is_file():
        return False
    model = (yaml.safe_load(recipe.read_text()) or {}).get("model") or {}
    return bool(model.get("trust_remote_code"))


def missing_checkpoint(ckpt: Path) -> str:
    """A step directory that is not there: keep_last pruned it, or it was never saved; say which steps exist
    (issue 85: 'no complete checkpoint in .../step_00000010' sent the user reading the directory)."""
    existing = complete_checkpoints(ckpt.parent) if TAG_RE.match(ckpt.name) else []
    if not existing:
        return f"no complete checkpoint in {ckpt}"
    steps = ", ".join(p.name for p in existing)
    return (f"{ckpt} is not there: checkpoint.keep_last pruned it, or that step was never saved; this run has "
            f"{steps}: export one of them, or pass the run directory for the newest")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dstrain.export",
                                     description="Export a checkpoint to a Hugging Face model directory.")
    parser.add_argument("checkpoint", type=Path, help="a run dir (newest complete checkpoint) or checkpoints/step_*")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: <run dir>/hf)")
    parser.add_argument("--adapter_out", type=Path, default=None,
                        help="LoRA runs: where the adapter goes in PEFT's format (default: adapter/ beside --out)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args(argv)
    try:
        ckpt = args.checkpoint
        if not (ckpt / COMPLETE).exists():
            found = complete_checkpoints(ckpt / "checkpoints") or complete_checkpoints(ckpt)
            if not found:
                raise UserError(missing_checkpoint(ckpt))
            ckpt = found[-1]
        out = args.out or ckpt.parent.parent / "hf"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        print(f"exported {ckpt} -> {export_hf(ckpt, out, dtype, args.adapter_out or out.with_name('adapter'))}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    main()
