"""dstrain/objectives/rl_math.py against TRL 1.16: GRPOTrainer._compute_loss run on the same log-probabilities,
advantages and masks (its own code, its model call replaced by the tensors), and advantages worked by hand."""
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dstrain.objectives import rl_math

pytest.importorskip("trl")


def _trl_loss(logps, old, ref, advantages, mask, loss_type, beta, eps_low, eps_high, max_len, bias_kl=True):
    """TRL's GRPOTrainer._compute_loss with one process, no gradient accumulation, one generation step."""
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                  reduce=lambda x, reduction: x, gather_for_metrics=lambda x: x)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, steps_per_generation=1),
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=max_len,
        accelerator=accelerator, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)})
    batch, length = logps.shape
    inputs = {"prompt_ids": torch.zeros(batch, 2, dtype=torch.long), "prompt_mask": torch.ones(batch, 2),
              "completion_ids": torch.zeros(batch, length, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


@pytest.mark.parametrize("loss_type", rl_math.LOSS_TYPES)
@pytest.mark.parametrize("beta,iterations,bias_kl", [(0.0, 1, True), (0.04, 1, True), (0.04, 1, False),
                                                     (0.04, 2, True), (0.04, 2, False)])
def test_policy_loss_and_gradient_equal_trls(loss_type, beta, iterations, bias_kl):
    g = torch.Generator().manual_seed(0)
    batch, length, max_len = 6, 7, 9
    base = -torch.rand(batch, length, generator=g) * 3
    # num_iterations > 1: the sampling policy's log-probs differ from the current ones (ratios clip both ways)
    old = base + 0.4 * torch.randn(batch, length, generator=g) if iterations > 1 else None
    ref = base + 0.3 * torch.randn(batch, length, generator=g) if beta else None
    advantages = torch.randn(batch, generator=g)
    mask = (torch.arange(length) < torch.tensor([7, 3, 5, 1, 6, 7]).unsqueeze(1)).float()
    ours_in, trl_in = base.clone().requires_grad_(), base.clone().requires_grad_()

    loss_sum, divisor, sums = rl_math.policy_loss(ours_in, old, advantages, mask, loss_type, 0.2, 0.28, beta, ref,
                                                  max_len, bias_kl)
    ours = loss_sum / divisor
    theirs, logged = _trl_loss(trl_in, old, ref, advantages, mask, loss_type, beta, 0.2, 0.28, max_len, bias_kl)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(ours_in.grad, trl_in.grad, rtol=1e-6, atol=1e-7)
    # the metrics' sums give TRL's logged means
    tokens = sums["tokens"]
    assert (sums["clip_low"] / tokens).item() == pytest.approx(logged["clip_ratio/low_mean"][0])
    assert (sums["clip_high"] / tokens).item() == pytest.approx(logged["clip_ratio/high_mean"][0])
    if beta:
        assert (sums["kl"] / tokens).item() == pytest.approx(logged["kl"][0], rel=1e-6)
    if iterations > 1:  # the test means something only if some ratios were clipped
        assert sums["clip_low"] + sums["clip_high"] > 0


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two prompts, G = 4
    std = torch.tensor([1.0, 1.0, 0.0, 0.0]).std().item()  # group 1: mean 0.5, sample std 0.5774
    got = rl_math.advantages(rewards, 4, "group")
    want = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2
    assert got[:4].tolist() == pytest.approx([want[0], want[1], want[1], want[0]])
    assert got[4:].tolist() == [0.0] * 4  # equal rewards: no signal
    assert rl_math.advantages(rewards, 4, "none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    batch_std = rewards.std().item()
    assert rl_math.advantages(rewards, 4, "batch")[0].item() == pytest.approx(0.5 / (batch_std + 1e-4))


def test_unscorable_completions_get_no_advantage_and_no_say_in_the_baseline():
    nan = float("nan")
    rewards = torch.tensor([1.0, nan, 0.0, 1.0])  # G = 4: mean and std over the three scorable ones
    got = rl_math.advantages(rewards, 4, "none")
    assert got.tolist() == pytest.approx([1 / 3, 0.0, -2 / 3, 1 / 3])
    one = rl_math.advantages(torch.tensor([nan, nan, 3.0, nan]), 4, "group")  # one scorable: std NaN -> 0
    assert one.tolist() == [0.0] * 4


def test_rloo_leave_one_out_baseline_by_hand():
    nan = float("nan")
    got = rl_math.rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0, nan, 4.0]), 3)
    # group 1: 3 - (1+2)/2, 1 - (3+2)/2, 2 - (3+1)/2; group 2: 0 - 4/1, unscorable 0, 4 - 0/1
    assert got.tolist() == pytest.approx([1.5, -1.5, 0.0, -4.0, 0.0, 4.0])
    normalized = rl_math.rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0, 1.0, 4.0]), 3, normalize=True)
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert normalized.std().item() == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(ValueError, match="at least 2"):
        rl_math.rloo_advantages(torch.tensor([1.0]), 1)


def test_rloo_sequence_loss_clips_whole_sequences():
    """RLOO's ratio is exp(summed log-prob difference) per sequence: a sequence whose tokens each moved a little
    can be clipped as a whole; the loss is the mean over sequences of -min(r A, clip(r) A)."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    logps = torch.tensor([[0.1, 0.1, 5.0], [-0.05, 0.0, 0.0]], requires_grad=True)  # masked token ignored
    adv = torch.tensor([1.0, -1.0])
    summed, divisor, sums = rl_math.sequence_policy_loss(logps, old, adv, mask, 0.2, 0.2)
    r0, r1 = torch.exp(torch.tensor(0.2)), torch.exp(torch.tensor(-0.05))
    assert float(summed) == pytest.approx(float(-min(r0, 1.2) * 1.0 - min(-r1, -max(r1, 0.8))), rel=1e-6)
    assert float(divisor) == 2 and float(sums["clip_high"]) == 1 and float(sums["clip_low"]) == 0
    summed.backward()
    assert torch.count_nonzero(logps.grad[0]) == 0  # clipped: no gradient
    assert torch.allclose(logps.grad[1], torch.tensor([r1, r1, r1]))  # -(-1) x r x dlogp for each unmasked token


def test_a_rollout_engines_answer_is_checked():
    """An engine of the user's (rl.rollout_engine) answering too few rows or too many tokens is one line."""
    from dstrain.config import RLSection
    from dstrain.errors import UserError
    from dstrain.objectives.rl import RL
    rl = RL(RLSection(reward_funcs=["exact_answer"], max_completion_length=3))
    rl.engine_name = "mine.py:Engine"
    assert rl._check([torch.tensor([4, 5]), [6]], 2) == [[4, 5], [6]]
    with pytest.raises(UserError, match="returned 1 completions for 2 prompts"):
        rl._check([[4]], 2)
    with pytest.raises(UserError, match="returned 4 tokens for prompt row 1; rl.max_completion_length is 3"):
        rl._check([[4], [5, 6, 7, 8]], 2)


def test_a_teacher_must_share_the_students_vocabulary(tmp_path):
    """rl.teacher is checked before anything is built: a config without weights, another vocabulary size, or the
    same size with other tokens are one line each; the student's own tokenizer and weights pass."""
    import json
    from types import SimpleNamespace

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dstrain.config import RLSection
    from dstrain.errors import UserError
    from dstrain.objectives.rl import RL
    tokenizer = AutoTokenizer.from_pretrained("recipes/tiny/model")
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    setup = SimpleNamespace(recipe=SimpleNamespace(train=SimpleNamespace(seq_len=32),
                                                   model=SimpleNamespace(trust_remote_code=False)),
                            model_config=SimpleNamespace(vocab_size=len(tokenizer)))

    def check(teacher_dir):
        rl = RL(RLSection(teacher=str(teacher_dir)))
        rl.tokenizer = tokenizer
        rl._check_teacher(setup)

    bare = tmp_path / "bare"
    LlamaConfig(vocab_size=len(tokenizer), **small).save_pretrained(bare)
    with pytest.raises(UserError, match="has a config but no weights: a teacher must be a trained model"):
        check(bare)
    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer) + 24, **small)).save_pretrained(other)
    with pytest.raises(UserError, match=f"has a vocabulary of {len(tokenizer) + 24}, the student {len(tokenizer)}"):
        check(other)
    same = tmp_path / "same"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **small)).save_pretrained(same)
    tokenizer.save_pretrained(same)
    check(same)
    vocab = tokenizer.get_vocab()
    swapped = AutoTokenizer.from_pretrained("recipes/tiny/model")
    a, b = sorted(vocab, key=vocab.get)[10:12]  # two ordinary tokens trade ids: same size, other tokens
    state = json.loads(swapped.backend_tokenizer.to_str())
    state["model"]["vocab"][a], state["model"]["vocab"][b] = vocab[b], vocab[a]
    swapped._tokenizer = Tokenizer.from_str(json.dumps(state))
    swapped.save_pretrained(same)
    with pytest.raises(UserError, match="has a different tokenizer from the student's"):
        check(same)


@pytest.mark.parametrize("override,name", [("--train.max_steps=5", "train.max_steps=5"),
                                           ("--checkpoint.every=3", "checkpoint.every=3"),
                                           ("--train.exit_at_step=3", "train.exit_at_step=3")])
def test_num_iterations_needs_steps_that_end_a_rollout_batch(override, name):
    """rl.num_iterations=2: a run saves and stops only at a rollout batch's end, so the steps that end or save a
    run must be multiples of it; said in one line before anything is built."""
    from types import SimpleNamespace

    from dstrain.config import load_recipe, parse_overrides
    from dstrain.errors import UserError
    from dstrain.objectives.rl import RL
    from dstrain.parallel.layout import Layout
    recipe = load_recipe("tiny/grpo.yaml", parse_overrides(["--rl.num_iterations=2", "--train.max_steps=6",
                                                            "--checkpoint.every=2", override]))
    with pytest.raises(UserError, match=f"{name} is not a multiple of rl.num_iterations=2"):
        RL(recipe.rl).validate(SimpleNamespace(recipe=recipe, layout=Layout(2)))


@pytest.mark.parametrize("config, named", [("cp2_zero3.json", "ring attention (context_parallel_size)"),
                                           ("sp2_zero3.json", "Ulysses sequence parallelism"),
                                           ("tp2_zero1.json", "tensor parallelism")])
def test_rl_names_the_layout_it_cannot_run_on(config, named):
    """Issue 69: GRPO with cp2_zero3.json was told of pipelines, tensor and sequence parallelism, not of the ring."""
    from types import SimpleNamespace

    from dstrain.config import load_recipe
    from dstrain.errors import UserError
    from dstrain.objectives.rl import RL
    from dstrain.parallel import ds_config
    from dstrain.parallel.layout import Layout
    recipe = load_recipe("tiny/grpo.yaml")
    recipe.ds_config = config
    layout = Layout.from_ds_config(ds_config.load(config, {}), 2)
    with pytest.raises(UserError, match=rf"runs on ZeRO configs only so far, and {config} sets {re.escape(named)}; "
                                        r"use zero2.json or zero3.json"):
        RL(recipe.rl).validate(SimpleNamespace(recipe=recipe, layout=layout))


def test_a_missing_teacher_is_named_as_rl_teacher(tmp_path):
    """Issue 69: a missing rl.teacher directory was told to check model.name_or_path / model.tokenizer."""
    from types import SimpleNamespace

    from dstrain.config import load_recipe, parse_overrides
    from dstrain.errors import UserError
    from dstrain.objectives.rl import RL
    recipe = load_recipe("tiny/distill.yaml", parse_overrides([f"--rl.teacher={tmp_path}/no/such/teacher"]))
    rl = RL(recipe.rl)
    with pytest.raises(UserError, match="no such directory .*; check the path in rl.teacher") as caught:
        rl._check_teacher(SimpleNamespace(recipe=recipe))
    assert "model.name_or_path" not in str(caught.value)
