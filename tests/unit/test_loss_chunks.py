"""train.loss_chunk_tokens: the fused, chunked head + cross-entropy against autograd through full logits."""
import copy

import pytest
import torch
import torch.nn.functional as F

from dstrain.components import chunked_loss as loss
from dstrain.data import IGNORE_INDEX
from dstrain.errors import UserError
from dstrain.objectives.causal_lm import loss_sum


def _reference(hidden, weight, bias, labels):
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_loss_and_gradients_equal_full_logits(chunk, with_bias):
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 37, 16, 50
    leaves = [torch.randn(tokens, hidden_size), torch.randn(vocab, hidden_size) * 0.3,
              torch.randn(vocab) * 0.1 if with_bias else None]
    labels = torch.randint(0, vocab, (tokens,))
    results = []
    for fn in (_reference, lambda h, w, b, y: loss.linear_cross_entropy_sum(h, w, b, y, chunk)):
        inputs = [t.clone().requires_grad_() if t is not None else None for t in leaves]
        total = fn(*inputs, labels)
        (total * 0.37).backward()  # a scaled loss, as train_step's engine.backward(summed * scale)
        results.append((total.detach(), [t.grad for t in inputs if t is not None]))
    (want, want_grads), (got, got_grads) = results
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone, same value
        torch.testing.assert_close(loss.linear_cross_entropy_sum(*leaves, labels, chunk), want, rtol=1e-6, atol=1e-5)


def test_bf16_close_to_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(300, 32) * 0.2).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 300, (64,))
    want = _reference(hidden, weight, None, labels)
    want.backward()
    want_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = loss.linear_cross_entropy_sum(hidden, weight, None, labels, 16)
    got.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
    for g, w in zip((hidden.grad, weight.grad), want_grads):  # bf16 rounding of the chunked sums
        assert (g.float() - w.float()).norm() / w.float().norm() < 1e-2


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


@pytest.mark.parametrize("make", [lambda: _llama(True), lambda: _llama(False), _gpt2], ids=["llama-tied", "llama",
                                                                                           "gpt2"])
def test_model_loss_and_every_gradient_equal_the_plain_path(make):
    """Masked labels (a prompt and padding that carry no loss), tied and untied heads: same summed loss and the
    same gradient for every parameter as the plain full-logits path; calls without labels are untouched."""
    plain = make()
    fused = copy.deepcopy(plain)
    loss.install(fused, 5, "fp32")
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 20))
    labels = ids.clone()
    labels[0, :8] = IGNORE_INDEX  # an SFT prompt
    labels[2, 15:] = IGNORE_INDEX  # padding
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    want, got = loss_sum(plain, batch), loss_sum(fused, batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    positions = loss.label_positions_of(labels)  # what train_step passes, found on the host
    assert positions.numel() == 3 * 19 - 8 - 4
    torch.testing.assert_close(loss_sum(fused, dict(batch, label_positions=positions)).detach(), want.detach(),
                               rtol=1e-6, atol=1e-5)
    (want * 0.1).backward()
    (got * 0.1).backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(loss_sum(fused, batch), want.detach(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_a_micro_batch_without_label_tokens_gives_zero_loss_and_gradient():
    model = _llama(False)
    loss.install(model, 4, "fp32")
    ids = torch.randint(0, 97, (2, 10))
    got = loss_sum(model, {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)})
    got.backward()
    assert float(got.detach()) == 0.0
    assert float(model.lm_head.weight.grad.abs().sum()) == 0.0


def test_refusals_name_the_fix():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(UserError, match=r"final_logit_softcapping=30.0\); set train.loss_chunk_tokens=0"):
        loss.install(gemma, 1024, "bf16")
    with pytest.raises(UserError, match="needs bf16 or fp32, not fp16"):
        loss.install(_llama(False), 1024, "fp16")
    from dstrain.config import load_recipe
    with pytest.raises(UserError, match="train.loss_chunk_tokens=-1 must be 0"):
        load_recipe(None, {"train": {"loss_chunk_tokens": -1}})


@pytest.mark.parametrize("chunk", [3, 8, 64])
def test_per_token_path_with_a_biased_head_gives_every_gradient_of_the_full_logits(chunk):
    """Issue 58's audit: the per-token path (preference training with train.loss_chunk_tokens reads each token's
    loss, then a non-linear function of their sums) got a biased head's (Phi-like) bias gradient wrong and no test
    saw it: only the summed path was checked with a bias. Here each token's loss gets its own upstream gradient.
    fp32 (the fused path's softmax is fp32 whatever the input): the audit's bias gradient was off by 2.6."""
    from dstrain.components.chunked_loss import linear_cross_entropy_tokens
    g = torch.Generator().manual_seed(0)
    tokens, width, vocab = 13, 8, 11
    hidden = torch.randn(tokens, width, generator=g, dtype=torch.float32)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float32) * 0.3
    bias = torch.randn(vocab, generator=g, dtype=torch.float32) * 0.5
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    upstream = torch.randn(tokens, generator=g, dtype=torch.float32)
    grads = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if fused:
            nll = linear_cross_entropy_tokens(*leaves, labels, chunk)
        else:
            nll = F.cross_entropy(F.linear(*leaves), labels, reduction="none")
        torch.sigmoid((nll * upstream).sum()).backward()  # a non-linear function of weighted per-token losses
        grads.append([t.grad for t in leaves])
    for name, got, want in zip(("hidden", "weight", "bias"), *grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
