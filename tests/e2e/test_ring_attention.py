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
from tests.e2e.test_lora import LORA, LORA_ARGS, PARTITIONED
from tests.e2e.test_lora import LR as LORA_LR
from tests.e2e.test_sequence_parallel import SFT_PACKED, assert_eval_matches
from tests.e2e.test_vs_reference import COMMON, STEPS, assert_export_matches, run_and_compare
from tests.helpers import launch


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
    """Four ranks in one ring (each holds 2 of 8 chunks: earlier and later blocks of the zigzag both taken),
    stopped after step 4 and finished on a ring of 2 ranks (DeepSpeed's ZeRO-2 shards converted from 4 to 2):
    the 8 losses are the uninterrupted reference's, and the data position with them."""
    zero2 = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    configs = {}
    for ring in (4, 2):
        configs[ring] = tmp_path / f"cp{ring}_zero2.json"
        configs[ring].write_text(json.dumps(dict(zero2, context_parallel_size=ring)))
    launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", str(configs[4]), "--output_dir",
                     str(tmp_path / "run"), f"--train.exit_at_step={STEPS // 2}"], cache, nproc=4)
    run_dir, _ = run_and_compare(tmp_path, cache, tiny_llama, str(configs[2]))
    resumed = (run_dir / "launch_stderr.txt").read_text()
    assert "and ring attention from 4 to 2 ranks: the global batch stays 8" in resumed
    assert "to a universal checkpoint for the new layout" in resumed


def test_ulysses_2_x_ring_2_zero3_lora(tmp_path, cache, tiny_llama):
    """sp2cp2_zero3.json on 4 ranks: Ulysses exchanges heads inside pairs of consecutive ranks, the ring passes
    blocks between the pairs; peft's adapters partitioned to nothing per rank (persistence threshold 0)."""
    run_dir, ref_model = run_and_compare(tmp_path, cache, tiny_llama, "sp2cp2_zero3.json", nproc=4,
                                         extra=LORA_ARGS + PARTITIONED, lora=LORA, lr=LORA_LR, learns=0.1)
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["components"]["sequence_parallel"] == {"size": 2, "context_parallel": 2}
    assert_eval_matches(run_dir, ref_model, data_parallel=1)


def test_dpo_on_a_ring_of_2(tmp_path, cache, tiny_llama):
    """DPO with its reference log-probs computed by the ring before step 1: each rank runs its part of every
    chosen and rejected row and the per-sequence sums are added over the ring; pairs counted once. Per-step
    losses, gradient norms and token counts equal the plain loop's (test_preference's), eval rewards included."""
    from tests.e2e.test_preference import PARTITIONED as DPO_PARTITIONED
    from tests.e2e.test_preference import args_for, assert_eval_rewards_from_export, compare_with_loop
    run_dir = tmp_path / "run"
    launch(args_for(tiny_llama, "cp2_zero3.json", run_dir, DPO_PARTITIONED + ["--eval.every=3"]), cache)
    compare_with_loop(run_dir, tiny_llama)
    assert_eval_rewards_from_export(run_dir, tiny_llama, data_parallel=1)
