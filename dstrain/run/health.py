"""Steps that go wrong without a sound: a loss or gradient that is not finite, a loss or grad-norm spike, silent
data corruption (run/sdc.py, which this gate asks); `for_run` returns them with the slow-rank check
(run/stragglers.py) as the trainer's step hooks (dstrain/trainer/hooks.py: the protocol, implemented here without
importing the loop).

A non-finite step is skipped on every rank (no weight, optimizer state or schedule change) through DeepSpeed's own
overflow path (ds_internals.gate_optimizer_step: the optimizer asks `decide(grad_norm)` at the step's one norm
check, which every rank makes with the same all-reduced norm). The first one is traced to a module by re-running
the step's micro-batches with hooks (none on the other steps: hooks on every module cost every step);
`fault.max_skipped_steps` skips in a row end the run with EXIT_NONFINITE after a checkpoint of the last good
weights. A spike is a loss (or pre-clip grad norm) more than `fault.spike_sigma` standard deviations above the
mean of the last `fault.spike_window` good steps (OLMo-core's rule); `fault.on_spike: skip` skips it (the loss
is then all-reduced before the update, not after), `log` only counts it. Under fp16 a non-finite step is the loss
scaler's, as it always was: counted, not searched, never a reason to stop.
"""
from __future__ import annotations

import math
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

from ..config import FaultConfig
from ..errors import EXIT_FAILED, EXIT_NONFINITE, UserError
from ..objectives import optional_part
from ..parallel import ds_internals
from ..parallel.dist import all_gather_objects
from . import faults
from .rerun import rerun_loss, without_parameter_gradients
from .sdc import CorruptionCheck
from .stragglers import Stragglers

NONFINITE, LOSS_SPIKE, NORM_SPIKE, SCALER, SDC = ("non-finite", "loss spike", "grad-norm spike", "fp16 overflow",
                                                  "silent data corruption")


REPEATED = 3  # spikes within one window: the run says it keeps spiking


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class StepHealth:
    def __init__(self, cfg: FaultConfig, fp16: bool, say: Callable[[str], None]):
        self.cfg, self.fp16, self.say = cfg, fp16, say
        self.losses: deque = deque(maxlen=cfg.spike_window)  # the last good steps' losses and norms
        self.norms: deque = deque(maxlen=cfg.spike_window)
        self.skipped: dict[str, int] = {}
        self.spikes: dict[str, int] = {}
        self.spike_steps: deque = deque(maxlen=REPEATED)  # the steps of the last few spikes
        self.said_repeated = -(10 ** 9)  # the step the run last said it keeps spiking
        self.in_a_row = 0
        self.located: str | None = None  # the first non-finite step's origin, once searched
        self.stopping = False
        self.weights_bad = False  # an update with non-finite values was applied: nothing may be saved
        self.check_s = self.search_s = 0.0  # host time these checks took (the search's is in both), this session
        self._undo: Callable[[], None] = lambda: None
        self._begin(None)

    @property
    def loss_hook(self) -> Callable[[float], None] | None:
        """What train_step passes the step's loss to before the update, when the decision needs it (a loss spike
        is skipped); None: the loss is all-reduced after the update, as without these checks."""
        return self.loss_before_update if self.cfg.on_spike == "skip" else None

    name = "health"  # the manifest's key for this hook's state_dict (checkpoints written before the hooks use it)

    def attach(self, engine, sdc: CorruptionCheck | None = None,
               locate: Callable[[int], str | None] = lambda step: None) -> StepHealth:
        """`locate(step)`: the first non-finite step re-run with hooks on every module (every rank), its origin."""
        self.engine, self.sdc, self.locate = engine, sdc, locate
        self._skipped_before = engine.skipped_steps
        self._undo = ds_internals.gate_optimizer_step(engine, self._decide)
        return self

    # ---- the step-hook protocol (dstrain/trainer/hooks.py)
    def before_step(self, step: int) -> None:
        self.begin(step)

    def after_update(self, step: int, say: Callable[[str], None]) -> None:
        pass

    def after_step(self, result) -> None:
        result.columns |= self.after(result.step, result.loss, result.grad_norm, self.locate)

    def before_save(self, step: int) -> bool:
        return self.safe_to_save(self.engine, step)

    def state_dict(self) -> dict:
        return self.state()

    def load_state_dict(self, state: dict | None) -> None:
        self.restore(state)

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.sdc is not None and self.sdc.found else EXIT_NONFINITE

    def replay_due(self, step: int, layout) -> bool:
        """The step's first micro-batch is replayed before its update (run/sdc.py)."""
        return self.sdc is not None and self.sdc.replay_due(step) and not layout.is_pipeline

    def safe_to_save(self, engine, step: int) -> bool:
        """Before a checkpoint: the replicas still agree (every rank calls this). False: nothing may be saved."""
        if self.weights_bad:  # already known (every rank alike): no replica comparison needed
            return False
        if self.sdc is not None and not self.sdc.replicas(engine, step, "before the checkpoint of"):
            self.stopping = self.weights_bad = True
        return not self.weights_bad

    def close(self) -> None:
        self._undo()

    def state(self) -> dict:
        """What a checkpoint keeps, so a resumed run judges spikes against the same window."""
        return {"losses": list(self.losses), "norms": list(self.norms), "skipped": self.skipped,
                "spikes": self.spikes, "in_a_row": self.in_a_row}

    def restore(self, state: dict | None) -> None:
        if state:
            self.losses.extend(state["losses"])
            self.norms.extend(state["norms"])
            self.skipped, self.spikes, self.in_a_row = dict(state["skipped"]), dict(state["spikes"]), \
                state["in_a_row"]

    def _begin(self, step: int | None) -> None:
        self.step, self.loss, self.norm, self.reason, self.decided = step, None, None, None, False

    def begin(self, step: int, engine=None) -> None:
        """Before a step: at a check step, the replicas' weights are compared (a difference skips the update)."""
        self._begin(step)
        if self.sdc is not None and self.sdc.due(step):
            self.sdc.replicas(engine or self.engine, step, "at the start of")

    def loss_before_update(self, loss: float) -> None:
        self.loss = loss

    def _spike(self, window: deque, value: float | None) -> bool:
        if value is None or len(window) < window.maxlen:
            return False
        mean, spread = statistics.fmean(window), statistics.pstdev(window)
        return value - mean > self.cfg.spike_sigma * spread

    def _decide(self, norm: float) -> bool:
        began = time.perf_counter()
        try:
            return self._answer(norm)
        finally:
            self.check_s += time.perf_counter() - began

    def _answer(self, norm: float) -> bool:
        """The optimizer's question at this step's norm check: discard the step? Asked again in the same step
        (ZeRO-1/2's clipping asks once more), the first answer stands."""
        if self.decided:
            return self.reason is not None
        self.decided, self.norm = True, norm
        if self.sdc is not None and self.sdc.found:
            self.reason = SDC
        elif not _finite(norm) or norm < 0 or (self.loss is not None and not _finite(self.loss)):
            self.reason = SCALER if self.fp16 else NONFINITE
        elif self.cfg.on_spike == "skip" and self._spike(self.losses, self.loss):
            self.reason = LOSS_SPIKE
        elif self.cfg.on_spike == "skip" and self._spike(self.norms, norm):
            self.reason = NORM_SPIKE
        return self.reason is not None

    def after(self, step: int, loss: float, grad_norm: float | None, rerun: Callable[[int], str | None]) -> dict:
        """Judge the finished step: count it, say it, search the first non-finite one (`rerun`: every rank
        re-runs the step's micro-batches with hooks; the origins they found); returns the metrics row's fields."""
        began = time.perf_counter()

        def search(at: int) -> str | None:
            searched = time.perf_counter()
            try:
                return rerun(at)
            finally:
                self.search_s += time.perf_counter() - searched
        try:
            return self._after(step, loss, grad_norm, search)
        finally:
            self.check_s += time.perf_counter() - began

    def _after(self, step: int, loss: float, grad_norm: float | None, rerun: Callable[[int], str | None]) -> dict:
        skipped_by_engine = self.engine.skipped_steps - self._skipped_before
        self._skipped_before = self.engine.skipped_steps
        if self.sdc is not None and self.sdc.found:  # said by run/sdc.py; nothing of this step may be kept
            self.stopping = self.weights_bad = True
            self.skipped[SDC] = 1
            return {"grad_norm": grad_norm, "skipped": SDC, "skipped_steps": sum(self.skipped.values()),
                    "spikes": sum(self.spikes.values())}
        reason = self.reason or (SCALER if skipped_by_engine and self.fp16 else
                                 NONFINITE if skipped_by_engine else None)
        if reason is None and not (_finite(loss) and (grad_norm is None or _finite(grad_norm))):
            # an optimizer that never asked (none of DeepSpeed's ZeRO or bf16 ones): the update was applied, the
            # weights may be bad; the run stops now and saves nothing
            self.weights_bad = self.stopping = True
            self.say(f"step {step}: the loss ({loss:.4g}) or the gradient norm is not finite and this optimizer "
                     f"applied the update anyway; stopping without a checkpoint (the newest one is older)")
            return {"grad_norm": grad_norm, "skipped_steps": sum(self.skipped.values()),
                    "spikes": sum(self.spikes.values())}
        norm = self.norm if self.norm is not None else grad_norm
        spike = None
        if reason is None:
            spike = LOSS_SPIKE if self._spike(self.losses, loss) else NORM_SPIKE if self._spike(self.norms, norm) \
                else None
        elif reason in (LOSS_SPIKE, NORM_SPIKE):
            spike = reason
        if spike:
            self.spikes[spike] = self.spikes.get(spike, 0) + 1
            window = self.losses if spike == LOSS_SPIKE else self.norms
            value = loss if spike == LOSS_SPIKE else norm
            self.say(f"step {step}: {spike}: {value:.4g} against a mean of {statistics.fmean(window):.4g} "
                     f"(sd {statistics.pstdev(window):.3g}) over the last {len(window)} steps; "
                     f"{'skipped (fault.on_spike=skip)' if reason else 'logged only (fault.on_spike=log)'}")
            self.spike_steps.append(step)
            recent = [s for s in self.spike_steps if s > step - self.cfg.spike_window]
            if len(recent) == REPEATED and step - self.said_repeated >= self.cfg.spike_window:  # once a window
                self.say(f"the run keeps spiking: {len(recent)} spikes in the last {self.cfg.spike_window} steps "
                         f"(steps {', '.join(map(str, recent))}); a lower train.lr, more train.warmup_steps or "
                         f"gradient clipping (DeepSpeed's gradient_clipping) usually calm it; check those steps' data")
                self.said_repeated = step
        if reason is None or reason == SCALER:
            self.in_a_row = 0
            if reason is None and spike is None:
                self.losses.append(loss)
                if _finite(norm):
                    self.norms.append(norm)
        if reason:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if reason and reason != SCALER:
            self.in_a_row += 1
            if reason == NONFINITE:
                origin = ""
                if self.located is None:
                    self.located = rerun(step) or "not found: the re-run with hooks was finite everywhere"
                    origin = f"; first non-finite module: {self.located}"
                self.say(f"step {step}: skipped: the loss ({loss:.4g}) or the gradient norm "
                         f"({norm if norm is not None else float('nan'):.4g}) is not finite; no weight, optimizer "
                         f"state or schedule changed{origin}")
            if self.in_a_row >= self.cfg.max_skipped_steps:
                self.stopping = True
                self.say(self.advice(step))
        return {"grad_norm": norm, "skipped_steps": sum(self.skipped.values()), "spikes": sum(self.spikes.values())} \
            | ({"skipped": reason} if reason else {}) | ({"spike": spike} if spike else {})

    @property
    def why(self) -> str:
        """The status a stopped run ends with."""
        return SDC if self.sdc is not None and self.sdc.found else "fault.max_skipped_steps"

    def advice(self, step: int) -> str:
        if self.sdc is not None and self.sdc.found:
            return (f"no checkpoint of step {step} was written (each one is checked before it is written); check "
                    f"the named rank's host, then run again (--resume auto) from the newest checkpoint")
        if self.weights_bad:
            return "no checkpoint of these weights was written; run again (--resume auto) from the newest one"
        what = "not finite" if NONFINITE in self.skipped else "a spike"
        return (f"stopping: {self.in_a_row} steps in a row ({step - self.in_a_row + 1}-{step}) were {what} "
                f"(fault.max_skipped_steps={self.cfg.max_skipped_steps}); the checkpoint saved now holds the last "
                f"good weights. Try a lower train.lr or more train.warmup_steps, gradient clipping, bf16 instead of "
                f"fp16, or check the data of those steps" + (f" (first non-finite module: {self.located})"
                                                               if self.located else "")
                + ("; fault.on_spike=log trains through spikes" if what == "a spike" else ""))

    def summary(self) -> dict:
        extra = {}
        if self.sdc is not None:
            extra |= self.sdc.summary()
        check_s = self.check_s - self.search_s + (self.sdc.check_s if self.sdc is not None else 0.0)
        return {"skipped_steps": self.skipped, "spikes": self.spikes, "first_nonfinite_module": self.located,
                **extra, "check_s": round(check_s, 6), "search_s": round(self.search_s, 3)}


def for_run(cfg: FaultConfig, precision: str, zero_stage: int, layout, run_dir, engine,
            say: Callable[[str], None], locate: Callable[[int], str | None]) -> tuple[list, StepHealth]:
    """Every check of a training run as step hooks, in the order they run: the slow-rank comparison (the step's
    time), then the gate (NaN/spike/SDC), attached to the engine; and the gate again, which train_step consults
    inside the step. Every rank: the hosts are all-gathered once."""
    hosts = all_gather_objects(socket.gethostname())
    gate = StepHealth(cfg, precision == "fp16", say).attach(
        engine, CorruptionCheck(cfg, layout, zero_stage, hosts, say), locate)
    return [Stragglers(cfg, layout.rank, layout.world_size, hosts, run_dir, say, engine.device), gate], gate


def check(cfg: FaultConfig, precision: str, layout) -> None:
    """What these checks cannot do, refused before anything is built."""
    if cfg.on_spike == "skip" and precision == "fp16":
        raise UserError("fault.on_spike=skip needs bf16 or fp32: under fp16 a skipped step also lowers the loss "
                        "scale; use fault.on_spike=log, or train.precision=bf16")
    if cfg.on_spike == "skip" and layout.is_pipeline:
        raise UserError("fault.on_spike=skip is not available with a pipeline (its engine runs the whole step, the "
                        "loss is known only after the update); use fault.on_spike=log")


def locate(engine, micro_batches: list[dict], objective, layout, step: int) -> str | None:
    """Re-run the step's micro-batches with a hook on every module: the first whose output is not finite while
    its inputs were (forward), else the first whose input gradient is not finite while its output gradient was
    (backward). No parameter gradient is made (parameters are frozen for the re-run, the embeddings' output asks
    for a gradient instead), so DeepSpeed's gradient buffers and hooks see nothing. Every rank runs every
    micro-batch (ZeRO-3 gathers parameters collectively) and the origins are gathered; returns "rank R: NAME
    (output|gradient)" for the first rank that found one."""
    from ..objectives.batches import global_counts

    if layout.is_pipeline or optional_part(objective, "prepare") is not None:
        return "not searched (a pipeline's stages, or learning from rewards: the rollout is not re-run)"
    rank, model = layout.rank, engine.module
    found: list[str] = []

    def tensors(*things) -> list[torch.Tensor]:
        out = []
        for thing in things:
            if isinstance(thing, torch.Tensor) and thing.is_floating_point():
                out.append(thing)
            elif isinstance(thing, (tuple, list)):
                out += tensors(*thing)
            elif isinstance(thing, dict):
                out += tensors(*thing.values())
        return out

    def bad(ts) -> bool:
        return any(not bool(torch.isfinite(t).all()) for t in ts if t is not None)

    def forward_hook(name):
        def hook(_module, args, kwargs, output):
            if not found and bad(tensors(output)) and not bad(tensors(args, kwargs)):
                found.append(f"{name or 'the model'} (output)")
        return hook

    def backward_hook(name):
        def hook(_module, grad_input, grad_output):
            if not found and bad(tensors(grad_input)) and not bad(tensors(grad_output)):
                found.append(f"{name or 'the model'} (gradient)")
        return hook

    hooks, error = [], None
    disarm = faults.arm(model, rank, step)  # an injected fault of this step happens again, as a real bug would
    try:
        with without_parameter_gradients(model):
            for name, module in model.named_modules():
                hooks.append(module.register_forward_hook(forward_hook(name), with_kwargs=True))
                hooks.append(module.register_full_backward_hook(backward_hook(name)))
            totals = global_counts(objective, micro_batches, layout, engine.device)[0]
            for batch in micro_batches:
                rerun_loss(engine, batch, objective, totals, backward=True)
    except Exception as failure:  # noqa: BLE001 - the search is a diagnosis; its failure must not end the run
        error = f"not searched ({type(failure).__name__}: {str(failure)[:120]})"
    finally:
        for hook in hooks:
            hook.remove()
        disarm()
    mine = found[0] if found else error
    everyone = [mine]
    if torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    origins = [f"rank {r}: {what}" for r, what in enumerate(everyone) if what]
    return next((o for o in origins if "not searched" not in o), origins[0] if origins else None)
