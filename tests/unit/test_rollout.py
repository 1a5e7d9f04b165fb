"""dstrain/objectives/rollout.py: greedy rollouts equal transformers' generate; sampled ones do not depend on
which other prompts share the batch (1 rank or 2); the KV-cached decoding gives the logits a full forward gives."""
import pytest
import torch

from dstrain.objectives import rollout

pytest.importorskip("transformers")
EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=EOS, pad_token_id=PAD)
    m = LlamaForCausalLM(config)
    with torch.no_grad():  # make EOS likely enough that some rows stop early
        m.lm_head.weight[EOS] *= 1.5
    return m.train()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [16, 17]]


def test_greedy_equals_generate(model):
    got = rollout.sample(model, PROMPTS, [(0, i) for i in range(len(PROMPTS))], rollout.Sampling(10, 0.0), EOS, PAD)
    assert model.training, "the model is put back in training mode"
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in PROMPTS]).unsqueeze(1)).long()
    model.eval()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                         pad_token_id=PAD)[:, width:].tolist()
    model.train()
    for row, (ours, theirs) in enumerate(zip(got.completion_ids, ref)):
        expect = theirs[:theirs.index(EOS) + 1] if EOS in theirs else theirs
        assert ours == expect, row
        assert got.truncated[row] == (EOS not in expect)
    assert any(got.truncated) and not all(got.truncated), "both kinds of rows should occur"


@pytest.mark.parametrize("sampling", [rollout.Sampling(10, 1.0), rollout.Sampling(10, 0.7, top_p=0.9, top_k=20)])
def test_a_completion_does_not_depend_on_its_batch(model, sampling):
    """What 2 ranks sample for their halves equals what 1 rank samples for all (same keys)."""
    keys = [(42, 3, p, 0) for p in range(len(PROMPTS))]
    whole = rollout.sample(model, PROMPTS, keys, sampling, EOS, PAD).completion_ids
    halves = (rollout.sample(model, PROMPTS[:2], keys[:2], sampling, EOS, PAD).completion_ids
              + rollout.sample(model, PROMPTS[2:], keys[2:], sampling, EOS, PAD).completion_ids)
    assert whole == halves
    again = rollout.sample(model, PROMPTS, keys, sampling, EOS, PAD).completion_ids
    other = rollout.sample(model, PROMPTS, [(42, 4, p, 0) for p in range(len(PROMPTS))], sampling, EOS,
                           PAD).completion_ids
    assert again == whole and other != whole


def test_each_token_is_the_inverse_cdf_draw_of_a_full_forward(model):
    """Reference: the full sequence through the model without a cache; each sampled token must be the one the
    row's uniform picks from those logits (so the cache, positions and padding are right)."""
    sampling = rollout.Sampling(8, 1.0)
    keys = [(7, 0, p, 1) for p in range(len(PROMPTS))]
    got = rollout.sample(model, PROMPTS, keys, sampling, EOS, PAD)
    model.eval()
    for prompt, key, completion in zip(PROMPTS, keys, got.completion_ids):
        gen = rollout.generator_for(key)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
        for t, token in enumerate(completion):
            probs = torch.softmax(logits[len(prompt) + t - 1].float(), -1)
            u = torch.rand((), generator=gen)
            assert int(torch.searchsorted(torch.cumsum(probs, -1), u * probs.sum())) == token
    model.train()


def test_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    top_p = rollout.filtered_probs(logits, rollout.Sampling(1, 1.0, top_p=float(probs[0] + 0.01)))[0]
    assert top_p[2:].tolist() == [0.0, 0.0] and top_p[:2].sum().item() == pytest.approx(1.0)
    only_first = rollout.filtered_probs(logits, rollout.Sampling(1, 1.0, top_p=0.01))[0]
    assert only_first.tolist() == [1.0, 0.0, 0.0, 0.0]
    top_k = rollout.filtered_probs(logits, rollout.Sampling(1, 1.0, top_k=3))[0]
    assert top_k[3] == 0.0 and top_k[:3].sum().item() == pytest.approx(1.0)
    assert rollout.draw(torch.tensor([[0.2, 0.3, 0.5]]), torch.tensor([0.45])).tolist() == [1]


def test_keep_going_decides_for_the_batch(model):
    """ZeRO-3's ranks must run the same forwards: the callback sees whether this rank still has a row going."""
    seen = []

    def keep_going(active):
        seen.append(active)
        return len(seen) < 4
    got = rollout.sample(model, PROMPTS[:1], [(0,)], rollout.Sampling(10, 1.0), EOS, PAD, keep_going)
    assert len(seen) == 4 and len(got.completion_ids[0]) <= 4
