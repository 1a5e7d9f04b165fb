"""Silent data corruption: a flipped bit in one rank's weights, or one rank computing a different answer to the
same question, found before the update is applied or a checkpoint written.

- Replicas: under ZeRO-0/1/2 every data-parallel rank holds the same weights (DeepSpeed all-gathers them after each
  update). An exact checksum of each rank's (the integer sum of every parameter's bit pattern: any flipped bit
  changes it) is all-gathered over the data-parallel group at the start of every `fault.sdc_check_every`-th step
  and before every checkpoint; the ranks that disagree with the majority are named (with two ranks, both: no
  majority). ZeRO-3 keeps no replicated weights: only the replay runs there.
- Replay (torchtitan's idea): the first micro-batch of every sdc_check_every-th step is run again, before the
  update, with the same weights, and its loss and the gradient at the embeddings' output are compared with the
  step's own (the replay's backward starts from the same scaled loss, so both round alike in bf16 too). A rank
  whose numbers differ beyond `REPLAY_RTOL` is named. The replay makes no parameter gradient (run/health.py's
  without_parameter_gradients), so it cannot disturb the step it checks.

A mismatch skips the step's update on every rank, writes no checkpoint, and ends the run with EXIT_FAILED (the
launch/ scripts retry from the newest checkpoint, which a check passed before it was written).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from ..config import FaultConfig
from ..parallel.dist import all_gather_objects
from .rerun import rerun_loss, without_parameter_gradients

# the replay against the step: the same kernels on the same inputs in the same order give the same bits on CPUs
# (measured: equal); the margin is for GPU kernels that sum in a varying order (atomics). A corruption that
# matters moves these sums by far more (a flipped low mantissa bit changes nothing a step could notice)
REPLAY_RTOL = 1e-4

_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


CHUNK = 1 << 22  # elements summed at once: the int64 sum's temporary stays 32 MiB, whatever the matrix


def checksum(parameters) -> int:
    """The integer sum of the parameters' bit patterns (int64, wrapping): equal weights give equal sums on every
    rank, and one flipped bit changes it."""
    total = None
    for p in parameters:
        data = p.detach()
        if data.numel() == 0:
            continue
        bits = data.contiguous().view(-1).view(_INT_OF[data.element_size()])
        for start in range(0, bits.numel(), CHUNK):
            part = bits[start:start + CHUNK].sum(dtype=torch.int64)
            total = part if total is None else total + part
    return int(total) if total is not None else 0


class CorruptionCheck:
    def __init__(self, cfg: FaultConfig, layout, zero_stage: int, hosts: list[str], say: Callable[[str], None]):
        self.every, self.layout, self.hosts, self.say = cfg.sdc_check_every, layout, hosts, say
        self.replicated = zero_stage < 3  # ZeRO-3: each rank holds a different part of the weights
        self.found: str | None = None
        self.checked_at: int | None = None  # the last step whose replicas were compared
        self.replicas_checked = self.replays = 0
        self.replay_off: str | None = None  # why the replay could not run, once it could not
        self.check_s = 0.0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def replay_due(self, step: int) -> bool:
        return self.due(step) and self.replay_off is None

    def replicas(self, engine, step: int, when: str) -> bool:
        """Compare the data-parallel ranks' weights (every rank calls this); False when they disagree."""
        if not self.replicated or self.checked_at == step or self.found:
            return self.found is None
        began = time.perf_counter()
        self.checked_at = step
        # expert parallelism: each rank holds its own routed experts (DeepSpeed marks them allreduce=False,
        # deepspeed.moe.utils.is_moe_param), so only the rest is a replica to compare
        mine, text = checksum(p for p in engine.module.parameters() if getattr(p, "allreduce", True)), ""
        if torch.distributed.is_initialized():
            group = self.layout.data_parallel_group  # None: the world (sequence-parallel ranks hold the same too)
            sums = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(sums, mine, group=group)
            ranks = [torch.distributed.get_global_rank(group, i) if group is not None else i
                     for i in range(len(sums))]
            majority = max(set(sums), key=sums.count)
            has_majority = sums.count(majority) * 2 > len(sums)
            odd = [r for r, s in zip(ranks, sums) if s != majority] if has_majority else ranks
            if len(set(sums)) > 1:
                text = (f"the weights of {self._ranks(odd)} differ from "
                        f"{'the other ranks' if has_majority else 'each other'}' {when} step {step} (checksums "
                        f"{', '.join(f'{s:#x}' for s in sums)}; under ZeRO-0/1/2 every data-parallel rank holds "
                        f"the same weights): a flipped bit in memory, or a faulty device")
        self.replicas_checked += 1
        self._agree(text)  # every rank learns it, whichever data-parallel group found it
        self.check_s += time.perf_counter() - began
        return self.found is None

    def rng_state(self) -> dict:
        """The random generators' states now (module rng_state(); train_step reaches it through the check)."""
        return rng_state()

    def capture(self, model, due: bool):
        """At a replay step, a context in which the gradient at the embeddings' output of the step's first
        micro-batch is appended, as (sum, sum of absolute values) in float64, to the list it yields."""
        return _embedding_gradient(model) if due else nullcontext([])

    def replay(self, engine, batch: dict, objective, totals: dict, loss: float, grad: tuple | None, scale: float,
               step: int, rng: dict | None = None) -> None:
        """Run the step's first micro-batch again (every rank, before the update) and compare. `rng`: the random
        generators' states when the step's first micro-batch began (rng_state()), so dropout draws the same masks;
        the generators are put back as they were after."""
        began = time.perf_counter()
        now = rng_state()
        try:
            set_rng_state(rng)
            with without_parameter_gradients(engine.module), _embedding_gradient(engine.module) as got:
                again = float(rerun_loss(engine, batch, objective, totals, grad is not None, scale,
                                         engine.gradient_accumulation_steps()))
        except Exception as error:  # noqa: BLE001 - a check that cannot run must not end the run it checks
            # the same code on every rank fails the same way, before its first collective
            self.replay_off = f"{type(error).__name__}: {str(error)[:160]}"
            self.say(f"warning: the SDC replay cannot run here ({self.replay_off}); the replicas' checksums go on")
            return
        finally:
            set_rng_state(now)
        problems = []
        if not _close(again, loss):
            problems.append(f"loss {loss!r} in the step, {again!r} replayed")
        if grad is not None and got:
            want = got[0]
            if not (_close(grad[0], want[0], scale=want[1]) and _close(grad[1], want[1])):
                problems.append(f"gradient (sum, |sum|) {grad[0]:.6g}, {grad[1]:.6g} in the step, "
                                f"{want[0]:.6g}, {want[1]:.6g} replayed")
        self.replays += 1
        said = all_gather_objects("; ".join(problems))
        bad = [r for r, text in enumerate(said) if text]
        if bad:  # `said` is every rank's already: no second gather
            self._found(f"step {step} replayed on the same weights gave other numbers on {self._ranks(bad)} "
                        f"({'; '.join(f'rank {r}: {said[r]}' for r in bad)}): a faulty device computes wrong "
                        f"answers now and then")
        self.check_s += time.perf_counter() - began

    def _ranks(self, ranks: list[int]) -> str:
        return " and ".join(f"rank {r} ({self.hosts[r]})" for r in ranks)

    def _agree(self, text: str) -> None:
        found = next((t for t in all_gather_objects(text) if t), None)
        if found:
            self._found(found)

    def _found(self, text: str) -> None:
        self.found = text
        self.say(f"silent data corruption: {text}; stopping before the update is applied or a checkpoint is written")

    def summary(self) -> dict:
        return {"sdc_replica_checks": self.replicas_checked, "sdc_replays": self.replays, "sdc_found": self.found}


def rng_state() -> dict:
    """The states of the generators a forward draws from (dropout): the CPU's and the current accelerator's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict | None) -> None:
    if state:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


@contextmanager
def _embedding_gradient(model):
    got: list = []

    def hook(_module, _args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: got.append(_moments(g)))
    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield got
    finally:
        handle.remove()


def _moments(g: torch.Tensor) -> tuple[float, float]:
    g = g.detach().double()
    return float(g.sum()), float(g.abs().sum())


def _close(a: float, b: float, scale: float | None = None) -> bool:
    return abs(a - b) <= REPLAY_RTOL * max(abs(scale if scale is not None else b), 1e-30)
