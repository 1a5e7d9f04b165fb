"""Save, resume and export.

Layout of a run directory:
  checkpoints/step_00000100/   DeepSpeed shards + rng_rank*.pt + complete.json (written last)
  checkpoints/latest           name of the newest complete checkpoint (informational)
  model_config/                config, tokenizer, generation config of the model being trained
  hf/                          the exported Hugging Face model

A checkpoint is written under a hidden temporary name and renamed into place only after every rank
has finished writing and complete.json lists its files; a save interrupted at any point leaves only a
`.tmp-*` directory that resume never considers. Older checkpoints are pruned after a newer one is
complete, so there is always at least one complete checkpoint on disk.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from .config import CheckpointConfig
from .dist import DistContext, barrier
from .errors import UserError

COMPLETE = "complete.json"
TAG_RE = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if TAG_RE.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(TAG_RE.match(p.name).group(1)))


def checkpoint_step(path: Path) -> int:
    return json.loads((path / COMPLETE).read_text())["step"]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_resume(mode: str, root: Path) -> Optional[Path]:
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


CONSOLIDATED = "consolidated_model.pt"


class Checkpointer:
    def __init__(self, run_dir: Path, cfg: CheckpointConfig, ctx: DistContext, tensor_parallel: int = 1):
        self.root = run_dir / "checkpoints"
        self.cfg, self.ctx = cfg, ctx
        # DeepSpeed's offline consolidation (zero_to_fp32) cannot merge tensor-parallel shards, so TP runs
        # also store the gathered weights; every rank takes part in the gather.
        self.consolidate = tensor_parallel > 1

    def due(self, step: int, max_steps: int) -> bool:
        return step == max_steps or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def save(self, engine, step: int, client_state: dict) -> Path:
        final = self.root / tag_for(step)
        if (final / COMPLETE).exists():
            return final
        tmp_tag = f".tmp-{tag_for(step)}"
        if self.ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.root / tmp_tag, ignore_errors=True)  # debris of an interrupted save
        barrier()
        engine.save_checkpoint(str(self.root), tag=tmp_tag, client_state=dict(client_state, step=step),
                               save_latest=False)
        torch.save(_rng_state(), self.root / tmp_tag / f"rng_rank{self.ctx.rank}.pt")
        if self.consolidate:
            full = engine._consolidated_16bit_state_dict()  # all ranks gather; rank 0 receives
            if self.ctx.is_main:
                torch.save(full, self.root / tmp_tag / CONSOLIDATED)
        barrier()
        if self.ctx.is_main:
            files = sorted(str(p.relative_to(self.root / tmp_tag)) for p in (self.root / tmp_tag).rglob("*")
                           if p.is_file())
            manifest = {"step": step, "files": files, "world_size": self.ctx.world_size, **client_state}
            _write_atomic(self.root / tmp_tag / COMPLETE, json.dumps(manifest, indent=1))
            if final.exists():  # an incomplete directory of that name (never complete, so never resumed)
                shutil.rmtree(final)
            os.rename(self.root / tmp_tag, final)
            _write_atomic(self.root / "latest", final.name + "\n")
            for old in complete_checkpoints(self.root)[:-self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def load(self, engine, path: Path, global_batch: int) -> dict:
        """Restore engine (weights, optimizer, LR schedule) and this rank's RNG; returns the manifest."""
        manifest = json.loads((path / COMPLETE).read_text())
        if manifest.get("global_batch") != global_batch:
            raise UserError(f"checkpoint {path} was trained with a global batch of {manifest.get('global_batch')} "
                            f"samples, this run has {global_batch}; keep micro_batch_size x grad_accum_steps x "
                            f"data-parallel size unchanged to resume exactly, or start a new --output_dir")
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise UserError(f"DeepSpeed could not load checkpoint {path}; it may be from another run layout")
        rng_file = path / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return manifest


# ----------------------------------------------------------------------------- export

def export_dtype(ds_cfg: dict) -> torch.dtype:
    """Export in the precision the engine computed in, so the exported logits are the engine's."""
    if (ds_cfg.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_cfg.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def write_run_files(run_dir: Path, recipe, ds_cfg: dict, config, tokenizer, ctx: DistContext, info: dict) -> None:
    """The resolved recipe and DeepSpeed JSON, run facts, and the model's config and tokenizer (for export)."""
    import deepspeed
    import transformers
    from transformers import GenerationConfig

    from .config import dump_recipe
    from .ds_config import write

    if not ctx.is_main:
        return
    dump_recipe(recipe, run_dir / "recipe.yaml")
    write(ds_cfg, run_dir / "ds_config.json")
    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                "transformers": transformers.__version__}
    _write_atomic(run_dir / "run_info.json", json.dumps(dict(info, versions=versions), indent=1, default=str))
    out = run_dir / "model_config"
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    try:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    except ValueError:
        pass


PIPELINE_NAMES = "pipeline_layers.json"


def write_pipeline_names(run_dir: Path, names: dict[int, str], ctx: DistContext) -> None:
    """Which HF parameter prefix each pipeline layer holds, so export can rebuild the HF state dict."""
    if ctx.is_main:
        _write_atomic(run_dir / "model_config" / PIPELINE_NAMES, json.dumps({str(k): v for k, v in names.items()}))


def _pipeline_state_dict(ckpt: Path, names: dict[str, str]) -> dict[str, torch.Tensor]:
    from .pipeline import strip_wrapper

    state = {}
    for index, prefix in names.items():
        files = sorted(ckpt.glob(f"layer_{int(index):02d}-*model_states.pt"))
        if not files:
            raise UserError(f"{ckpt} lacks pipeline layer {index}; the checkpoint is incomplete")
        layer = torch.load(files[0], map_location="cpu", weights_only=False)
        for key, value in layer.items():
            state[prefix + strip_wrapper(key)] = value
    return state


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full weights of a checkpoint without a process group: fp32 masters gathered from ZeRO shards (any
    stage), or for pipeline checkpoints the per-layer module states (the engine's own weights)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if (ckpt / CONSOLIDATED).exists():
        return torch.load(ckpt / CONSOLIDATED, map_location="cpu", weights_only=False)
    names_file = ckpt.parent.parent / "model_config" / PIPELINE_NAMES
    if list(ckpt.glob("layer_*-model_states.pt")) and names_file.exists():
        return _pipeline_state_dict(ckpt, json.loads(names_file.read_text()))
    if list(ckpt.glob("*optim_states.pt")):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    # no ZeRO partitions (stage 0 in fp32): the module states hold the full weights
    states = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}


def export_hf(ckpt: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face model directory (safetensors) from a checkpoint; replaces out_dir atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # called after training: build a plain model, not a ZeRO-3-partitioned one
    model_files = ckpt.parent.parent / "model_config"
    if not (ckpt / COMPLETE).exists():
        raise UserError(f"{ckpt} is not a complete checkpoint; pass a checkpoints/step_* directory")
    if not model_files.is_dir():
        raise UserError(f"{model_files} is missing; export needs the run directory written by train.py")
    config = AutoConfig.from_pretrained(model_files)
    state = consolidated_state_dict(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {still_meta}, "
                           f"unexpected {unexpected}")
    model.to(dtype)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model_files).save_pretrained(tmp)
    if (model_files / "generation_config.json").exists():
        GenerationConfig.from_pretrained(model_files).save_pretrained(tmp)
    old = out_dir.with_name(f".old-{out_dir.name}")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_main(argv: Optional[list[str]] = None) -> Any:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m dstrain.export",
                                     description="Export a checkpoint to a Hugging Face model directory.")
    parser.add_argument("checkpoint", type=Path, help="a run dir (newest complete checkpoint) or checkpoints/step_*")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: <run dir>/hf)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args(argv)
    try:
        ckpt = args.checkpoint
        if not (ckpt / COMPLETE).exists():
            found = complete_checkpoints(ckpt / "checkpoints") or complete_checkpoints(ckpt)
            if not found:
                raise UserError(f"no complete checkpoint in {ckpt}")
            ckpt = found[-1]
        out = args.out or ckpt.parent.parent / "hf"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        print(f"exported {ckpt} -> {export_hf(ckpt, out, dtype)}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
