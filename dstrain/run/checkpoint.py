"""Saving, loading and verifying checkpoints, and the files a run directory keeps for export.

Layout of a run directory:
  checkpoints/step_00000100/   DeepSpeed shards + rng_rank*.pt + complete.json (written last)
  checkpoints/latest           name of the newest complete checkpoint (informational)
  model_config/                config, tokenizer, generation config of the model being trained
  hf/                          the exported Hugging Face model (dstrain/run/export.py)
Choosing a checkpoint, adapting it to another world size and universal conversion: dstrain/run/resume.py.

A checkpoint is written under a hidden temporary name and renamed into place only after every rank
has finished writing and complete.json lists its files with their sizes and SHA-256 (each rank hashes a
share); a save interrupted at any point leaves only a `.tmp-*` directory that resume never considers.
Resume verifies the newest checkpoint's files first (again a share per rank); a damaged one is renamed
`step_N.corrupt`, named in a warning, and the one before it is used. A save that fails (disk full,
permission) raises SaveError on the rank that saw it, which ends the job; nothing complete is touched.
Older checkpoints are pruned after a newer one is complete, so one complete checkpoint always remains.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import CheckpointConfig
from ..errors import EXIT_SAVE_FAILED, UserError
from ..parallel import ds_internals
from ..parallel.dist import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    broadcast_object,
    looks_like_comm_failure,
)
from ..parallel.layout import Layout
from . import faults

COMPLETE = "complete.json"
UNIVERSAL_SUFFIX = ".universal"  # checkpoints/step_N.universal/: a conversion beside step_N (dstrain/run/resume.py)


@dataclass
class Resume:
    """A checkpoint chosen to continue from (resume.choose picks it; Checkpointer.load reads it)."""
    path: Path  # checkpoints/step_N
    manifest: dict
    universal: bool = False  # load from universal_dir (converted for another data-parallel size or ZeRO stage)
    # the universal folder is loaded into a plain PyTorch optimizer (ZeRO-0 in fp32), which DeepSpeed's universal
    # loader does not serve: ds_internals.load_universal_into_plain_optimizer does it
    into_plain: bool = False
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # newer checkpoints that failed verification

    @property
    def universal_dir(self) -> Path:
        """checkpoints/step_N.universal: beside the checkpoint, never inside it, so the original stays as saved."""
        return self.path.with_name(self.path.name + UNIVERSAL_SUFFIX)


class SaveError(Exception):
    """A checkpoint could not be written; earlier checkpoints are untouched. Carries the exit code."""
    code = EXIT_SAVE_FAILED  # not retried by launch/ scripts: a full disk stays full
TAG_RE = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if TAG_RE.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(TAG_RE.match(p.name).group(1)))


def write_atomic(path: Path, text: str) -> None:
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


CONSOLIDATED = "consolidated_model.pt"


def replica_tag(replica: int) -> str:
    """A DiLoCo replica's DeepSpeed state inside a checkpoint: step_N/replica_K/ (components/diloco.py)."""
    return f"replica_{replica}"


def has_frozen(engine) -> bool:
    """A model with frozen parameters (a LoRA base): checkpoints hold only what trains; the base is re-read from
    where it was loaded on resume, so loading the module's state is not strict."""
    return any(not p.requires_grad for p in engine.module.parameters())


@dataclass
class _InFlight:
    """A save whose files a background writer is still writing (checkpoint.background)."""
    step: int
    tmp: Path
    final: Path
    client_state: dict
    job: object  # background_save.Job


class Checkpointer:
    def __init__(self, run_dir: Path, cfg: CheckpointConfig, ctx: DistContext, layout: Layout | None = None,
                 extras: dict | None = None, background: bool = False):
        self.root = run_dir / "checkpoints"
        self.cfg, self.ctx = cfg, ctx
        # Per-rank state besides DeepSpeed's, by name: objects with state_dict() / load_state_dict(state,
        # same_world), written as <name>_rank<R>.pt (gradient compression's residuals and factors, say).
        self.extras = extras or {}
        # DeepSpeed's offline consolidation (zero_to_fp32) cannot merge tensor-parallel shards, so TP runs
        # also store the gathered weights; every rank takes part in the gather.
        self.consolidate = layout is not None and layout.tensor_parallel > 1
        # DiLoCo: each replica's engine saves its own state (its inner optimizer's) under step_N/replica_K/
        self.replica = replica_tag(layout.replica) if layout is not None and layout.replicas > 1 else None
        self.replica_index = layout.replica if layout is not None else 0
        # Each file's CRC-32 goes in the manifest (_file_record), which resume checks; the zip's own per-record
        # CRC-32 inside torch.save computes the same over the same bytes again with miniz's table code (0.6 s of CPU
        # a GB, on the cores that train while a background save writes). torch.load never checks it.
        torch.serialization.set_crc32_options(False)
        self.writer = None
        if background:  # dstrain/run/background_save.py: the step waits for a host copy, a thread writes the files
            from .background_save import Writer, engine_for
            self.writer = Writer(ctx.rank, _file_record)
            self.host_engine = engine_for(self.writer)
        self.in_flight: _InFlight | None = None
        self.failures = 0  # background saves failed in a row
        self.every: int | None = None  # checkpoint.every=auto: the interval, once the first save has measured the stall
        self.last_call: float | None = None
        self.step_times: list[float] = []
        # seconds the training loop spent in each save: all of a synchronous one; of a background one, the copy at
        # the save and the wait for the rest of it before the next optimizer step (final once that step has run)
        self.stalls: list[float] = []
        self.stall_final = False
        self.writes: list[float] = []  # seconds each background write took (this rank)

    PROBE_STEP = 5  # checkpoint.every=auto: the first save, which measures the stall

    def due(self, step: int, max_steps: int) -> bool:
        """Whether step ends with a save. Called once a step: with checkpoint.every=auto it also times the steps."""
        if self.cfg.every != "auto":
            return step == max_steps or (self.cfg.every > 0 and step % self.cfg.every == 0)
        now = time.perf_counter()
        if self.last_call is not None:
            self.step_times.append(now - self.last_call)
        self.last_call = now
        if step == max_steps:
            return True
        if self.every is None:  # not measured yet: the first save measures the stall
            return step >= self.PROBE_STEP and not self.stalls
        return step % self.every == 0

    def before_update(self) -> None:
        """Before an optimizer step (steps.train_step): a background save's deferred copy of the engine's state must
        be done, since the update changes it in place; its wait counts in the save's stall."""
        if self.in_flight is not None:
            waited = self.writer.wait_copied()
            if self.stalls:
                self.stalls[-1] += waited
        self.stall_final = bool(self.stalls)

    def choose_interval(self, nodes: int, mtbf_hours: float, device, say: Callable[[str], None]) -> None:
        """checkpoint.every=auto, once the first save's stall is known (every rank calls this after every step):
        Young/Daly's interval, sqrt(2 x stall x MTBF of the job), in steps of the median step time; said with the
        work a failure is expected to cost."""
        if self.cfg.every != "auto" or self.every is not None or not self.stall_final or not self.step_times:
            return
        import statistics

        # the ranks' means: every rank must choose the same interval (a save is collective)
        stall, step_s = (v / self.ctx.world_size for v in all_reduce_sum(
            [self.stalls[-1], statistics.median(self.step_times[-20:])], device))
        stall = max(stall, 1e-3)
        mtbf_s = mtbf_hours * 3600 / max(1, nodes)
        interval_s = math.sqrt(2 * stall * mtbf_s)
        self.every = max(1, round(interval_s / max(step_s, 1e-6)))
        lost = self.every * step_s / 2 + stall
        say(f"checkpoint.every=auto: every {self.every:,} steps ({interval_s / 60:,.1f} min at {step_s:.3g} s a step; "
            f"a save stalls the step {stall:.3g} s; mean time between failures of {nodes} node"
            f"{'s' if nodes > 1 else ''} {mtbf_s / 3600:,.0f} h, fault.mtbf_hours={mtbf_hours:g} per node): a failure "
            f"costs about {_duration(lost)} of work, saves {100 * stall / (self.every * step_s):.2g}% of the time")

    def save(self, engine, step: int, client_state: dict, wait: bool = True,
             say: Callable[[str], None] | None = None) -> Path:
        """Save step's state as checkpoints/step_N. In the background (checkpoint.background) with wait=False,
        return once the state is copied off the device; poll() publishes it later. wait=True (the last save of a
        run) writes before it returns, without a host copy: nothing would run while the copy is written, and the
        copy would take host memory the size of the state (16.2 GiB for a 1.24B model on one GPU) in a run that
        had none taken before. A failed save raises SaveError; a failed background save is reported through say
        and the next save tries again."""
        final = self.root / tag_for(step)
        if self.in_flight is not None and self.in_flight.step == step:  # saved at the step, now waited for
            self.finish(step, say, last=wait)
            return final
        if (final / COMPLETE).exists():
            return final
        began = time.perf_counter()
        self.finish(step, say)  # at most one save in flight: the previous one is written and published first
        tmp = self.root / f".tmp-{tag_for(step)}"
        try:
            if self.ctx.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # debris of an interrupted save
            barrier()
            if self.writer is not None and not wait:
                self.in_flight = _InFlight(step, tmp, final, client_state, self.writer.begin(step, tmp))
                with ds_internals.using_checkpoint_engine(engine, self.host_engine):
                    self._write(engine, step, tmp, client_state, self.writer.put)
                self.writer.seal()
                self.stalls.append(time.perf_counter() - began)
                self.stall_final = False
                return final
            self._write(engine, step, tmp, client_state, torch.save)
            os.sync()  # this node's shards reach the disk before any rank lists them as complete
            faults.point("save:shards", self.ctx.rank, step)
            barrier()
            names = broadcast_object(sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
                                     if self.ctx.is_main else None)
            mine = {n: _file_record(tmp / n) for i, n in enumerate(names) if i % self.ctx.world_size == self.ctx.rank}
            self._publish(step, tmp, final, client_state, mine)
        except Exception as error:  # torch.save reports a full disk as e.g. "unexpected pos 876224 vs 876112"
            raise self._failed(step, tmp, error) from error
        barrier()
        self.stalls.append(time.perf_counter() - began)
        self.stall_final = True
        return final

    def _write(self, engine, step: int, tmp: Path, client_state: dict, save: Callable) -> None:
        """Every file of this rank's share of the checkpoint, through save(obj, path)."""
        state = dict(client_state, step=step)
        # DeepSpeed's universal conversion reads this marker; under AutoEP DeepSpeed writes its own (with the
        # expert layers' layout) and refuses a client's
        if not ds_internals.autoep_layers(engine.module):
            state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2}
        where, tag = (tmp, self.replica) if self.replica else (self.root, tmp.name)
        engine.save_checkpoint(str(where), tag=tag, client_state=state, save_latest=False,
                               exclude_frozen_parameters=has_frozen(engine))
        save(_rng_state(), tmp / f"rng_rank{self.ctx.rank}.pt")
        for name, extra in self.extras.items():
            save(extra.state_dict(), tmp / f"{name}_rank{self.ctx.rank}.pt")
        if self.consolidate:
            full = ds_internals.consolidated_16bit_state_dict(engine)  # all ranks gather; rank 0 receives
            if self.ctx.is_main:
                save(full, tmp / CONSOLIDATED)

    def _publish(self, step: int, tmp: Path, final: Path, client_state: dict, mine: dict) -> None:
        """Every rank's file records gathered; rank 0 writes complete.json, renames the folder into place,
        points `latest` at it and prunes the oldest."""
        records = {k: v for part in all_gather_objects(mine) for k, v in part.items()}
        if not self.ctx.is_main:
            return
        for path in tmp.rglob("*"):  # files DeepSpeed wrote itself rather than through the checkpoint engine
            name = str(path.relative_to(tmp))
            if path.is_file() and name not in records:
                records[name] = _file_record(path)
        manifest = {"step": step, "world_size": self.ctx.world_size, **client_state,
                    "files": dict(sorted(records.items()))}
        write_atomic(tmp / COMPLETE, json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        faults.point("save:manifest", self.ctx.rank, step)
        if final.exists():  # an incomplete directory of that name (never complete, so never resumed)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        faults.point("save:publish", self.ctx.rank, step)
        write_atomic(self.root / "latest", final.name + "\n")
        faults.point("save:prune", self.ctx.rank, step)
        for old in complete_checkpoints(self.root)[:-self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
            for derived in self.root.glob(old.name + UNIVERSAL_SUFFIX + "*"):  # its conversion, a failure mark
                if derived.is_dir():
                    shutil.rmtree(derived, ignore_errors=True)
                else:
                    derived.unlink(missing_ok=True)

    def _failed(self, step: int, tmp: Path, error: BaseException) -> BaseException:
        if looks_like_comm_failure(error):
            return error  # a peer died mid-save: the watchdog names it
        message = self._save_failure(step, error)
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; nothing complete lives there
        return SaveError(message)

    def poll(self, step: int, device, say: Callable[[str], None]) -> None:
        """At the end of step: publish the save in flight once every rank's writer has finished (one small
        all-reduce per step while a save is in flight, none otherwise)."""
        if self.in_flight is None:
            return
        done = all_reduce_sum([float(self.in_flight.job.done.is_set())], device)[0]
        if done == self.ctx.world_size:
            self._complete(step, say, last=False)

    def finish(self, step: int, say: Callable[[str], None] | None = None, last: bool = False) -> None:
        """At step: wait for the save in flight, if any, and publish it (every rank calls this)."""
        if self.in_flight is not None:
            self.in_flight.job.done.wait()
            self._complete(step, say, last)

    def _complete(self, now: int, say: Callable[[str], None] | None, last: bool) -> None:
        """Publish the save in flight; a failed one is said and the next save tries again, but a second failure
        in a row (a disk that stays full) or a failure of the run's last save raises SaveError."""
        flight, self.in_flight = self.in_flight, None
        job = flight.job
        self.writes.append(job.write_s)
        said = all_gather_objects(None if job.error is None else f"{type(job.error).__name__}: {job.error}")
        failed = [(rank, text) for rank, text in enumerate(said) if text is not None]
        try:
            if failed:
                rank, text = failed[0]
                raise job.error if job.error is not None else RuntimeError(f"{text} (on rank {rank})")
            faults.point("save:shards", self.ctx.rank, flight.step)
            self._publish(flight.step, flight.tmp, flight.final, flight.client_state, job.records)
        except Exception as error:
            if looks_like_comm_failure(error):
                raise
            barrier()  # every rank has stopped writing into tmp before it is removed
            failure = self._failed(flight.step, flight.tmp, error)
            self.failures += 1
            if last or say is None or self.failures > 1:
                raise failure from error
            if self.ctx.is_main:
                say(f"warning: {failure} (written in the background; the next save tries again)")
            return
        self.failures = 0
        barrier()
        if say is not None and now > flight.step and self.ctx.is_main:
            say(f"checkpoint {flight.final.name} complete: written in the background in {job.write_s:.1f} s while "
                f"steps {flight.step + 1}-{now} ran; the step waited {self.stalls[-1]:.2f} s for its copy")

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

    def load(self, engine, resume: Resume) -> dict:
        """Restore engine (weights, optimizer, LR schedule), the extras and this rank's RNG; returns the manifest."""
        load_dir, tag = (resume.universal_dir.parent, resume.universal_dir.name) if resume.universal \
            else (resume.path, replica_tag(self.replica_index % resume.manifest.get("replicas", 1))) if self.replica \
            else (resume.path.parent, resume.path.name)  # DiLoCo: a replica that joined takes replica k mod saved
        if resume.into_plain:
            load_path = ds_internals.load_universal_into_plain_optimizer(engine, resume.universal_dir)
        else:
            with ds_internals.universal_load_repairs(engine, resume.universal,
                                                     resume.universal_dir if resume.universal else None):
                load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                                      load_lr_scheduler_states=True,
                                                      load_module_strict=not has_frozen(engine))
        if load_path is None:
            raise UserError(f"DeepSpeed could not load checkpoint {resume.path}; it may be from another run layout")
        for name, extra in self.extras.items():
            self._load_extra(resume, name, extra)
        rng_file = resume.path / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return resume.manifest

    def _load_extra(self, resume: Resume, name: str, extra) -> None:
        """This rank's own state on the same world; on another world, the rank the extra names (source_rank: rank 0's
        by default; DiLoCo's outer state is cut into slices, one per rank of a replica)."""
        mine = resume.path / f"{name}_rank{self.ctx.rank}.pt"
        same_world = resume.manifest.get("world_size") == self.ctx.world_size and mine.exists()
        source = mine if same_world else resume.path / f"{name}_rank{extra.source_rank(self.ctx.rank)}.pt"
        if not source.exists():
            if self.ctx.is_main:
                print(f"warning: {resume.path.name} holds no {name} state; it starts afresh", file=sys.stderr)
            return
        extra.load_state_dict(torch.load(source, weights_only=False), same_world=same_world)


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:,.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:,.1f} h"


# ----------------------------------------------------------------------------- background or not

def checkpoint_copy_bytes(ds_cfg: dict, layout: Layout, parameters: int, trained: int | None = None,
                          experts: int = 0) -> int:
    """Host memory a background checkpoint takes on the rank that writes the most (dstrain/run/background_save.py),
    kept from one save to the next for reuse: what the rank writes, its optimizer share's fp32 weights and two
    Adam moments (12 bytes a trained parameter, three flat buffers) and, on data-parallel rank 0 of ZeRO-0/1/2,
    the module's trained weights whole (one flat buffer; ZeRO-3 writes its weights inside the optimizer shares).
    On GPU hosts the buffers are page-locked at their own size (background_save.HostPages), not by PyTorch's
    pinned allocator, which rounds each up to a power of two (28.0 GiB for gpu-1b's 17.3 GB). `experts`: the
    routed experts' parameters under expert parallelism, of which a rank holds 1/EP with their optimizer states
    shared by the N/EP ranks holding the same experts only."""
    from ..parallel.ds_config import precision, zero_stage

    stage, sixteen_bit = zero_stage(ds_cfg), precision(ds_cfg) != "fp32"
    split = layout.pipeline_stages * layout.tensor_parallel
    share = layout.zero_shards if stage >= 1 or sixteen_bit else 1
    trained = trained or parameters
    w = 2 if sixteen_bit else 4
    if experts and layout.expert_parallel > 1:  # no tensor or pipeline split beside it (components/expert_parallel)
        dense, local = trained - experts, experts // layout.expert_parallel
        return 3 * 4 * (dense // share + local // max(1, share // layout.expert_parallel)) + \
            (w * (dense + local) if stage < 3 else 0)
    return 3 * (4 * trained // (split * share)) + (w * trained // split if stage < 3 else 0)


def uses_nvme(ds_cfg: dict) -> bool:
    zero = ds_cfg.get("zero_optimization") or {}
    return any((zero.get(key) or {}).get("device") == "nvme" for key in ("offload_optimizer", "offload_param"))


def background_saves(cfg: CheckpointConfig, ds_cfg: dict) -> bool:
    """Whether checkpoint.background may write in the background (auto decides again at the start, from free
    memory): not with NVMe offload, whose swap files DeepSpeed copies while it saves."""
    return cfg.background != "false" and not uses_nvme(ds_cfg)


def check_background(cfg: CheckpointConfig, ds_cfg: dict) -> None:
    """Part of the validation pass: a setting that cannot apply is said before anything is built."""
    if cfg.background == "true" and uses_nvme(ds_cfg):
        raise UserError("checkpoint.background=true cannot apply with NVMe offload (DeepSpeed copies its swap "
                        "files while it saves); use checkpoint.background=auto or false")


def background_decision(cfg: CheckpointConfig, ds_cfg: dict, layout: Layout, parameters: int,
                        trained: int | None, ranks_per_node: int, experts: int = 0) -> tuple[bool, str]:
    """Whether saves run in the background, and the line that says so (the host copy's size:
    checkpoint_copy_bytes)."""
    if cfg.background == "false":
        return False, "checkpoints: written before the step goes on (checkpoint.background=false)"
    if not background_saves(cfg, ds_cfg):
        return False, "checkpoints: written before the step goes on (NVMe offload: DeepSpeed copies its swap files)"
    import psutil

    copy = checkpoint_copy_bytes(ds_cfg, layout, parameters, trained, experts)
    free = psutil.virtual_memory().available // max(1, ranks_per_node)
    size = f"a {copy / 2**20:,.0f} MiB host copy per rank"
    if cfg.background == "auto" and copy > free // 2:
        return False, (f"checkpoints: written before the step goes on ({size} would not fit in half of the "
                       f"{free / 2**20:,.0f} MiB free per rank; checkpoint.background=true forces it)")
    return True, f"checkpoints: written in the background ({size}; the step waits only for the copy)"


# ----------------------------------------------------------------------------- integrity

def _file_record(path: Path, kind: str = "crc32") -> dict:
    """A file's size and digest. CRC-32 (zlib's, 3-4 GB/s a core here against SHA-256's 1 GB/s): it guards against
    torn and truncated writes and flipped bits, not against tampering; manifests written before it carry
    "sha256", which is still checked."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if kind == "sha256":
            return {"size": size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
        crc, buffer = 0, bytearray(1 << 24)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
        return {"size": size, "crc32": f"{crc:08x}"}


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
        else:
            kind = "crc32" if "crc32" in want else "sha256"
            if _file_record(file, kind)[kind] != want[kind]:
                out.append(f"{name} fails its {'CRC-32' if kind == 'crc32' else 'SHA-256'} check")
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


# ----------------------------------------------------------------------------- run files

def write_run_files(run_dir: Path, recipe, ds_cfg: dict, config, tokenizer, ctx: DistContext, info: dict) -> None:
    """The resolved recipe and DeepSpeed JSON, run facts, and the model's config and tokenizer (for export)."""
    import deepspeed
    import transformers
    from transformers import GenerationConfig

    from ..config import dump_recipe
    from ..parallel.ds_config import write

    if not ctx.is_main:
        return
    dump_recipe(recipe, run_dir / "recipe.yaml")
    write(ds_cfg, run_dir / "ds_config.json")
    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                "transformers": transformers.__version__}
    write_atomic(run_dir / "run_info.json", json.dumps(dict(info, versions=versions), indent=1, default=str))
    out = run_dir / "model_config"
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.use_cache = True  # training turns the KV cache off; whoever loads the export generates with it
    config.save_pretrained(out)
    _copy_remote_code(config, out)
    tokenizer.save_pretrained(out)
    processor = getattr(tokenizer, "_dstrain_processor", None)
    if processor is not None:  # a vision-language model: its processor (image processing, template) beside it
        processor.chat_template = tokenizer.chat_template
        processor.save_pretrained(out)
    if getattr(tokenizer, "mistral_common_file", None):  # Mistral's own tokenizer file: the format it trained on
        shutil.copy(tokenizer.mistral_common_file, out / Path(tokenizer.mistral_common_file).name)
    try:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    except ValueError:
        pass


def _copy_remote_code(config, out: Path) -> None:
    """A model with remote code: the modules its config names (auto_map) beside it, so that export and resume
    rebuild the model from the run directory alone (config.save_pretrained copies the configuration's module only;
    the export of a remote-code run asked for modeling_*.py: issue 85)."""
    import inspect

    auto_map = getattr(config, "auto_map", None) or {}
    for reference in auto_map.values():
        for ref in reference if isinstance(reference, (list, tuple)) else [reference]:
            if not ref:
                continue
            module = ref.split("--")[-1].split(".")[0]
            local = Path(str(getattr(config, "_name_or_path", "") or "")) / f"{module}.py"
            if local.is_file():
                source = local.parent
            else:  # from the Hub: the copy transformers keeps in its modules cache
                from transformers.dynamic_module_utils import get_class_from_dynamic_module
                source = Path(inspect.getfile(get_class_from_dynamic_module(ref, config._name_or_path))).parent
            for file in source.glob("*.py"):  # the module and what it imports relatively
                if not (out / file.name).exists() and file.name != "__init__.py":
                    shutil.copy(file, out / file.name)


PIPELINE_NAMES = "pipeline_layers.json"


def write_pipeline_names(run_dir: Path, names: dict[int, str], ctx: DistContext) -> None:
    """Which HF parameter prefix each pipeline layer holds, so export can rebuild the HF state dict."""
    if ctx.is_main:
        write_atomic(run_dir / "model_config" / PIPELINE_NAMES, json.dumps({str(k): v for k, v in names.items()}))


def universal_conversion(src: Path, out: Path) -> subprocess.CompletedProcess:
    """DeepSpeed's ds_to_universal from checkpoint folder `src` into `out`, in a child process. Its merge pass
    forks workers: after a serial extraction (one worker) the forked children hung for good (seen: the parent's
    torch threads), so one extraction worker means a serial merge too."""
    workers = min(4, os.cpu_count() or 1)
    return subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
                           "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers",
                           str(workers), "--num_merge_workers", str(min(2, workers))],
                          capture_output=True, text=True)
