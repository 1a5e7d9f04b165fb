"""Save, resume and export.

Layout of a run directory:
  checkpoints/step_00000100/   DeepSpeed shards + rng_rank*.pt + complete.json (written last)
  checkpoints/latest           name of the newest complete checkpoint (informational)
  model_config/                config, tokenizer, generation config of the model being trained
  hf/                          the exported Hugging Face model

A checkpoint is written under a hidden temporary name and renamed into place only after every rank
has finished writing and complete.json lists its files with their sizes and SHA-256 (each rank hashes a
share); a save interrupted at any point leaves only a `.tmp-*` directory that resume never considers.
Resume verifies the newest checkpoint's files first (again a share per rank); a damaged one is renamed
`step_N.corrupt`, named in a warning, and the one before it is used. A save that fails (disk full,
permission) raises SaveError on the rank that saw it, which ends the job; nothing complete is touched.
Older checkpoints are pruned after a newer one is complete, so one complete checkpoint always remains.

A checkpoint from another data-parallel size is converted once by DeepSpeed's universal-checkpoint tool
into step_N/universal/ and loaded from there; the global batch is kept (grad_accum_steps is re-derived)
and the data position is the sample count in the manifest, so no sample is skipped or seen twice.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import psutil
import torch

from . import faults
from .config import CheckpointConfig, TrainConfig
from .dist import DistContext, all_gather_objects, barrier, broadcast_object, looks_like_comm_failure
from .errors import UserError

COMPLETE = "complete.json"
UNIVERSAL = "universal"
SAVE_FAILED_EXIT = 74  # EX_IOERR: not retried by launch/ scripts, since a full disk stays full


class SaveError(Exception):
    """A checkpoint could not be written; earlier checkpoints are untouched. Carries the exit code."""
    code = SAVE_FAILED_EXIT
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
    def __init__(self, run_dir: Path, cfg: CheckpointConfig, ctx: DistContext, tensor_parallel: int = 1,
                 compression=None):
        self.root = run_dir / "checkpoints"
        self.cfg, self.ctx = cfg, ctx
        self.compression = compression  # a dstrain.compression.Reducer: error buffers and factors per rank
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
        tmp = self.root / tmp_tag
        rank = self.ctx.rank
        try:
            if self.ctx.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # debris of an interrupted save
            barrier()
            state = dict(client_state, step=step, universal_checkpoint_info={"universal_checkpoint_version": 0.2})
            engine.save_checkpoint(str(self.root), tag=tmp_tag, client_state=state, save_latest=False)
            torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
            if self.compression is not None:
                torch.save(self.compression.state_dict(), tmp / f"compression_rank{rank}.pt")
            if self.consolidate:
                full = engine._consolidated_16bit_state_dict()  # all ranks gather; rank 0 receives
                if self.ctx.is_main:
                    torch.save(full, tmp / CONSOLIDATED)
            os.sync()  # this node's shards reach the disk before any rank lists them as complete
            faults.point("save:shards", rank, step)
            barrier()
            names = broadcast_object(sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
                                     if self.ctx.is_main else None)
            mine = {n: _file_record(tmp / n) for i, n in enumerate(names) if i % self.ctx.world_size == rank}
            records = {k: v for part in all_gather_objects(mine) for k, v in part.items()}
            if self.ctx.is_main:
                manifest = {"step": step, "world_size": self.ctx.world_size, **client_state,
                            "files": dict(sorted(records.items()))}
                _write_atomic(tmp / COMPLETE, json.dumps(manifest, indent=1))
                _fsync_dir(tmp)
                faults.point("save:manifest", rank, step)
                if final.exists():  # an incomplete directory of that name (never complete, so never resumed)
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _fsync_dir(self.root)
                faults.point("save:publish", rank, step)
                _write_atomic(self.root / "latest", final.name + "\n")
                faults.point("save:prune", rank, step)
                for old in complete_checkpoints(self.root)[:-self.cfg.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as error:  # torch.save reports a full disk as e.g. "unexpected pos 876224 vs 876112"
            if looks_like_comm_failure(error):
                raise  # a peer died mid-save: the watchdog names it
            message = self._save_failure(step, error)
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; nothing complete lives there
            raise SaveError(message) from error
        barrier()
        return final

    def _save_failure(self, step: int, error: BaseException) -> str:
        try:
            usage = shutil.disk_usage(self.root)
            full = usage.free < max(16 * 2**20, usage.total // 100)
            free = f"{usage.free / 2**20:,.0f} MiB free there{': the file system is full' if full else ''}"
        except OSError:
            free = "free space unknown"
        newest = complete_checkpoints(self.root)
        kept = f"the newest complete checkpoint, {newest[-1].name}, is intact" if newest else \
            "no earlier checkpoint exists"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"could not save checkpoint {tag_for(step)} in {self.root} on rank {self.ctx.rank}: {first} "
                f"({free}); the partial save was removed and {kept}. Free space or fix permissions, then run "
                f"again with --resume auto")

    def load(self, engine, resume: "Resume") -> dict:
        """Restore engine (weights, optimizer, LR schedule) and this rank's RNG; returns the manifest."""
        load_dir, tag = (resume.path, UNIVERSAL) if resume.universal else (resume.path.parent, resume.path.name)
        groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
        decays = [group.get("weight_decay") for group in groups]
        load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise UserError(f"DeepSpeed could not load checkpoint {resume.path}; it may be from another run layout")
        if resume.universal:  # two slips of DeepSpeed's ZeRO-3 universal loader, mended here:
            for group, decay in zip(groups, decays):  # every group got group 0's hyperparameters
                group["weight_decay"] = decay
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            for state in inner.state.values():  # one `step` tensor shared by all sub-groups, each adding 1
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        if self.compression is not None:
            self._load_compression(resume)
        rng_file = resume.path / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return resume.manifest

    def _load_compression(self, resume: "Resume") -> None:
        """This rank's error buffers and the shared low-rank factors; with a new data-parallel world the
        per-rank residuals have no owner, so only the factors carry over (a warning says so)."""
        mine = resume.path / f"compression_rank{self.ctx.rank}.pt"
        shared = resume.path / "compression_rank0.pt"
        same_world = resume.manifest.get("world_size") == self.ctx.world_size and mine.exists()
        source = mine if same_world else shared
        if not source.exists():
            if self.ctx.is_main:
                print(f"warning: {resume.path.name} holds no gradient-compression state; error feedback starts "
                      f"from zero", file=sys.stderr)
            return
        self.compression.load_state_dict(torch.load(source, weights_only=False), errors=same_world)
        if not same_world and self.ctx.is_main:
            print("warning: the data-parallel world changed, so the gradient-compression residuals were dropped "
                  "(the low-rank factors carry over)", file=sys.stderr)


# ----------------------------------------------------------------------------- integrity and resume

def _file_record(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _problems(path: Path, names: list[str], records: dict) -> list[str]:
    out = []
    for name in names:
        file, want = path / name, records[name]
        if not file.is_file():
            out.append(f"{name} is missing")
        elif want is None:  # manifests from before checksums list names only
            continue
        elif file.stat().st_size != want["size"]:
            out.append(f"{name} has {file.stat().st_size} bytes, the manifest says {want['size']}")
        elif _file_record(file)["sha256"] != want["sha256"]:
            out.append(f"{name} fails its SHA-256 check")
    return out


def verify(path: Path, ctx: DistContext) -> list[str]:
    """Every problem with a checkpoint's files, each rank checking a share; the same list on every rank."""
    try:
        files = json.loads((path / COMPLETE).read_text())["files"]
        records = files if isinstance(files, dict) else {name: None for name in files}
        names = sorted(records)
        mine = _problems(path, [n for i, n in enumerate(names) if i % ctx.world_size == ctx.rank], records)
    except (OSError, ValueError, KeyError, TypeError) as error:
        mine = [f"{COMPLETE} is unreadable ({type(error).__name__}: {error})"]
    return sorted(set(sum(all_gather_objects(mine), [])))


@dataclass
class Resume:
    path: Path  # checkpoints/step_N
    manifest: dict
    universal: bool = False  # load from path/universal/ (converted for another data-parallel size)


def choose(mode: str, root: Path, ctx: DistContext, check: bool, log=print) -> Optional[Resume]:
    """The verified checkpoint to resume from. Damaged ones are set aside as step_N.corrupt (auto) or
    refused (an explicit path)."""
    first = resolve_resume(mode, root)
    if first is None:
        return None
    candidates = list(reversed(complete_checkpoints(root))) if mode == "auto" else [first]
    for path in candidates:
        problems = verify(path, ctx) if check else []
        if not problems:
            return Resume(path, json.loads((path / COMPLETE).read_text()))
        detail = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        if mode != "auto":
            raise UserError(f"checkpoint {path} is damaged: {detail}; resume from another one, or pass "
                            f"--checkpoint.verify=false to load it anyway")
        if ctx.is_main:
            aside = path.with_name(path.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            log(f"warning: checkpoint {path} is damaged ({detail}); moved it to {aside.name} and trying the "
                f"one before it")
        barrier()
    raise UserError(f"every checkpoint in {root} is damaged (moved to *.corrupt); start a new --output_dir")


def adapt_to_world(resume: Resume, train: TrainConfig, data_parallel: int, pipeline_or_tp: bool,
                   log=print) -> None:
    """Keep the checkpoint's global batch on a different data-parallel size by re-deriving grad_accum_steps."""
    manifest = resume.manifest
    global_batch = manifest.get("global_batch")
    saved_dp = manifest.get("data_parallel", manifest.get("world_size"))
    ours = train.micro_batch_size * train.grad_accum_steps * data_parallel
    if saved_dp == data_parallel:
        if global_batch != ours:
            raise UserError(f"checkpoint {resume.path} was trained with a global batch of {global_batch} samples, "
                            f"this run has {ours}; keep micro_batch_size x grad_accum_steps x data-parallel size "
                            f"unchanged to resume exactly, or start a new --output_dir")
        return
    if pipeline_or_tp:
        raise UserError(f"checkpoint {resume.path} was saved with {saved_dp} data-parallel replicas and this run "
                        f"has {data_parallel}; pipeline and tensor-parallel checkpoints resume only on the same "
                        f"layout, so launch {manifest.get('world_size')} ranks")
    per_step = train.micro_batch_size * data_parallel
    if global_batch % per_step:
        raise UserError(f"checkpoint {resume.path} has a global batch of {global_batch} samples, which "
                        f"{data_parallel} ranks x micro_batch_size {train.micro_batch_size} cannot make up; "
                        f"choose a micro_batch_size that divides {global_batch // data_parallel if global_batch % data_parallel == 0 else global_batch}")
    log(f"world changed from {saved_dp} to {data_parallel} data-parallel ranks: grad_accum_steps "
        f"{train.grad_accum_steps} -> {global_batch // per_step} keeps the global batch at {global_batch}")
    train.grad_accum_steps = global_batch // per_step
    resume.universal = bool(list(resume.path.glob("*optim_states.pt")))  # stage 0 fp32 needs no conversion


def to_universal(resume: Resume, ctx: DistContext, log=print) -> None:
    """Convert a partitioned checkpoint once (on rank 0) into path/universal/; the others wait for it."""
    out, failed = resume.path / UNIVERSAL, resume.path / f"{UNIVERSAL}.failed"
    started = psutil.Process().create_time()
    if ctx.is_main and not out.is_dir():
        tmp = resume.path / f".tmp-{UNIVERSAL}"
        shutil.rmtree(tmp, ignore_errors=True)
        failed.unlink(missing_ok=True)
        log(f"converting {resume.path} to a universal checkpoint for the new world size")
        began = time.time()
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(resume.path), "--output_folder", str(tmp), "--inject_missing_state",
                               "--num_extract_workers", str(min(4, os.cpu_count() or 1))],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _write_atomic(failed, f"DeepSpeed's universal-checkpoint conversion of {resume.path} failed: "
                                  f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}; resume on "
                                  f"{resume.manifest.get('world_size')} ranks instead")
        else:
            os.rename(tmp, out)
            log(f"converted in {time.time() - began:.1f} s")
    while not out.is_dir():  # no barrier: a big conversion may outlast the collective timeout
        if failed.is_file() and failed.stat().st_mtime >= started:  # not one from an earlier run
            raise UserError(failed.read_text())  # every rank reports the same failure and leaves
        time.sleep(0.5)


# ----------------------------------------------------------------------------- export

def export_dtype(ds_cfg: dict) -> torch.dtype:
    """Export in the precision the engine computed in, so the exported logits are the engine's."""
    from .ds_config import precision
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision(ds_cfg), torch.float32)


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
