"""Ring attention (context_parallel_size: each rank of a ring holds two zigzag chunks of every sequence and key/
value blocks pass round the ring) against the plain single-process PyTorch loop of test_vs_reference, which sees
whole sequences. fp32, same weights and global batches: the reference tests' tolerances apply. Packed rows check
that no token attends across documents (the reference gets position_ids and transformers' own per-document mask)
and that RoPE positions restart; a model with one key/value head is one Ulysses cannot split."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ROOT
from tests.e2e.test_sequence_parallel import SFT_PACKED, assert_eval_matches
from tests.e2e.test_vs_reference import assert_export_matches, run_and_compare


@pytest.fixture(scope="module")
def tiny_llama_mqa(tmp_path_factory):
    """tiny_llama with one key/value head (multi-query attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import ROOT, _save
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.update({"num_hidden_layers": 2, "num_key_value_heads": 1})
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(config), ROOT / "recipes/tiny/model",
                 tmp_path_factory.mktemp("models") / "tiny-llama-mqa")


def test_ring_2_zero3_packed_sft_one_kv_head(tmp_path, cache, tiny_llama_mqa):
    run_dir, ref_model = run_and_compare(tmp_path, cache, tiny_llama_mqa, "cp2_zero3.json", learns=0.1,
                                         extra=SFT_PACKED)
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["components"]["sequence_parallel"] == {"size": 1, "context_parallel": 2}
    cfg = json.loads((run_dir / "ds_config.json").read_text())
    assert cfg["train_batch_size"] == 16  # DeepSpeed counts the ring's 2 ranks as data-parallel ones
    assert_export_matches(run_dir, ref_model, 1e-4, torch.float32)
    assert_eval_matches(run_dir, ref_model, data_parallel=1)



def test_ring_4_zero2_resumed_on_ring_2(tmp_path, cache, tiny_llama):
    """Four ranks in one ring (every rank holds 2 of 8 chunks: the zigzag's earlier and later blocks both taken),
    stopped after step 4 and finished on a ring of 2 ranks with 2 data-parallel replicas: the data position and
    the losses are the uninterrupted reference's."""
    cfg = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ring4 = tmp_path / "cp4_zero2.json"
    ring4.write_text(json.dumps(dict(cfg, context_parallel_size=4)))
    run_and_compare(tmp_path, cache, tiny_llama, str(ring4), nproc=4)
