"""Preference training (DPO) on 2 CPU ranks against a plain single-process PyTorch DPO loop: the same pairs, the
same starting weights, the reference model run beside the policy (no stored log-probs), each side's log-prob a
log_softmax/gather sum. The run computes its reference log-probs once, in a pass before the first step, with its own
engine and ZeRO stage; the loop recomputes them every step, so a wrong table (rows mixed up between ranks, a rank's
share lost, the policy instead of the base) shows in the losses."""
import json
import math

import pytest

from tests.helpers import launch, metrics, reference_losses

STEPS, LR, BETA = 6, 2e-3, 0.1
COMMON = [f"--train.max_steps={STEPS}", f"--train.lr={LR}", "--train.warmup_steps=2", "--train.min_lr_ratio=0.1",
          "--train.micro_batch_size=4", "--train.grad_accum_steps=2", "--train.seq_len=48", "--train.precision=fp32",
          "--data.path=data/tiny_dpo", "--data.format=preference", f"--preference.beta={BETA}",
          "--eval.max_batches=2", "--eval.every=0", "--log.wandb=false", "--log.progress_bar=false",
          "--checkpoint.every=0"]
RTOL = 1e-6  # measured up to 1.5e-7 (ZeRO-0/1/2/3): fp32 summation order only


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_dpo(tmp_path, cache, model_dir, ds_config, extra=()):
    run_dir = tmp_path / "run"
    launch(COMMON + [f"--model.name_or_path={model_dir}", "--ds_config", ds_config, "--output_dir", str(run_dir),
                     *extra], cache)
    return run_dir


@pytest.mark.parametrize("ds_config", ["zero0.json", "zero1.json", "zero2.json", "zero3.json"])
def test_dpo_matches_a_plain_pytorch_loop(tmp_path, cache, tiny_llama, ds_config):
    """Per-step losses and pre-clip gradient norms of a 2-rank run under each ZeRO stage equal the plain loop's;
    the first step's loss is log 2 (the policy is the reference); throughput counts both sides' real tokens."""
    extra = ["--ds.zero_optimization.stage3_param_persistence_threshold=0"] if ds_config == "zero3.json" else []
    run_dir = run_dpo(tmp_path, cache, tiny_llama, ds_config, extra)
    got, _ = metrics(run_dir)
    rows = [r for r in _rows(run_dir) if "loss" in r]
    ref = {}
    want, _ = reference_losses(tiny_llama, run_dir, STEPS, LR, 2, 0.1, weight_decay=0.1, record=ref, dpo_beta=BETA)
    gaps = [abs(g - w) / w for g, w in zip(got, want)]
    print(f"{ds_config}: max relative gap {max(gaps):.2e}; losses {got}")
    assert got[0] == pytest.approx(math.log(2), abs=1e-6)
    assert got == pytest.approx(want, rel=RTOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert [r["tokens"] for r in rows] == ref["tokens"]
    assert [r["label_tokens"] for r in rows] == ref["label_tokens"]
    assert all(0.0 <= r["rewards/accuracies"] <= 1.0 for r in rows)
    assert rows[-1]["rewards/margins"] == pytest.approx(rows[-1]["rewards/chosen"] - rows[-1]["rewards/rejected"],
                                                        abs=1e-6)
