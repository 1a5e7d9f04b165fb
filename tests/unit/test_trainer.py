"""The trainer's seams in-process, no launch: the step hooks' order and protocol, the resume contract's keys, and
three decisions the launched tests reach only through whole runs (a world change keeps the checkpoint's global
batch, a background save is published only when every rank's writer is done, a stop is agreed by every rank)."""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain.trainer.hooks import ComponentHooks, Hooks, StepHook, StepResult

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """A hook that writes down every call, with its own answers."""

    def __init__(self, name: str, calls: list, safe: bool = True, state=None):
        self.name, self.calls, self.safe, self.state, self.stopping = name, calls, safe, state, False

    def before_step(self, step):
        self.calls.append((self.name, "before_step", step))

    def after_update(self, step, say):
        self.calls.append((self.name, "after_update", step))

    def after_step(self, result):
        self.calls.append((self.name, "after_step", result.step))
        result.columns[self.name] = result.loss

    def before_save(self, step):
        self.calls.append((self.name, "before_save", step))
        return self.safe

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.calls.append((self.name, "load_state_dict", state))

    def close(self):
        self.calls.append((self.name, "close", None))

    def summary(self):
        return {f"{self.name}_seen": len(self.calls), "check_s": 0.5}


def test_hooks_run_in_list_order_and_every_hook_is_asked_before_a_save():
    calls: list = []
    first, second = Recorder("a", calls, safe=False), Recorder("b", calls, state={"kept": 1})
    hooks = Hooks([first, second])
    hooks.before_step(3)
    hooks.after_update(3, print)
    result = StepResult(3, 2.5, 1.0, 0.1, 0.01, {"objective": 7})
    hooks.after_step(result)
    assert result.columns == {"objective": 7, "a": 2.5, "b": 2.5}  # the objective's columns first, then the hooks'
    assert hooks.before_save(3) is False  # one hook's veto; the second is asked all the same (its collectives)
    assert [c[:2] for c in calls] == [("a", "before_step"), ("b", "before_step"), ("a", "after_update"),
                                      ("b", "after_update"), ("a", "after_step"), ("b", "after_step"),
                                      ("a", "before_save"), ("b", "before_save")]
    assert hooks.state_dict() == {"b": {"kept": 1}}  # by name; a hook without state writes nothing
    hooks.load_state_dict({"b": {"kept": 1}})  # an older checkpoint without a hook's key hands it None
    assert calls[-2:] == [("a", "load_state_dict", None), ("b", "load_state_dict", {"kept": 1})]
    assert hooks.summary()["check_s"] == 1.0 and hooks.stopping is None
    second.stopping = True
    assert hooks.stopping is second


def test_the_runs_checks_and_the_components_implement_the_protocol(tmp_path, monkeypatch):
    from dstrain.config import FaultConfig
    from dstrain.parallel.layout import Layout
    from dstrain.run import health

    monkeypatch.setattr(health, "all_gather_objects", lambda value: [value])
    engine = SimpleNamespace(skipped_steps=0, device=torch.device("cpu"), optimizer=None)
    monkeypatch.setattr(health.ds_internals, "gate_optimizer_step", lambda engine, decide: lambda: None)
    checks, in_step = health.for_run(FaultConfig(), "fp32", 2, Layout(1), tmp_path, engine, print, lambda s: None)
    assert [type(c).__name__ for c in checks] == ["Stragglers", "StepHealth"] and in_step is checks[-1]
    for hook in [ComponentHooks([]), *checks]:
        assert isinstance(hook, StepHook), hook
    assert in_step.name == "health"  # the manifest key checkpoints have always kept the gate's state under


def test_the_resume_contract_keeps_the_manifest_keys_checkpoints_already_have():
    """Trainer.state_dict is what a checkpoint's manifest keeps besides DeepSpeed's state; these keys are the ones
    checkpoints written before the trainer existed carry (resume.adapt_to_world, check_same_run, the stream)."""
    from dstrain.parallel.layout import Layout
    from dstrain.trainer.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.steps_per_batch = 2
    trainer.stream = SimpleNamespace(global_batch=8, offset=3)
    trainer.layout = Layout(2)
    trainer.resolved = SimpleNamespace(identity={"recipe": "x"}, ds_cfg={"zero_optimization": {"stage": 3}})
    trainer.hooks = Hooks([ComponentHooks([]), Recorder("health", [], state={"losses": [1.0]})])
    state = trainer.state_dict(10)
    assert state == {"global_batch": 8, "samples": 10 // 2 * 8 + 3, "data_parallel": 2, "sequence_parallel": 1,
                     "context_parallel": 1, "replicas": 1, "expert_parallel": 0, "run": {"recipe": "x"},
                     "zero_stage": 3,
                     "health": {"losses": [1.0]}}


def test_a_world_change_keeps_the_checkpoints_global_batch_not_the_recipes(tmp_path):
    """3 ranks resuming a 2-rank checkpoint of global batch 24 (micro-batch 2): accumulation 4, whatever the
    recipe's grad_accum_steps says (1 here: its own global batch would be 6)."""
    from dstrain.config import TrainConfig
    from dstrain.parallel.layout import Layout
    from dstrain.run.checkpoint import Resume
    from dstrain.run.resume import adapt_to_world

    path = tmp_path / "step_00000005"
    path.mkdir()
    ckpt = Resume(path, {"global_batch": 24, "data_parallel": 2, "world_size": 2, "sequence_parallel": 1})
    said: list = []
    train, _ = adapt_to_world(ckpt, TrainConfig(micro_batch_size=2, grad_accum_steps=1), Layout(3), said.append)
    assert train.grad_accum_steps == 4
    assert said == ["world changed from 2 to 3 data-parallel ranks: grad_accum_steps 1 -> 4 keeps the global batch "
                    "at 24"]


def test_a_background_save_is_published_only_when_every_ranks_writer_is_done(monkeypatch):
    from dstrain.run import checkpoint

    published: list = []
    ckpt = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)
    ckpt.ctx = SimpleNamespace(world_size=2, rank=0)
    done = threading.Event()
    done.set()  # this rank's writer has finished; the other's has not
    ckpt.in_flight = SimpleNamespace(job=SimpleNamespace(done=done))
    ckpt._complete = lambda step, say, last: published.append(step)
    others = {"done": 0.0}
    monkeypatch.setattr(checkpoint, "all_reduce_sum", lambda values, device: [values[0] + others["done"]])
    ckpt.poll(7, torch.device("cpu"), print)
    assert published == []
    others["done"] = 1.0
    ckpt.poll(8, torch.device("cpu"), print)
    assert published == [8]


@pytest.mark.parametrize("signalled", [True, False])
def test_a_stop_is_agreed_by_every_rank_when_any_one_was_signalled(tmp_path, monkeypatch, signalled):
    """The signalled rank and the others stop at the same step (a rank stopping alone would leave its peers in the
    next step's collectives)."""
    from dstrain.parallel import dist
    from dstrain.run import preempt

    monkeypatch.setattr(preempt, "LAUNCHERS", [])
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # StopRequest's handlers: not in pytest
    stop = preempt.StopRequest(tmp_path, SimpleNamespace(is_main=False))
    if signalled:
        stop.reason = "SIGTERM"
    other_rank = 0.0 if signalled else 1.0  # the vote of the rank that was signalled, when it was not this one
    monkeypatch.setattr(dist, "all_reduce_sum", lambda values, device: [values[0] + other_rank])
    assert stop.agreed(12, torch.device("cpu")) is True
    assert stop.stopped_at == 12
    assert stop.reason == ("SIGTERM" if signalled else "another rank was signalled")


def test_a_resumed_run_gives_every_step_hook_the_state_its_checkpoint_kept(tmp_path, monkeypatch):
    """The resume contract end to end in-process: the hooks a run builds (the trainer's own _hooks: the components,
    the objective's router watch, the slow-rank check, the NaN/spike gate) write their state into the manifest
    (Trainer.state_dict), and a second trainer built from that manifest starts with the same state. Issue 83: with
    the restore left out only a launched resume noticed (a spike window and a collapse streak that began again)."""
    from dstrain import moe
    from dstrain.config import FaultConfig
    from dstrain.parallel.layout import Layout
    from dstrain.run import health
    from dstrain.trainer.trainer import Trainer

    monkeypatch.setattr(health, "all_gather_objects", lambda value: [value])
    monkeypatch.setattr(health.ds_internals, "gate_optimizer_step", lambda engine, decide: lambda: None)

    def trainer() -> Trainer:
        t = Trainer.__new__(Trainer)
        said = []
        t.resolved = SimpleNamespace(setup=SimpleNamespace(precision="fp32"), features=[], identity={"recipe": "x"},
                                     ds_cfg={"zero_optimization": {"stage": 2}})
        t.recipe = SimpleNamespace(fault=FaultConfig())
        t.layout, t.run_dir, t.steps_per_batch = Layout(1), tmp_path, 1
        t.engine = SimpleNamespace(skipped_steps=0, device=torch.device("cpu"), optimizer=None)
        t.metrics = SimpleNamespace(message=said.append)
        t.locate_nonfinite = lambda step: None
        t.objective = SimpleNamespace(step_hooks=lambda say: [moe.RouterWatch(4, 2, say, patience=20)])
        t.stream = SimpleNamespace(global_batch=4, offset=0)
        return t

    first = trainer()
    first.hooks = first._hooks(None)
    router, gate = first.hooks.hooks[1], first.hooks.hooks[-1]
    assert isinstance(router, moe.RouterWatch) and gate.name == "health"
    for step in range(1, 6):  # a routing streak under way and a spike window being filled
        result = StepResult(step, 5.0 - 0.1 * step, 1.0 + 0.01 * step, 0.1, 0.0,
                            {"expert_load_max": 1.9, "expert_load_cv": 0.4, "expert_load_worst_layer": 0})
        router.after_step(result)
        gate.after_step(result)
    saved = first.hooks.state_dict()
    assert saved["router"]["streak"] == 5 and len(saved["health"]["losses"]) == 5
    manifest = first.state_dict(5)
    resumed = trainer()
    resumed.hooks = resumed._hooks(manifest)
    assert resumed.hooks.state_dict() == saved
    assert trainer()._hooks(None).state_dict() != saved  # a new run starts empty: the comparison can fail


def _tiny_causal_lm():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def _eval_batches(rank: int) -> list[dict]:
    """Each rank's validation batches: different row counts and masked tokens, so a rank's own mean is not the
    global one."""
    g = torch.Generator().manual_seed(100 + rank)
    batches = []
    for rows, masked in ((2, 3 * rank), (1 + rank, 7)):
        ids = torch.randint(0, 64, (rows, 12), generator=g)
        labels = ids.clone()
        labels[:, :masked] = -100
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return batches


class _Engine(torch.nn.Module):
    """What evaluate() asks of DeepSpeed's engine: the module, eval()/train(), the device, a forward."""

    def __init__(self, module):
        super().__init__()
        self.module, self.device = module, torch.device("cpu")

    def forward(self, **kwargs):
        return self.module(**kwargs)


def _evaluate_rank(rank: int):
    from dstrain.objectives.causal_lm import CausalLM
    from dstrain.parallel.layout import Layout
    from dstrain.trainer.steps import evaluate

    objective = CausalLM()
    objective.router_aux, objective.counter = 0.0, None
    return evaluate(_Engine(_tiny_causal_lm()), _eval_batches(rank), Layout(2), objective)


def test_evaluation_is_the_token_mean_over_every_data_parallel_ranks_batches():
    """evaluate() on two gloo ranks (warm processes) holding different validation batches: both report the loss
    over all the label tokens of both ranks, computed here in one process from the same model. Issue 83: without
    its all-reduce each rank reported its own share and only a launched run's eval_loss noticed."""
    from tests import warm

    results = warm.run_ranks(_evaluate_rank, 2)
    model = _tiny_causal_lm().eval()
    total, tokens = 0.0, 0
    for rank in range(2):
        for batch in _eval_batches(rank):
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1),
                                                             ignore_index=-100, reduction="sum"))
            tokens += int((labels != -100).sum())
    assert [r[0] for r in results] == pytest.approx([total / tokens] * 2, rel=1e-6)
