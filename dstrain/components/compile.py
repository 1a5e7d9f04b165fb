"""train.compile: torch.compile (inductor) without making the first step wait for it.

Regional: each repeated decoder block (the model's `_no_split_modules`, e.g. LlamaDecoderLayer) is compiled,
not the whole model. The blocks share one code object, so inductor builds one forward and one backward graph
and every layer reuses them (parameters are graph inputs): a fraction of the whole model's compile time for
the same fused kernels (docs/benchmarks.md).

In the background: the first training step runs eager and keeps a detached copy of a block's inputs; after
it, a thread compiles by calling each compiled block once on that copy, forward and backward. Its backward
asks only for the copy's gradient, so no parameter's .grad, and none of DeepSpeed's gradient hooks, is
touched. At the first step boundary after every rank's thread finished (a small collective per step
agrees on it until then), `poll` switches the blocks to the compiled graphs on all ranks at once.
Training is never blocked: launch to first step is the eager one, and the steps after the switch run at
compiled speed. On a node, local rank 0 compiles first and the other ranks after it, from inductor's
then-warm disk cache. Steps before the switch ran eager, so which step switched depends on timing; with
`train.compile_wait` every step is compiled and a run is reproducible, at the price of a first step that
waits. Evaluation (no grad) stays eager. A compile that fails leaves training eager and says why.

Where a block's forward would talk to other ranks or to DeepSpeed's hooks (ZeRO-3 gathers parameters in
submodule hooks, tensor parallelism all-reduces inside layers) or recomputes itself (activation checkpointing),
calling it off the training thread is unsafe: those runs use DeepSpeed's `engine.compile()` of the whole
model, compiled on the first step.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from .. import env
from ..config import Recipe
from ..errors import UserError
from ..parallel.ds_config import zero_stage
from ..parallel.ds_internals import inductor_cache_dir
from ..parallel.layout import Layout
from ..run import faults
from . import Component, Setup


def _copy(value):
    """Detached copies of a call's tensors (requires_grad kept: compiled graphs are guarded on it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in kinds]


def whole_model_reason(zero_stage: int, tensor_parallel: int, activation_checkpointing: bool, blocks: list) -> str:
    """Why the blocks cannot be compiled off the training thread ('' when they can)."""
    if zero_stage >= 3:
        return "ZeRO-3 gathers parameters in hooks inside the blocks"
    if tensor_parallel > 1:
        return "tensor-parallel layers all-reduce inside the blocks"
    if activation_checkpointing:
        return "activation checkpointing recomputes the blocks"
    if not blocks:
        return "the model names no repeated blocks (_no_split_modules)"
    return ""


class RegionalCompile:
    """Compiles `blocks` on first use: in a background thread (wait=False) or in the first step (wait=True).

    `marker`: a file that only the leader (local rank 0) writes, when its compile is done. The other ranks of
    the node start theirs after it and find inductor's on-disk cache warm (one compile per machine, not one
    per rank, sharing the node's cores); a missing marker only makes them wait up to `follow_timeout`."""

    def __init__(self, blocks: list[torch.nn.Module], wait: bool, leader: bool = True, marker: Path | None = None,
                 follow_timeout: float = 900.0, count: Callable[[list[float]], list[float]] = lambda v: v,
                 world: int = 1, attempts: int = 3):
        self.blocks, self.leader, self.marker = blocks, leader, marker
        self.attempts, self.tries = attempts, 0
        self.count, self.world = count, world  # sums [ready, failed] over the ranks
        self.follow_timeout = follow_timeout
        self.eager = [block.forward for block in blocks]
        self.compiled = [torch.compile(forward) for forward in self.eager]
        self.active = wait  # compiled graphs in use (from the step after the thread finished)
        self.captured: tuple | None = None  # a copy of the first training call's inputs
        self.ready = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.switched_at: int | None = None
        for i, block in enumerate(blocks):
            block.forward = self._forward(i)

    def _forward(self, i: int) -> Callable:
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: the training graphs do not apply
                return self.eager[i](*args, **kwargs)
            if self.active:
                return self.compiled[i](*args, **kwargs)
            if self.captured is None:
                self.captured = (_copy(args), _copy(kwargs))
            return self.eager[i](*args, **kwargs)
        return forward

    def _compile(self, args, kwargs) -> None:
        began = time.perf_counter()
        try:
            if not self.leader and self.marker is not None:
                while not self.marker.exists() and time.perf_counter() - began < self.follow_timeout:
                    time.sleep(0.25)
            devices = {t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
            cuda = [d for d in devices if d.type == "cuda"]
            if cuda:  # the current GPU is per thread: a new thread would start on GPU 0, not this rank's
                torch.cuda.set_device(cuda[0])
            # Tracing reads the blocks' parameters, their .grad included, while the training thread's backward
            # and ZeRO's reduction replace those .grad tensors: now and then the trace sees one mid-change and
            # fails ("AssertionError: int(sym)=0 != hint=2176768" in fake-tensor conversion; 2 of 6 launches of
            # the cpu bench preset on 2 ranks under ZeRO-2, 2026-11-28). The race is transient and a new attempt
            # finds inductor's caches warm, so a failed attempt is retried before the run is left eager.
            for attempt in range(1, self.attempts + 1):
                self.tries = attempt
                try:
                    self._trace_all(args, kwargs)
                    break
                except Exception:  # noqa: BLE001 -- the last attempt's error is the one reported
                    if attempt == self.attempts:
                        raise
        except Exception as error:  # noqa: BLE001 -- reported by poll; training goes on eager
            self.error = error
            if not self.leader:  # poll's line on rank 0 can only count the other ranks' failures: say it here
                print(f"train.compile failed in the background on a rank other than local rank 0: "
                      f"{''.join(traceback.format_exception(error))[-3000:]}", file=sys.stderr, flush=True)
        finally:
            if self.leader and self.marker is not None:  # done or failed: the followers go on either way
                try:
                    self.marker.parent.mkdir(parents=True, exist_ok=True)
                    self.marker.touch()
                except OSError:
                    pass
        self.seconds = time.perf_counter() - began
        self.ready.set()
        faults.release("compiled")

    def _trace_all(self, args, kwargs) -> None:
        for compiled in self.compiled:  # one graph for all blocks: the later calls only check guards
            inputs, named = _copy(args), _copy(kwargs)
            out = compiled(*inputs, **named)
            out = out[0] if isinstance(out, (tuple, list)) else out
            wrt = [t for t in (*inputs, *named.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
            if wrt:  # compiles the backward graph; gradients of the copies only
                torch.autograd.grad(out.float().sum(), wrt)

    def poll(self, step: int, say: Callable[[str], None]) -> None:
        """At a step boundary: start the compile after the first step (which it must not slow down), switch
        to the compiled blocks once they are ready, and say so once."""
        if self.active or self.switched_at is not None:
            return
        if self.thread is None:
            if self.captured is not None:
                self.thread = threading.Thread(target=self._compile, args=self.captured, name="dstrain-compile",
                                               daemon=True)
                self.thread.start()
            return
        # All ranks switch at the same step. Measured: ranks that switched 2 steps apart ended the bench's 24
        # steps at loss 3.4166 instead of the eager 3.3803 (together: 3.3803). Most likely cause: ZeRO-2 fills
        # its reduction buckets in the order gradients arrive, and a compiled backward delivers a block's
        # gradients in another order than the eager one, so the ranks reduced mismatched gradients together.
        ready, failed = self.count([float(self.ready.is_set()), float(self.error is not None)])
        if ready < self.world:
            return
        self.switched_at = step + 1
        self.captured = None
        if failed:
            error = self.error or RuntimeError(f"on {int(failed)} other rank(s); their error is above")
            first = str(error).splitlines()[0] if str(error) else ""
            say(f"warning: train.compile failed in the background ({type(error).__name__}: {first[:300]}); "
                f"training continues eager")
            return
        self.active = True
        say(f"compiled {len(self.blocks)} x {type(self.blocks[0]).__name__} in {self.seconds:.1f} s in the "
            f"background{f' ({self.tries} attempts)' if self.tries > 1 else ''}; steps from {self.switched_at} "
            f"use them")


def node_marker() -> Path:
    """A file in inductor's cache folder (shared by the node's ranks) naming this launch: the ranks of one
    launch share their launcher (parent process) and master port. Old markers are removed."""
    folder = inductor_cache_dir() / "dstrain_compiled"
    launch = "-".join(env.master()) + f"-{os.getppid()}"
    if folder.is_dir():
        for old in folder.iterdir():
            try:
                if time.time() - old.stat().st_mtime > 86400:
                    old.unlink()
            except OSError:
                pass
    return folder / launch


def install(engine, zero_stage: int, layout: Layout, activation_checkpointing: bool, wait: bool,
            local_rank: int, say: Callable[[str], None]) -> RegionalCompile | None:
    """train.compile=true: regional compile where it is safe, else DeepSpeed's engine.compile() (returns None)."""
    blocks = blocks_of(engine.module)
    reason = whole_model_reason(zero_stage, layout.tensor_parallel, activation_checkpointing, blocks)
    if reason:
        say(f"train.compile: the whole model, compiled on the first step ({reason})")
        engine.compile()
        return None
    from ..parallel.dist import all_reduce_sum

    # every rank must switch at the same step: the agreement counts all ranks of the world
    regional = RegionalCompile(blocks, wait, leader=local_rank == 0, marker=None if wait else node_marker(),
                               count=lambda values: all_reduce_sum(values, engine.device), world=layout.world_size)
    say(f"train.compile: {len(blocks)} x {type(blocks[0]).__name__} compiled "
        f"{'on the first step' if wait else 'in the background while the first steps run eager'}")
    return regional


# ----------------------------------------------------------------------------- the component

class Compile(Component):
    name = "compile"

    def __init__(self, wait: bool):
        self.wait = wait
        self.regional: RegionalCompile | None = None

    def validate(self, setup: Setup) -> None:
        if setup.layout.is_pipeline:
            raise UserError("train.compile is not supported with pipeline stages; set train.compile=false")

    def attach(self, engine, setup: Setup) -> None:
        self.regional = install(engine, zero_stage(setup.ds_cfg), setup.layout,
                                         setup.recipe.train.activation_checkpointing, self.wait,
                                         setup.ctx.local_rank, setup.log)

    def describe(self) -> dict:
        return {"wait": self.wait}

    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        if self.regional is not None:  # starts the background compile; switches all ranks when it is done
            self.regional.poll(step, say)


def make(recipe: Recipe) -> Compile | None:
    return Compile(recipe.train.compile_wait) if recipe.train.compile else None
