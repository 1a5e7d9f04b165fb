"""A run directory holds one run: continuing it with another model, data or format is refused before anything
is written, and --init_from starts a new run from its weights on purpose (issue 16, defect 1)."""
import pytest
from safetensors.torch import load_file

from tests.helpers import launch, metrics

COMMON = ["--train.seq_len=32", "--train.micro_batch_size=4", "--eval.every=0", "--log.wandb=false",
          "--log.progress_bar=false", "--log.plot=false"]


def _snapshot(run):  # all but the run-directory lock, which every launch takes (its holder's pid inside)
    return {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*")
            if p.name != ".lock"}


def test_another_run_in_the_same_directory_is_refused_and_init_from_starts_from_its_weights(tmp_path, cache,
                                                                                            tiny_llama):
    pretrain = tmp_path / "pt"
    launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--train.max_steps=3", "--train.lr=1e-2",
                     "--output_dir", str(pretrain)], cache, launcher="warm-python")
    before = _snapshot(pretrain)

    # what the user did: the SFT recipe pointed at the pretraining run's directory
    for other in (["--recipe", "tiny/chat_sft", f"--model.name_or_path={tiny_llama}"],
                  ["--model.name_or_path=recipes/tiny/model"]):
        proc = launch(COMMON + other + ["--train.max_steps=5", "--output_dir", str(pretrain)], cache,
                      launcher="warm-python", check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "holds another run" in error[0] and "--init_from" in error[0], proc.stderr[-3000:]
        assert len(error[0].replace(str(pretrain), "DIR")) < 200, error[0]
        assert "Traceback" not in proc.stderr
        assert _snapshot(pretrain) == before, "a refused run touched the existing run directory"

    # issue 29 item 7: --resume of another model's checkpoint into a new directory blamed the new directory and
    # suggested --init_from <the new directory>
    ckpt = pretrain / "checkpoints" / "step_00000003"
    proc = launch(COMMON + ["--model.name_or_path=recipes/tiny/model", "--train.max_steps=5", "--resume", str(ckpt),
                            "--output_dir", str(tmp_path / "new")], cache, launcher="warm-python", check=False)
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(error) == 1, proc.stderr[-3000:]
    assert f"--resume {ckpt} is a checkpoint of another run" in error[0], error[0]
    assert f"--init_from {ckpt} --model.name_or_path={tiny_llama}" in error[0], error[0]
    assert not (tmp_path / "new").exists() and _snapshot(pretrain) == before

    # on purpose: SFT from the pretraining checkpoint's weights, 2 ranks under ZeRO-3 (built inside zero.Init);
    # lr so small that the exported weights must still be the pretraining run's
    sft = tmp_path / "sft"
    proc = launch(COMMON + ["--recipe", "tiny/chat_sft", f"--model.name_or_path={tiny_llama}",
                            "--init_from", str(pretrain), "--train.max_steps=1", "--train.lr=1e-9",
                            "--train.warmup_steps=0", "--output_dir", str(sft), "--ds_config", "zero3.json"], cache)
    assert "starting at step 0" in proc.stderr
    assert _snapshot(pretrain) == before, "--init_from must only read the other run"
    start = load_file(pretrain / "hf" / "model.safetensors")
    original = load_file(tiny_llama / "model.safetensors")
    got = load_file(sft / "hf" / "model.safetensors")
    assert set(got) == set(start)
    # the pretraining run moved the weights, so loading model.name_or_path instead would be caught here
    assert max((start[k].float() - original[k].float()).abs().max().item() for k in start) > 1e-3
    assert max((got[k].float() - start[k].float()).abs().max().item() for k in start) < 1e-6


def test_a_recipe_written_for_more_ranks_keeps_its_global_batch(tmp_path, cache, tiny_llama):
    """Issue 16: a recipe written for 8 ranks trained at world 1 with an eighth of its global batch, silently.
    Now grad_accum_steps is re-derived (and said so); --world_size=1 accepts the batch as written."""
    import json
    recipe = tmp_path / "written_for_4.yaml"
    recipe.write_text(f"world_size: 4\nmodel:\n  name_or_path: {tiny_llama}\n"
                      "train:\n  micro_batch_size: 2\n  grad_accum_steps: 1\n  max_steps: 1\n")
    run = tmp_path / "run"
    proc = launch(COMMON + ["--recipe", str(recipe), "--train.micro_batch_size=2", "--output_dir", str(run)], cache,
                  launcher="warm-python")
    assert "written for world_size 4; on 1 grad_accum_steps 1 -> 4 keeps its global batch of 8" in proc.stderr
    assert json.loads((run / "ds_config.json").read_text())["train_batch_size"] == 8
    accepted = tmp_path / "accepted"
    proc = launch(COMMON + ["--recipe", str(recipe), "--train.micro_batch_size=2", "--world_size", "1",
                            "--output_dir", str(accepted)], cache,
                  launcher="warm-python")
    assert "written for world_size" not in proc.stderr
    assert json.loads((accepted / "ds_config.json").read_text())["train_batch_size"] == 2


def test_a_second_launch_into_a_live_run_directory_is_refused(tmp_path, cache, tiny_llama):
    """Issue 29 item 3: two launches into one directory (different master ports) both trained to the end, their
    metrics and checkpoints interleaved. The second is now refused in one line naming the live run; the first
    trains on untouched. After the first ends (the kernel drops its lock), the directory takes a run again.

    The first run holds before step `held` until the test's Ctrl-C: in CI it once trained all its 400 steps and
    released the lock while the second launch was still starting (15 s), and the second then found a finished run."""
    import json
    import os
    import signal
    import subprocess
    import time

    from tests.helpers import BIN, ROOT, env, free_port, kill_tree

    held = 5
    run = tmp_path / "run"
    args = COMMON + [f"--model.name_or_path={tiny_llama}", "--train.max_steps=400", "--checkpoint.every=0",
                     "--output_dir", str(run)]
    first = subprocess.Popen([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                              "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env(cache, DSTRAIN_FAULT=f"step:slow:seconds=300:until=signalled:step={held}"),
                             start_new_session=True)
    try:
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").exists() and len(metrics(run)[0]) >= held - 1):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        holder = json.loads((run / ".lock").read_text())
        # another master port: nothing else would stop it (2 warm ranks: the subject is the lock, not a launcher)
        second = launch(args, cache, launcher="warm", check=False)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
        assert f"is in use by another run (pid {holder['pid']} on {holder['host']}" in errors[0], errors[0]
        assert "another --output_dir" in errors[0] and "Traceback" not in second.stderr
        assert first.poll() is None, "the refused launch must not disturb the live run"
        assert json.loads((run / ".lock").read_text()) == holder
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: releases the hold; step `held` trains, is saved, the run stops
        first.communicate(timeout=300)
    finally:
        kill_tree(first.pid)
    losses = metrics(run)[0]
    assert len(losses) == held, "the first run was held before step `held` while the second launch was refused"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, len(losses) + 1)), "one writer: every step once, in order"
    # the holder is gone: the same directory resumes (a lock a dead run cannot keep)
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", f"--train.max_steps={len(losses) + 1}",
                            "--checkpoint.every=0", "--output_dir", str(run)], cache, launcher="warm-python")
    assert f"resumed from {run / 'checkpoints'}" in proc.stderr, proc.stderr[-3000:]


def test_lora_on_the_weights_of_another_run_trains_and_resumes_on_them(tmp_path, cache):
    """Issue 29 item 7: LoRA with --init_from was refused on a from-scratch recipe ("no weights: the frozen base
    would be random") though the docs say they combine. A resumed LoRA run must keep that base too: its
    checkpoints hold only the adapters. Reference: the same LoRA run without the interruption."""
    base = ["--train.micro_batch_size=4", "--eval.every=0", "--log.wandb=false", "--log.progress_bar=false",
            "--log.plot=false", "--train.seq_len=32"]
    pretrain = tmp_path / "pt"
    launch(base + ["--train.max_steps=6", "--train.lr=1e-2", "--output_dir", str(pretrain)], cache,
           launcher="warm-python")
    pretrained = metrics(pretrain)[0]
    lora = base + ["--lora.r=4", "--lora.alpha=16", "--init_from", str(pretrain), "--train.max_steps=3",
                   "--train.lr=1e-2", "--train.warmup_steps=0"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    launch(lora + ["--output_dir", str(whole)], cache, launcher="warm-python")
    launch(lora + ["--output_dir", str(parts), "--train.exit_at_step=1"], cache, launcher="warm-python")
    proc = launch(lora + ["--output_dir", str(parts)], cache, launcher="warm-python")
    assert "resumed from" in proc.stderr, proc.stderr[-3000:]
    reference = metrics(whole)[0]
    # the adapters start at zero: the first LoRA step is the pretrained model's loss level, not a random model's
    assert reference[0] < pretrained[0] - 0.5, (pretrained, reference)
    assert metrics(parts)[0] == pytest.approx(reference, rel=1e-5)
