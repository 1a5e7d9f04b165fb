"""QLoRA (lora.quantize: 4bit) on a CUDA GPU with bitsandbytes: skipped cleanly anywhere else (CI has no GPU).

A tiny Llama with saved weights, 4-bit NF4 base, bf16 adapters, one rank: it must learn, leave the base out of
its checkpoint and export adapter/ + a merged hf/ that loads. Run by `make bench-gpu` (scripts/gpu_checks.sh) and by hand:
    .venv/bin/python -m pytest tests/gpu -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import launch, metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="QLoRA needs a CUDA GPU (bitsandbytes)")


@pytest.mark.parametrize("ds_config", ["zero2.json", "zero3.json"])
def test_qlora_trains_and_exports(tmp_path, cache, tiny_llama, ds_config):
    pytest.importorskip("bitsandbytes")
    run = tmp_path / "run"
    launch(["--ds_config", ds_config, f"--model.name_or_path={tiny_llama}", "--output_dir", str(run),
            "--lora.r=8", "--lora.quantize=4bit", "--train.precision=bf16", "--train.max_steps=20",
            "--train.lr=1e-2", "--train.seq_len=64", "--eval.every=0", "--log.wandb=false",
            "--log.progress_bar=false"], cache, launcher="python", nproc=1)
    losses, evals = metrics(run)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.1, evals
    info = json.loads((run / "run_info.json").read_text())
    assert info["components"]["lora"]["quantize"] == "4bit"
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert (run / "adapter" / "adapter_model.safetensors").exists() and merged.config.vocab_size > 0
