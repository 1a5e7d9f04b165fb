"""The README's promise: the default recipe under the deepspeed launcher on 2 CPU ranks visibly learns,
writes everything a person looks at, and only rank 0 speaks. Plus: the other tiny recipes train."""
import json

import pytest
from PIL import Image

from helpers import launch, metrics


def test_default_recipe_learns_and_reports(tmp_path, cache):
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero3.json", "--output_dir", str(run)], cache)  # wandb on: offline here
    losses, evals = metrics(run)
    first, last = evals[0], evals[-1]
    print(f"default recipe: eval loss {first['eval_loss']:.3f} -> {last['eval_loss']:.3f} over {len(losses)} steps")
    assert first["step"] == 0 and last["step"] == 150 and len(losses) == 150
    assert last["eval_loss"] < 0.35 * first["eval_loss"]          # measured 6.40 -> 1.10
    assert last["perplexity"] == pytest.approx(2.718281828 ** last["eval_loss"])

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        keys = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s"} if "loss" in row else \
            {"step", "eval_loss", "perplexity"}
        assert set(row) == keys
    steps = [r for r in rows if "loss" in r]
    assert steps[0]["tokens"] == 2 * 8 * 128 and all(r["tokens_per_s"] > 0 for r in steps)
    assert max(r["lr"] for r in steps) == pytest.approx(3e-3) and steps[0]["lr"] == pytest.approx(3e-4)

    assert Image.open(run / "loss.png").size[0] > 100
    assert (run / "recipe.yaml").exists() and json.loads((run / "ds_config.json").read_text())["train_batch_size"] == 16
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    record = next(offline[0].glob("*.wandb")).read_bytes()  # the run's protobuf log: config and metrics
    assert b"micro_batch_size" in record and b"zero_optimization" in record and b"eval_loss" in record
    # rank 0 alone reports: one evaluation line per evaluation, one progress bar
    assert proc.stderr.count("step 150: eval_loss=") == 1
    assert proc.stderr.count("step 0: eval_loss=") == 1


@pytest.mark.parametrize("recipe", ["tiny/sft.yaml", "tiny/chat_sft.yaml"])
def test_sft_recipes_learn(tmp_path, cache, recipe):
    run = tmp_path / "run"
    launch(["--recipe", recipe, "--output_dir", str(run), "--train.max_steps=40", "--eval.every=0",
            "--log.wandb=false"], cache)
    _, evals = metrics(run)
    print(f"{recipe}: eval loss {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.3f}")
    assert evals[-1]["eval_loss"] < 0.6 * evals[0]["eval_loss"]
