"""train.mlp_chunk_tokens (DeepSpeed's TiledMLP on each decoder MLP) changes memory, not math: the same loss and
gradients as the plain model, in one process. Under ZeRO-3 and sequence parallelism it is checked against the
single-process reference in tests/e2e/test_sequence_parallel.py."""
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dstrain.components.tiled_mlp import install, mlps

ROOT = Path(__file__).resolve().parents[2]


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiled_mlp_gives_the_plain_models_loss_and_gradients():
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    want, want_grads = loss_and_grads(model, ids)
    calls = []
    for mlp in mlps(model):
        install(mlp, 24)  # 128 tokens -> 6 slices, the last one shorter
        down = mlp.down_proj.forward
        mlp.down_proj.forward = lambda x, down=down: calls.append(x.shape[:-1].numel()) or down(x)
    got, got_grads = loss_and_grads(model, ids)
    assert len(mlps(model)) == 2 and max(calls) <= 24 and len(calls) == 2 * 6 * 2  # 6 slices, recomputed in backward
    assert got == pytest.approx(want, rel=1e-6)
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).norm() <= 1e-5 * grad.norm(), name
