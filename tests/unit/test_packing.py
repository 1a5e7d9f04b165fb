"""data.packing against padding, in one process on a tiny Llama: the same SFT examples packed several to a row
(position_ids restarting, no attention across examples) and padded one to a row give the same per-example
losses and, summed over a step, the same gradients, up to fp32 summation order. A mask that let examples see
each other moves the losses by ~1e-3 (test_attention_across_examples_would_be_caught)."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dstrain import chat_templates, data
from dstrain.components.sequence_parallel import document_mask, packed_sdpa
from dstrain.config import DataConfig, ModelConfig
from dstrain.model import load_tokenizer
from dstrain.objectives.causal_lm import model_inputs

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 64
RTOL = 1e-5  # fp32 summation order: per-example losses measured within ~1e-7, the step's sum equal
GRAD_RTOL = 2e-6


@pytest.fixture(scope="module")
def rows():
    tok = load_tokenizer(ModelConfig(name_or_path=str(ROOT / "recipes/tiny/model")))
    chat_templates.apply(None, tok, lambda _: None)
    raw = data.load_raw(DataConfig(path=str(ROOT / "data/tiny_sft"), format="prompt_response"))["train"]
    raw = raw.select(range(24))
    padded, _ = data.tokenize(raw, DataConfig(path="data/tiny_sft", format="prompt_response"), tok, SEQ_LEN)
    packed, stats = data.tokenize(raw, DataConfig(path="data/tiny_sft", format="prompt_response", packing=True), tok,
                                  SEQ_LEN)
    assert stats["packed_examples"] == len(padded) == 24 and stats["sequences"] < 24 / 2  # > 2 examples a row
    return padded.with_format("torch")[:], packed.with_format("torch")[:]


@pytest.fixture(scope="module")
def model():
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def token_losses(model, batch):
    """Per-position next-token losses [rows, seq_len - 1] (0 where no label) and the gradient of their sum."""
    model.zero_grad()
    logits = model(**model_inputs(batch), use_cache=False).logits  # what objectives.causal_lm.loss_sum calls
    losses = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), batch["labels"][:, 1:],
                             ignore_index=data.IGNORE_INDEX, reduction="none")
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def per_example(losses, batch):
    """Each example's summed loss, in data order: a new example wherever position_ids restart at 0."""
    out = []
    for row in range(losses.shape[0]):
        positions = batch["position_ids"][row] if "position_ids" in batch else torch.arange(SEQ_LEN)
        real = batch["attention_mask"][row].bool()
        for t in range(SEQ_LEN):
            if real[t] and positions[t] == 0:
                out.append(0.0)
            if t and real[t]:
                out[-1] += losses[row, t - 1].item()
    return out


def test_packed_step_equals_padded_step(model, rows):
    padded, packed = rows
    pad_losses, pad_grads = token_losses(model, padded)
    pack_losses, pack_grads = token_losses(model, packed)
    want = per_example(pad_losses, padded)
    assert len(want) == 24
    assert sorted(per_example(pack_losses, packed)) == pytest.approx(sorted(want), rel=RTOL)
    assert pack_losses.sum().item() == pytest.approx(pad_losses.sum().item(), rel=RTOL)
    for name, grad in pad_grads.items():  # measured up to 2.1e-7 of each gradient's norm
        assert (pack_grads[name] - grad).norm() <= GRAD_RTOL * grad.norm(), name


def test_attention_across_examples_would_be_caught(model, rows):
    """The same packed rows with plain causal attention (what transformers does with a cache, or Ulysses with
    sdpa and no wrapper): the losses leave the tolerance by far."""
    padded, packed = rows
    want = token_losses(model, padded)[0].sum().item()
    logits = model(input_ids=packed["input_ids"], use_cache=False).logits  # no position_ids: one long document
    leaky = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), packed["labels"][:, 1:],
                            ignore_index=data.IGNORE_INDEX, reduction="sum").item()
    assert abs(leaky - want) / want > 100 * RTOL


def test_document_mask_is_transformers_packed_mask():
    """The mask packed_sdpa builds under Ulysses (which drops the model's own) is the one transformers derives
    from position_ids when it has no cache."""
    from transformers import masking_utils
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config._attn_implementation = "sdpa"
    theirs = masking_utils.create_causal_mask(config=config, inputs_embeds=torch.zeros(2, 8, 4), attention_mask=None,
                                              past_key_values=None, position_ids=positions)
    assert torch.equal(document_mask(positions), theirs)
    assert document_mask(torch.arange(8).expand(2, 8)) is None  # unpacked rows: sdpa's own causal path


def test_packed_sdpa_matches_the_model_on_packed_rows(model, rows):
    _, packed = rows
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    want = model(**model_inputs(packed), use_cache=False).logits
    seen = []

    def dropping(module, query, key, value, attention_mask, *args, **kwargs):  # what Ulysses hands the core
        seen.append(attention_mask is not None)
        return wrapped(module, query, key, value, None, *args, **kwargs)
    wrapped = packed_sdpa(original)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = dropping
    try:
        got = model(**model_inputs(packed), use_cache=False).logits
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    assert seen and all(seen)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ulysses_is_registered_on_the_packed_sdpa(model, rows, monkeypatch):
    """Issue 29: registering Ulysses without the packed-sdpa wrapper passed every unit test (only the slowest 4-rank
    e2e caught it). The attention that SequenceParallel.convert hands Ulysses, called as Ulysses calls it (the
    model's mask dropped), must still keep packed documents apart."""
    from types import SimpleNamespace

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dstrain.components.sequence_parallel import SequenceParallel

    _, packed = rows
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    want = model(**model_inputs(packed), use_cache=False).logits
    handed = {}

    def register(model_name_or_path, core_attn_implementation, **kwargs):  # Ulysses keeps the function it finds
        handed["core"] = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    monkeypatch.setattr(UlyssesSPAttentionHF, "register_with_transformers", staticmethod(register))
    setup = SimpleNamespace(recipe=SimpleNamespace(train=SimpleNamespace(micro_batch_size=4, seq_len=SEQ_LEN)),
                            log=lambda text: None)
    try:
        SequenceParallel(2).convert(model, setup)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, mask, *a, **kw: handed["core"](module, q, k, v, None,
                                                                                                 *a, **kw)
        got = model(**model_inputs(packed), use_cache=False).logits
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
