"""The build, fit and finish phases of a run, on one object that keeps what it builds (torchtitan's Trainer shape).

    Trainer(resolved, ctx, watchdog).run()  ->  build()  ->  fit()  ->  finish()  ->  exit code

build: the checkpoint to resume converted if it must be, the components' configure/convert, the model, DeepSpeed's
engine, the components' attach, the objective's before_training, the data stream, the checkpointer, the run's
state loaded from the checkpoint (load_state_dict), the metrics and the step hooks (hooks.py).
fit: the loop, one call per concern. finish: the last checkpoint, the export, summary.json.
Nothing here names a component, an objective or a check: they come in through the components' Setup, the
Objective protocol and the step hooks.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

from .. import components, data, env, flops, moe, vision
from .. import model as models
from ..errors import EXIT_OK, UserError
from ..metrics import Metrics
from ..objectives import optional_part
from ..parallel import comm_counter, ds_config, ds_internals
from ..paths import local_or_hub, weights_fingerprint
from ..planner import memory
from ..run import checkpoint, events, export, faults, health, preempt, resume
from . import schedule
from .hooks import ComponentHooks, Hooks, StepResult
from .resolve import Resolved
from .steps import evaluate, train_step


class Trainer:
    def __init__(self, resolved: Resolved, ctx, watchdog):
        self.resolved, self.ctx, self.watchdog = resolved, ctx, watchdog
        self.recipe, self.run_dir, self.objective = resolved.recipe, resolved.run_dir, resolved.objective
        self.cfg = resolved.recipe.train
        self.log = resolved.setup.log
        # optimizer steps that train on one batch of the stream (RL's rl.num_iterations: a rollout's updates)
        self.steps_per_batch = optional_part(self.objective, "steps_per_batch", 1)

    def run(self) -> int:
        self.build()
        self.fit()
        return self.finish()

    # ---- build
    def build(self) -> None:
        r = self.resolved
        self._convert_checkpoint()
        for feature in r.features:
            feature.configure(r.ds_cfg, r.setup)
        self.baseline_memory = memory.current_bytes()  # everything after this is the model and its training
        model = self._build_model()
        self._build_engine(model)
        self.peak = flops.device_peak(self.engine.device, r.setup.precision)  # all ranks at once: shared cores
        self._build_data()
        # AutoEP's trained experts on this rank (allreduce=False: reduced within their own group), times the EP
        # size; LoRA's frozen ones hold no optimizer state
        experts = self.layout.expert_parallel * sum(getattr(p, "ds_numel", p.numel())
                                                    for p in self.engine.module.parameters()
                                                    if p.requires_grad and not getattr(p, "allreduce", True))
        self.save_in_background, save_mode_note = checkpoint.background_decision(
            self.recipe.checkpoint, r.ds_cfg, self.layout, self.params_total, self.trained, env.ranks_per_node(),
            experts)
        self.log(save_mode_note)
        self.ckpt = checkpoint.Checkpointer(self.run_dir, self.recipe.checkpoint, self.ctx, self.layout,
                                            components.stateful(r.features), self.save_in_background)
        self.stop = preempt.StopRequest(self.run_dir, self.ctx)  # SIGUSR1 / SIGTERM / a STOP file: save, exit 75
        self.start = self.ckpt.load(self.engine, r.start_from)["step"] if r.start_from else 0
        if r.start_from:
            self.stream.resume(self.start // self.steps_per_batch, r.start_from.manifest.get(
                "samples", self.start // self.steps_per_batch * self.stream.global_batch))
        # who takes part; what a change of members (or of the ZeRO stage) cost (events.jsonl)
        events.record_start(self.run_dir, self.ctx, self.start, self.log, ds_config.zero_stage(r.ds_cfg))
        self.setup_peak = memory.peak_bytes()  # building, loading and partitioning, before any step
        memory.reset_peak()  # from here on, the training phase's peak (what the preflight models)
        self._build_metrics()
        self.hooks = self._hooks(r.start_from.manifest if r.start_from else None)
        self._say_start()

    def _convert_checkpoint(self) -> None:
        r = self.resolved
        resume.set_aside(r.start_from, self.ctx, self.log)  # damaged checkpoints newer than the chosen one
        if r.start_from and r.start_from.universal:
            resume.to_universal(r.start_from, self.ctx, self.log)
            if not r.start_from.into_plain:  # DeepSpeed's own universal loader (ZeRO-1/2/3, BF16 optimizer)
                r.ds_cfg.setdefault("checkpoint", {})["load_universal"] = True

    def _build_model(self):
        r, cfg = self.resolved, self.cfg
        base_weights = resume.materialize_init_from(r.init_from, self.run_dir, self.ctx, self.log) \
            if r.init_from else r.started_from
        # another run's weights, loaded as transformers loads any checkpoint
        self.model_source = self.recipe.model if not base_weights else replace(
            self.recipe.model, name_or_path=str(base_weights), from_scratch="false")
        model, _hf_ds_config = models.build(self.model_source, cfg, r.ds_cfg, r.tokenizer,
                                            components.load_kwargs(r.features, r.setup), r.layout.replicas == 1)
        frozen = vision.freeze(model, self.recipe.model)  # a vision-language model's tower and projector
        if frozen:
            self.log(frozen)
        self.params_total, params_local = models.parameter_counts(model)  # before the engine: what it held
        self.trained = components.trained_parameters(r.features)  # None: every parameter trains
        # a Mixture-of-Experts token runs top_k of each block's routed experts: only those count in its FLOPs
        # a vision-language model: the language model's FLOPs on every token, image tokens included (the vision
        # tower's per image are not counted yet: said in the log)
        self.flops_per_token = flops.flops_per_token(vision.text_config(r.model_config), self.params_total,
                                                     cfg.seq_len, self.trained,
                                                     moe.inactive_parameters(model) + vision.vision_parameters(model))
        checkpoint.write_run_files(self.run_dir, self.recipe, r.ds_cfg, model.config, r.tokenizer, self.ctx, {
            "parameters": self.params_total, "parameters_on_rank0_at_build": params_local,
            "trainable_parameters": self.trained or models.trainable_count(model),
            "activation_checkpointing": models.activation_checkpointing(model),
            "world_size": self.ctx.world_size, "data_parallel": r.layout.data_parallel,
            "data_cache": r.prepared.cache_path,
            # samples per optimizer step (DeepSpeed's train_batch_size counts a ring's ranks as data-parallel ones)
            "global_batch": r.global_batch,
            "train_sequences": len(r.prepared.train), "val_sequences": len(r.prepared.val or []),
            "data": r.prepared.summary, "chat_template": r.chat_template,
            "components": {f.name: f.describe() for f in r.features}, "flops_per_token": self.flops_per_token,
            "init_from": str(r.init_from) if r.init_from else None})
        if frozen and self.ctx.is_main:  # export reads the frozen tower from where it was loaded
            vision.record_frozen(model, local_or_hub(self.model_source.name_or_path), self.run_dir / "model_config")
        for feature in r.features:
            model = feature.convert(model, r.setup)
        return model

    def _build_engine(self, model) -> None:
        import deepspeed

        r = self.resolved
        scheduler = (lambda opt: schedule.make(opt, self.cfg)) if ds_config.uses_recipe_schedule(r.ds_cfg) else None
        ds_internals.defer_muon_compile()  # 1.7 s of a rank's start-up otherwise
        with ds_internals.keep_muon_tags():  # Muon's tags (components/muon.py) survive DeepSpeed's by-name ones
            self.engine, *_ = deepspeed.initialize(
                model=model, lr_scheduler=scheduler, config=r.ds_cfg,
                model_parameters=models.param_groups(model, self.cfg.weight_decay),
                mpu=ds_internals.model_parallel_unit(r.layout))
        # the layout with DeepSpeed's process groups, our rank arithmetic checked against them
        self.layout = ds_internals.bind_groups(self.engine, r.layout)
        ds_internals.record_fp32_grad_norm(self.engine)  # ZeRO-0 in fp32 logs its grad_norm too
        self.engine.train()  # from_pretrained returns the model in eval mode: dropout was off for the whole run
        self.setup = replace(r.setup, layout=self.layout)  # what the components see from here on
        for feature in r.features:
            feature.attach(self.engine, self.setup)

    def _build_data(self) -> None:
        r, cfg = self.resolved, self.cfg
        # the objective's work before the first step (preference: the reference model's log-probs)
        self.train_data, self.val_data = self.objective.before_training(
            self.engine, [r.prepared.train, r.prepared.val], self.setup, r.prepared.cache_path,
            weights_fingerprint(self.model_source.name_or_path))
        self.stream = data.TrainStream(self.train_data, cfg.micro_batch_size, cfg.grad_accum_steps, self.layout,
                                       cfg.seed, pin_memory=self.engine.device.type == "cuda")
        self.val = data.eval_batches(self.val_data, cfg.micro_batch_size, self.layout, self.recipe.eval.max_batches) \
            if self.val_data is not None else []
        eval_note = data.amount.eval_note(r.prepared.val_rows, len(self.val_data or []), len(self.val),
                                          self.layout.data_parallel, cfg.seq_len)
        if eval_note:
            self.log(eval_note)

    def _build_metrics(self) -> None:
        engine, world, precision = self.engine, self.ctx.world_size, self.resolved.setup.precision
        self.metrics = Metrics(self.run_dir, self.recipe.log, self.ctx, self.start, self.cfg.max_steps,
                               {"recipe": self.recipe.to_dict(), "ds": self.resolved.ds_cfg},
                               self.flops_per_token, self.peak.flops * world,
                               lambda achieved: flops.record_achieved(engine.device, precision, achieved / world))

    def _hooks(self, manifest: dict | None) -> Hooks:
        """The step hooks in the order they run (hooks.py): the components' part of a step, the objective's own,
        then the checks; each with its state from the resumed checkpoint's `manifest` (None: a new run)."""
        r = self.resolved
        checks, in_step = health.for_run(self.recipe.fault, r.setup.precision, ds_config.zero_stage(r.ds_cfg),
                                         self.layout, self.run_dir, self.engine, self.metrics.message,
                                         self.locate_nonfinite)
        own = optional_part(self.objective, "step_hooks", lambda say: [])(self.metrics.message)
        hooks = Hooks([ComponentHooks(r.features), *own, *checks], in_step)
        hooks.load_state_dict(manifest)  # the gate's spike window and skip counts, the router watch's streak, ...
        return hooks

    def _say_start(self) -> None:
        r, cfg = self.resolved, self.cfg
        amount = data.amount.describe(cfg.max_steps // self.steps_per_batch, r.global_batch, len(r.prepared.train))
        self.metrics.message(f"data: {r.prepared.summary}; {amount}")
        self.metrics.message(
            f"{'resumed from ' + str(r.start_from.path) if r.start_from else 'starting'} at step {self.start}; "
            f"{'reused' if r.prepared.cache_hit else 'wrote'} tokenized data {r.prepared.cache_path}; "
            f"MFU = tokens/s x {self.flops_per_token / 1e6:,.1f} MFLOP/token / ({self.ctx.world_size} x "
            f"{self.peak.flops / 1e12:,.3g} TFLOP/s, {self.peak.source})"
            + ("; the language model's FLOPs on every token, image tokens included, not the vision tower's"
               if vision.is_vision(r.model_config) else ""))

    # ---- the run's state besides DeepSpeed's: one contract for what a checkpoint's manifest keeps
    def state_dict(self, step: int) -> dict:
        """What a checkpoint of `step` records besides the engine's and the components' files. The keys are the
        manifests' since before the trainer existed, so older checkpoints load (load_state_dict reads them)."""
        return {"global_batch": self.stream.global_batch,
                "samples": step // self.steps_per_batch * self.stream.global_batch + self.stream.offset,
                "data_parallel": self.layout.data_parallel, "sequence_parallel": self.layout.sequence_parallel,
                "context_parallel": self.layout.context_parallel, "replicas": self.layout.replicas,
                "expert_parallel": self.layout.expert_parallel,
                "run": self.resolved.identity, "zero_stage": ds_config.zero_stage(self.resolved.ds_cfg),
                **self.hooks.state_dict()}  # the gate's spike window and skip counts ("health")

    # ---- fit
    def evaluation(self, step: int) -> None:
        with components.evaluated(self.resolved.features):  # DiLoCo streaming: the shared weights
            self.metrics.evaluation(step, *evaluate(self.engine, self.val, self.layout, self.objective))

    def locate_nonfinite(self, step: int) -> str | None:
        """The first non-finite step re-run with hooks on every module: the module it began in (every rank)."""
        return health.locate(self.engine, self.stream.micro_batches((step - 1) // self.steps_per_batch),
                             self.objective, self.layout, step)

    def fit(self) -> None:
        cfg, engine, hooks, metrics, watchdog = self.cfg, self.engine, self.hooks, self.metrics, self.watchdog
        if self.start == 0 and self.val:
            self.evaluation(0)
        self.counter = comm_counter.CommCounter().start()  # bytes sent and time waited in collectives, every step
        watchdog.arm()
        self.last = cfg.exit_at_step or cfg.max_steps
        for step in range(self.start + 1, self.last + 1):
            faults.point("step", self.ctx.rank, step)
            began, lr, comm = time.perf_counter(), engine.get_lr()[0], self.counter.snapshot()
            hooks.before_step(step)
            loss, counts, tokens, columns = self._step(step)
            hooks.after_update(step, metrics.message)  # a step's own work (DiLoCo's outer step) counts in its time
            seconds, spent = time.perf_counter() - began, self.counter.since(comm)
            result = StepResult(step, loss, _as_float(engine.get_global_grad_norm()), seconds, spent["comm_s"],
                                columns)
            hooks.after_step(result)
            metrics.step(step, loss, lr, result.columns.pop("grad_norm", result.grad_norm), tokens,
                         int(counts["label_tokens"]), seconds, spent, result.columns)
            watchdog.progress()
            if self.val and (step == cfg.max_steps or (self.recipe.eval.every and step % self.recipe.eval.every == 0)):
                self.evaluation(step)
                watchdog.progress()
            if step % self.steps_per_batch:  # inside a rollout batch (RL): saves and stops wait for its last step
                continue
            if self._save_or_stop(step):
                self.last = step
                break

    def _step(self, step: int):
        micro_batches = self.stream.micro_batches((step - 1) // self.steps_per_batch)
        try:
            return train_step(self.engine, micro_batches, self.layout, self.objective, self.ckpt.before_update,
                              step, self.hooks.in_step)
        except UserError as error:  # bad data every rank met in this step (a reward function's): the save in
            if getattr(error, "every_rank", False):  # flight, the last good state, is finished before leaving
                self.ckpt.finish(step - 1, self.metrics.message)
            raise

    def _save_or_stop(self, step: int) -> bool:
        """A checkpoint when one is due; True when the run stops here (a hook's reason, or an agreed stop
        request: the same on every rank)."""
        ckpt, say = self.ckpt, self.metrics.message
        ckpt.poll(step, self.engine.device, say)  # a background save whose files are all written is published
        ckpt.choose_interval(self.ctx.world_size // env.ranks_per_node(), self.recipe.fault.mtbf_hours,
                             self.engine.device, say)  # checkpoint.every=auto, once the first save's stall is known
        if not self.hooks.stopping and ckpt.due(step, self.last) and self.hooks.before_save(step):
            ckpt.save(self.engine, step, self.state_dict(step), wait=step == self.last, say=say)  # last: no copy
            self.watchdog.progress()
        return bool(self.hooks.stopping) or self.stop.agreed(step, self.engine.device)

    # ---- finish
    def finish(self) -> int:
        start, last, say = self.start, self.last, self.metrics.message
        self.counter.stop()
        self.hooks.close()
        stopper = self.hooks.stopping
        if not self.hooks.before_save(last):  # a non-finite update applied, or SDC: these weights are not kept
            self.ckpt.finish(last, say, last=True)  # an earlier save in flight held a state checked good
            final = None
        else:
            final = self.ckpt.save(self.engine, max(start, last), self.state_dict(max(start, last)), say=say)
        self.watchdog.close()  # past the last collective: ranks may now leave at different times
        outcome = self._outcome(final, stopper)
        memory.record(self.run_dir / "memory.json", self.ctx, self.baseline_memory, self.setup_peak,
                      lambda: memory.estimate(self.resolved.model_config, self.params_total, self.recipe,
                                              self.resolved.ds_cfg, self.layout, self.trained))
        self.metrics.close(outcome)
        return stopper.exit_code if stopper else preempt.EXIT_CODE if self.stop.stopped_at else EXIT_OK

    def _outcome(self, final, stopper) -> dict:
        """summary.json's status, what to do next, and the export at the end of a finished run."""
        cfg, last, say, run_dir = self.cfg, self.last, self.metrics.message, self.run_dir
        resume_hint = f"run the same command again (--resume auto) to continue from {final and final.name}"
        outcome = {"status": "finished", "max_steps": cfg.max_steps, "checkpoint": final and str(final),
                   "export": None, "next": None, "train_sequences": len(self.resolved.prepared.train),
                   "epochs": round(data.amount.epochs(max(self.start, last), self.resolved.global_batch,
                                                      len(self.resolved.prepared.train)), 3),
                   "saves": {"background": self.save_in_background,
                             "every": self.ckpt.every or self.recipe.checkpoint.every,
                             "stall_s": self.ckpt.stalls, "write_s": self.ckpt.writes},
                   "health": self.hooks.summary()}
        if stopper:
            outcome.update(status=f"stopped ({stopper.why})", next=stopper.advice(last))
            events.record_stop(run_dir, self.ctx, last, stopper.why)
        elif self.stop.stopped_at:
            say(f"stopped at step {last} ({self.stop.reason}); checkpoint {final.name} saved; "
                f"run again with --resume auto to continue")
            outcome.update(status=f"stopped ({self.stop.reason})", next=resume_hint)
            events.record_stop(run_dir, self.ctx, last, self.stop.reason)
        elif last < cfg.max_steps:
            say(f"stopped at step {last} (train.exit_at_step); run again with --resume auto to continue")
            outcome.update(status="stopped (train.exit_at_step)", next=resume_hint)
            events.record_stop(run_dir, self.ctx, last, "train.exit_at_step")
        elif self.recipe.checkpoint.export_hf and not (self.start == last and (run_dir / "hf").exists()):
            export.at_end(final, run_dir / "hf", self.resolved.ds_cfg, self.ctx, say)
        if last >= cfg.max_steps and (run_dir / "hf").exists():
            loads = vision.model_class(self.resolved.model_config).__name__  # an image-text-to-text model's own
            outcome.update(export=str(run_dir / "hf"), next=f"{loads}.from_pretrained('{run_dir / 'hf'}'),"
                           f" or train on from it: --model.name_or_path={run_dir / 'hf'}")
        return outcome


def log_on_main(ctx):
    """What the build phase says: rank 0's stderr, at once."""
    return (lambda text: print(text, file=sys.stderr, flush=True)) if ctx.is_main else (lambda text: None)


def _as_float(value) -> float | None:
    return None if value is None else float(value)
