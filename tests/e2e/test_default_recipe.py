"""The README's promise: the default recipe under the deepspeed launcher on 2 CPU ranks visibly learns,
writes everything a person looks at, and only rank 0 speaks. Plus: the other tiny recipes train."""
import json
import re

import pytest
from PIL import Image

from tests.helpers import ROOT, kill_rank_after_checkpoint, launch, metrics, readme_command


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache):
    """The README's first command (the default recipe under ZeRO-3), as written."""
    run = tmp_path_factory.mktemp("default") / "run"
    # wandb on (offline here), TensorBoard on
    return run, launch(readme_command("--ds_config zero3.json") + ["--output_dir", str(run),
                                                                  "--log.tensorboard=true"], cache)


def test_default_recipe_learns_and_reports(default_run):
    run, proc = default_run
    losses, evals = metrics(run)
    first, last = evals[0], evals[-1]
    print(f"default recipe: eval loss {first['eval_loss']:.3f} -> {last['eval_loss']:.3f} over {len(losses)} steps")
    assert first["step"] == 0 and last["step"] == 150 and len(losses) == 150
    assert last["eval_loss"] < 0.35 * first["eval_loss"]          # measured 6.40 -> 1.10
    assert last["perplexity"] == pytest.approx(2.718281828 ** last["eval_loss"])

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        keys = {"step", "loss", "lr", "grad_norm", "tokens", "label_tokens", "tokens_per_s", "step_s", "mfu", "time",
                "comm_s", "comm_fraction", "comm_bytes", "skipped_steps", "spikes"} if "loss" in row else \
            {"step", "eval_loss", "perplexity"}
        if "loss" in row and row["step"] % 20 == 0:  # fault.straggler_every: the ranks' compute times compared
            keys |= {"slowest_rank", "slowest_ratio"}
        assert set(row) == keys
    assert all(r["skipped_steps"] == 0 and r["spikes"] == 0 for r in rows if "loss" in r)
    steps = [r for r in rows if "loss" in r]
    assert steps[0]["tokens"] == 2 * 8 * 128 and all(r["tokens_per_s"] > 0 for r in steps)
    # MFU = tokens/s x FLOPs per token / peak: one constant ratio per run, never above 100% (issue 29: the peak
    # measured on a busy machine gave 107-233%); a step beyond the peak turns MFU off for the rest of the run
    shown = [r["mfu"] for r in steps if r["mfu"] is not None]
    assert len(shown) >= 10 and all(0 < mfu <= 1.0 for mfu in shown)
    assert [r["mfu"] is None for r in steps] == sorted(r["mfu"] is None for r in steps)
    # 2 ranks, ZeRO-3, fp32: every step gathers the parameters and reduce-scatters the gradients (bytes that
    # tests/e2e/test_planner.py checks) and waits some time for it
    sent = [r["comm_bytes"] for r in steps if r["step"] != 100]
    assert min(sent) > 1e6 and max(sent) < 1.01 * min(sent)
    # step 100 also replays its first micro-batch (fault.sdc_check_every): ZeRO-3 gathers the weights for it again
    assert steps[99]["comm_bytes"] > 1.5 * min(sent)
    assert all(0 < r["comm_s"] < r["step_s"] and r["comm_fraction"] == pytest.approx(r["comm_s"] / r["step_s"])
               for r in steps)
    assert len({round(r["mfu"] / r["tokens_per_s"], 15) for r in steps if r["mfu"] is not None}) == 1
    assert all(a["time"] < b["time"] for a, b in zip(steps, steps[1:]))
    assert "median" in proc.stderr and ("tokens/s, MFU" in proc.stderr or "MFU is not shown" in proc.stderr)
    assert max(r["lr"] for r in steps) == pytest.approx(3e-3) and steps[0]["lr"] == pytest.approx(3e-4)

    assert Image.open(run / "loss.png").size[0] > 100
    # issue 54 items 3 and 10: the summary counts epochs and says what to do next with the export
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == pytest.approx(150 * 16 / summary["train_sequences"], abs=1e-3)
    assert f"from_pretrained('{run / 'hf'}')" in summary["next"] and "next " in proc.stderr
    assert (run / "recipe.yaml").exists() and json.loads((run / "ds_config.json").read_text())["train_batch_size"] == 16
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    record = next(offline[0].glob("*.wandb")).read_bytes()  # the run's protobuf log: config and metrics
    assert b"micro_batch_size" in record and b"zero_optimization" in record and b"eval_loss" in record
    # TensorBoard has every training and eval row of metrics.jsonl, read back with its own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == \
        [(r["step"], r["loss"]) for r in steps]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval_loss")] == \
        [(r["step"], r["eval_loss"]) for r in evals]
    # the last screen: a short summary, also as summary.json, agreeing with metrics.jsonl
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 150 and summary["status"] == "finished" and summary["final_loss"] == losses[-1]
    assert summary["final_eval_loss"] == last["eval_loss"] and summary["tokens"] == sum(r["tokens"] for r in steps)
    assert summary["export"] == str(run / "hf") and summary["checkpoint"].endswith("step_00000150")
    assert 0 < summary["wall_s"] and summary["median_tokens_per_s"] > 0
    # issue 58: the quiet checks ran at their default intervals and found nothing (a slow rank may be named on a
    # machine this busy; it is only said)
    assert summary["health"]["sdc_replays"] == 1 and summary["health"]["sdc_found"] is None  # step 100
    lines = proc.stderr.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("run finished: step 150 of 150"))
    assert len(lines) - start <= 9 and lines[-1].endswith("summary.json"), lines[-10:]  # the run's last words
    assert (run / "hf" / "model.safetensors").stat().st_mode & 0o044 == 0o044, "the export must be readable"
    # memory.json: the ratio, and on a model this small a note that it says little (issue 29: 2.9-5.1 unexplained)
    memory = json.loads((run / "memory.json").read_text())
    assert memory["measured_over_estimated"] == pytest.approx(
        memory["peak_above_baseline_bytes"] / memory["estimated_device_bytes"], rel=0.05)
    assert "says little" in memory["note"]
    # rank 0 alone reports: one evaluation line per evaluation, one progress bar
    assert proc.stderr.count("step 150: eval_loss=") == 1
    assert proc.stderr.count("step 0: eval_loss=") == 1


@pytest.mark.parametrize("recipe", ["tiny/sft", "tiny/chat_sft"])
def test_sft_recipes_learn(tmp_path, cache, recipe):
    """The README's SFT commands, as written."""
    run = tmp_path / "run"
    command = readme_command(f"--recipe {recipe} ", "--train.max_steps=40")  # 40 steps: enough to see it learn
    launch(command + ["--output_dir", str(run), "--eval.every=0", "--log.wandb=false"], cache)
    _, evals = metrics(run)
    print(f"{recipe}: eval loss {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.3f}")
    assert evals[-1]["eval_loss"] < 0.6 * evals[0]["eval_loss"]


def test_tiny_lora_recipe_on_the_default_runs_export(tmp_path, cache, default_run):
    """The README's LoRA walk-through: `make train`, then tiny/lora_chat_sft.yaml on its hf/ (the recipe names
    runs/tiny-pretrain/hf; here the default run lives elsewhere). Adapters on chat data must learn."""
    import os
    run = tmp_path / "run"
    base = os.path.relpath(default_run[0] / "hf", ROOT)  # relative, as the recipe's runs/tiny-pretrain/hf
    proc = launch(readme_command("tiny/lora_chat_sft") + [f"--model.name_or_path={base}",
                                                          "--output_dir", str(run), "--log.wandb=false"], cache)
    _, evals = metrics(run)
    print(f"tiny LoRA recipe: eval loss {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.3f}")
    assert evals[-1]["eval_loss"] < 0.8 * evals[0]["eval_loss"]
    assert "lora: r=16 on all-linear" in proc.stderr and (run / "adapter" / "adapter_config.json").exists()
    # issue 54 item 10: the adapter named its base `runs/tiny-pretrain/hf`, found only from the repository root
    named = json.loads((run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((default_run[0] / "hf").resolve()), named

    # A QLoRA run's model_config/config.json records the 4-bit base (transformers writes quantization_config):
    # its export loaded the base 4-bit and peft failed on it (seen on an H200). Exported again with that record,
    # the merged model is the same full-precision one and says nothing of 4 bits.
    import torch
    from safetensors.torch import load_file

    from dstrain.run.export import export_dtype, export_hf
    config = run / "model_config" / "config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), quantization_config={
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"})))
    again = export_hf(sorted((run / "checkpoints").glob("step_*"))[-1], tmp_path / "hf",
                      export_dtype(json.loads((run / "ds_config.json").read_text())))
    assert "quantization_config" not in json.loads((again / "config.json").read_text())
    want, got = load_file(run / "hf" / "model.safetensors"), load_file(again / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("loss", ["dpo", "simpo"])
def test_tiny_dpo_recipe_on_the_default_runs_export(tmp_path, cache, default_run, loss):
    """The README's DPO and SimPO commands on the default run's hf/ (the recipe names runs/tiny-pretrain/hf). DPO:
    the reference log-probs are computed once and kept; the eval reward accuracy rises from 0 (policy = reference)
    past 0.9. SimPO has no reference: its reward is the policy's own, so it starts where the export ranks the pairs
    (issue 54 item 10: 1.0 before a step, nothing to watch, until half the pairs' rejected answer repeated itself)."""
    run = tmp_path / "run"
    proc = launch(readme_command("tiny/dpo", f"loss={loss}") + [f"--model.name_or_path={default_run[0] / 'hf'}",
                                                                 "--output_dir", str(run), "--log.wandb=false"], cache)
    evals = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    print(f"tiny {loss} recipe: eval reward accuracy {[e['eval_rewards/accuracies'] for e in evals]}")
    if loss == "dpo":
        assert evals[0]["eval_loss"] == pytest.approx(0.693147, abs=1e-5) and evals[0]["eval_rewards/margins"] == 0
        assert "reference log-probs of" in proc.stderr and (run / "reference_logps.pt").exists()
    else:
        assert 0.3 < evals[0]["eval_rewards/accuracies"] < 0.9, evals[0]
        assert "reference log-probs" not in proc.stderr
    assert evals[-1]["eval_rewards/accuracies"] > 0.9 and evals[-1]["eval_rewards/margins"] > 1.0
    assert "perplexity" not in evals[-1]


def _rl_rows(run):
    return [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_tiny_grpo_recipe_learns_from_its_rewards(tmp_path, cache, default_run):
    """Issue 56: the README's GRPO command on the default run's hf/. Completions are sampled every step from the
    current weights and scored by recipes/tiny/rewards.py; the mean reward of the last 5 steps is at least 2x, or
    +0.5 above, that of the first 5 (measured: 0.53 -> 1.06). The story's count itself stays hard for a 0.8M model;
    stopping after the sentence is what it learns."""
    run = tmp_path / "run"
    launch(readme_command("tiny/grpo") + [f"--model.name_or_path={default_run[0] / 'hf'}", "--output_dir", str(run),
                                          "--log.wandb=false", "--checkpoint.export_hf=false"], cache)
    rows = _rl_rows(run)
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"tiny grpo: reward {first:.3f} -> {last:.3f}; one_sentence "
          f"{rows[0]['rewards/one_sentence/mean']:.2f} -> {rows[-1]['rewards/one_sentence/mean']:.2f}")
    assert len(rows) == 40 and (last >= 2 * first or last >= first + 0.5), rewards
    quoted = re.search(r"tiny/grpo .*# reward ([\d.]+) -> ([\d.]+)", (ROOT / "README.md").read_text())
    assert (first, last) == pytest.approx((float(quoted[1]), float(quoted[2])), abs=0.02)  # the README's figures
    assert rows[-1]["rewards/one_sentence/mean"] > 0.9 and rows[0]["completions/clipped_ratio"] > 0
    for row in rows:  # TRL's metric names, and the loss a finite number; the rollout's speed and share of the step
        assert {"reward", "reward_std", "rewards/says_the_count/mean", "completions/mean_length",
                "clip_ratio/low_mean", "entropy"} <= set(row) and row["loss"] == row["loss"]
        assert 0 < row["rollout_share"] < 1 and row["rollout_tokens_per_s"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["rollout_share"] < 1 and summary["median_rollout_tokens_per_s"] > 0
    # the completions table: every rl.log_completions_every (10) steps, rank 0's 4 prompts x 8 completions
    table = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [s for s in (10, 20, 30, 40) for _ in range(32)]
    for r in table:  # the total is the functions' sum (weights 1); a group's advantages centre on 0
        assert r["reward"] == pytest.approx(sum(r["rewards"].values())) and set(r["rewards"]) == {
            "says_the_count", "one_sentence"} and r["prompt"].startswith("It was")
    for g in range(0, len(table), 8):
        assert sum(r["advantage"] for r in table[g:g + 8]) == pytest.approx(0, abs=1e-4)


def test_tiny_distill_recipe_brings_the_student_to_its_teacher(tmp_path, cache, default_run):
    """The README's distillation command on the default run's hf/: a 2-layer student cut from it samples its own
    completions and the whole model, as the teacher, scores every token; the reverse KL per completion token of the
    last 5 steps is at most a fifth of the first 5's (measured: 0.63 -> 0.010)."""
    run = tmp_path / "run"
    hf = default_run[0] / "hf"
    launch(readme_command("tiny/distill") + [f"--model.name_or_path={hf}", f"--rl.teacher={hf}", "--output_dir",
                                             str(run), "--log.wandb=false", "--checkpoint.export_hf=false"], cache)
    rows = _rl_rows(run)
    kl = [r["distill_loss"] for r in rows]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    print(f"tiny distill: reverse KL to the teacher {first:.3f} -> {last:.3f}")
    assert len(rows) == 30 and last <= first / 5, kl
    # the README's ranges: what two machines measured (their CPUs' rounding samples other completions from the same
    # export: 0.63 on the first, 0.545 on a second, bit for bit the same under torchrun and warm ranks)
    quoted = re.search(r"tiny/distill .*# reverse KL to the teacher ([\d.]+)-([\d.]+) -> ([\d.]+)-([\d.]+)",
                       (ROOT / "README.md").read_text())
    low, high, last_low, last_high = map(float, quoted.groups())
    assert low - 0.02 <= first <= high + 0.02 and last_low - 0.002 <= last <= last_high + 0.002, (first, last)
    assert all(r["loss"] == r["distill_loss"] for r in rows)  # alone: the loss is the distillation loss


def _grpo_args(default_run, run) -> list[str]:
    """Two updates per rollout batch (rl.num_iterations 2): steps 1-2 train on the first batch's completions, 3-4 on
    the second's; the checkpoint every 2 steps lands at a batch's end."""
    return readme_command("tiny/grpo") + [f"--model.name_or_path={default_run[0] / 'hf'}", "--train.max_steps=4",
                                          "--rl.num_iterations=2",
                                          "--log.wandb=false", "--checkpoint.export_hf=false", "--checkpoint.every=2",
                                          "--checkpoint.keep_last=2", "--train.micro_batch_size=4",
                                          "--output_dir", str(run)]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, cache, default_run):
    """The same GRPO run (8 prompts x 8 completions a step) on 1 rank (accumulating 2 micro-batches) and on 2."""
    root = tmp_path_factory.mktemp("grpo")
    runs = {1: root / "one", 2: root / "two"}
    for ranks, run in runs.items():
        launch(_grpo_args(default_run, run) + [f"--train.grad_accum_steps={3 - ranks}"], cache, nproc=ranks)
    return runs


def test_grpo_losses_do_not_depend_on_the_number_of_ranks(grpo_runs):
    """Each completion is sampled from its own (seed, step, place, completion) stream, the groups' advantages stay
    on their rank, and DAPO's loss is normalised by the whole batch's completion tokens, so 1 rank and 2 log the
    same losses (measured: identical to the last digit). ZeRO-3 on 2 ranks is compared with TRL in
    test_rl_vs_trl.py."""
    one, two = _rl_rows(grpo_runs[1]), _rl_rows(grpo_runs[2])
    print({"1 rank": [r["loss"] for r in one], "2 ranks": [r["loss"] for r in two]})
    assert len(one) == len(two) == 4
    rewards = [r["reward"] for r in one]  # a rollout batch per 2 steps: its second step trains on it again
    assert rewards[0] == rewards[1] and rewards[2] == rewards[3] and rewards[0] != rewards[2]
    assert "rollout_s" not in one[1] and one[2]["rollout_s"] > 0 and one[1]["loss"] != one[0]["loss"]
    assert [r["reward"] for r in one] == [r["reward"] for r in two]  # the same completions, scored the same
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["tokens"] == b["tokens"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_grpo_killed_with_sigkill_resumes_on_one_rank_as_if_never_stopped(tmp_path, cache, default_run, grpo_runs):
    """kill -9 a rank of the 2-rank GRPO run after its step-2 checkpoint (the end of the first rollout batch);
    resume it on 1 rank (grad_accum_steps doubled: the same global batch). Steps 3 and 4 sample the same
    completions (the sampler's streams are keyed by step and place, nothing carried in memory), read the same
    prompts (the stream's position is checkpointed), and log the uninterrupted run's rewards and losses."""
    run = tmp_path / "run"
    args = _grpo_args(default_run, run) + ["--world_size=2"]
    killed = kill_rank_after_checkpoint(args, run, cache, step=2, rank=1)
    assert killed.returncode != 0, killed.stdout[-3000:]
    launch(args, cache, launcher="warm-python")
    got, want = _rl_rows(run), _rl_rows(grpo_runs[2])
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["reward"] for r in got] == [r["reward"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)


def test_flops_per_token_agrees_with_deepspeeds_profiler(tmp_path, cache):
    """run_info's FLOPs per token (6N + attention) against DeepSpeed's flops profiler, which counts every
    module's multiply-adds while it runs; log.flops_profile_step turns the profiler on for that step only."""
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero2.json", "--output_dir", str(run), "--train.max_steps=4", "--eval.every=0",
                   "--log.flops_profile_step=2", "--log.wandb=false", "--checkpoint.export_hf=false"], cache)
    profile = (run / "flops_profile.txt").read_text()
    assert "Profile Summary at step 2" in profile
    fields = dict(line.split(":", 1) for line in profile.splitlines() if ":" in line)
    fwd = float(fields["fwd flops per GPU"].split()[0]) * {"M": 1e6, "G": 1e9}[fields["fwd flops per GPU"].split()[1]]
    tokens_per_rank = int(fields["batch size per GPU"]) * 128
    ours = json.loads((run / "run_info.json").read_text())["flops_per_token"]
    print(f"FLOPs/token: ours {ours / 1e6:.3f} M, DeepSpeed profiler 3 x fwd {3 * fwd / tokens_per_rank / 1e6:.3f} M")
    assert ours == pytest.approx(3 * fwd / tokens_per_rank, rel=0.02)  # measured: 5.586 vs 5.59 (3 digits printed)
    # the profiler's per-step timer printing is switched off again after its step
    assert proc.stdout.count("fwd_microstep") <= 2
