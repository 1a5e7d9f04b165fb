"""A run stopped at step k and resumed gives the per-step losses of an uninterrupted run, and resume
never picks an interrupted or torn checkpoint."""
import json
import shutil

import pytest

from tests.helpers import launch, metrics, processes_below, reference_losses

ARGS = ["--train.max_steps=12", "--train.lr=3e-3", "--train.warmup_steps=3", "--train.micro_batch_size=4",
        "--train.grad_accum_steps=2", "--train.seq_len=64", "--train.precision=fp32", "--eval.every=4",
        "--eval.max_batches=2", "--log.wandb=false", "--log.progress_bar=false", "--ds_config", "zero3.json"]


def test_stop_and_resume_matches_uninterrupted(tmp_path, cache, tiny_llama):
    """Stopped at step 7 and resumed past a torn and an unpublished checkpoint: the per-step losses and the last
    evaluation are the plain single-process loop's (reference_losses, reference_eval: what an uninterrupted run
    computes, without the launch that cost the suite 17 s)."""
    from tests.helpers import reference_eval

    model = [f"--model.name_or_path={tiny_llama}"]
    split = tmp_path / "split"
    launch(ARGS + model + ["--output_dir", str(split), "--checkpoint.every=5", "--train.exit_at_step=7"], cache)
    ckpts = split / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000005", "step_00000007"]
    assert not (split / "hf").exists(), "a run stopped early must not export"
    # Debris a crash could leave: a save interrupted before publication, and a directory lacking its
    # completion record. Neither may be chosen; step 7 must be.
    shutil.copytree(ckpts / "step_00000007", ckpts / ".tmp-step_00000010")
    shutil.copytree(ckpts / "step_00000007", ckpts / "step_00000011")
    (ckpts / "step_00000011" / "complete.json").unlink()
    # the first attempt logged past its last checkpoint; those rows must be replaced, not duplicated
    with open(split / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 8, "loss": 99.0}) + "\n")

    proc = launch(ARGS + model + ["--output_dir", str(split), "--checkpoint.every=5", "--checkpoint.keep_last=2"],
                  cache)
    assert f"resumed from {ckpts / 'step_00000007'} at step 7" in proc.stderr
    assert "reused tokenized data" in proc.stderr

    want, ref_model = reference_losses(tiny_llama, split, 12, 3e-3, 3, 0.1, weight_decay=0.1)
    got, got_evals = metrics(split)
    assert len(got) == 12
    assert got == pytest.approx(want, rel=2e-5, abs=0)  # another reduction order (ZeRO-3 on 2 ranks)
    assert [e["step"] for e in got_evals] == [0, 4, 8, 12]  # step 8's evaluation after the resume, once
    assert got_evals[-1]["eval_loss"] == pytest.approx(reference_eval(ref_model, split, 2, 4, 2), rel=2e-5)
    # keep_last=2 complete checkpoints remain: 10 and 12; the foreign debris was left alone or replaced
    complete = sorted(p.name for p in ckpts.glob("step_*") if (p / "complete.json").exists())
    assert complete == ["step_00000010", "step_00000012"]
    assert (ckpts / "latest").read_text().strip() == "step_00000012"
    assert (split / "hf" / "model.safetensors").exists()


def test_resume_is_exact_with_dropout(tmp_path, cache, tiny_gpt2_dropout):
    """Issue 16: every other resume test uses models without dropout, so a resume that restored a fixed seed
    instead of each rank's saved RNG state still passed them. With dropout the step's randomness is the RNG's.
    The stopped and resumed runs also replay every step's first micro-batch (fault.sdc_check_every=1): the replay
    draws the step's dropout masks (else every replay differs and the run stops as corrupt) and leaves the
    generators as they were (else the losses leave the uninterrupted run's)."""
    from tests.helpers import assert_resume_exact
    assert_resume_exact(tmp_path, cache, tiny_gpt2_dropout, "zero2.json", ("--fault.sdc_check_every=1",))


def test_finished_run_does_not_train_again(tmp_path, cache, tiny_llama):
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run), "--train.max_steps=3"]
    launch(args, cache, launcher="warm-python")
    before = (run / "metrics.jsonl").read_text()
    hf_mtime = (run / "hf" / "model.safetensors").stat().st_mtime_ns
    proc = launch(args, cache, launcher="warm-python")
    # issue 85: it says so in one line (before, it resumed at step 3 and rewrote summary.json and the run's files)
    assert f"{run} holds this run finished at step 3 (train.max_steps=3); nothing to do" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before
    assert (run / "hf" / "model.safetensors").stat().st_mtime_ns == hf_mtime


def test_sigterm_to_one_rank_checkpoints_exits_75_and_resumes_exactly(tmp_path, cache, tiny_llama):
    """A spot VM's or scheduler's SIGTERM reaching one rank: both ranks agree on the step, save it, and the
    launcher exits 75 (try again); the resumed run's losses are the plain single-process loop's (reference_losses:
    what an uninterrupted run computes, without a launch). Fails fast and leaves nothing running: without the
    ranks' vote the signalled rank saves alone while the other trains on, both alive in collectives that never
    pair; the watchdog's 30 s stall timeout ends the job (seen: exit 1, the test failed in 51 s where it hung 300 s
    before), and the launcher's process tree is killed whatever happens."""
    import signal
    import subprocess
    import time

    from tests.helpers import BIN, ROOT, env, free_port, kill_tree

    steps = 40  # long enough that the signal lands mid-run (a step takes tens of ms; the stop comes 1-2 steps later)
    args = ARGS + [f"--model.name_or_path={tiny_llama}", f"--train.max_steps={steps}", "--eval.every=0",
                   "--checkpoint.every=0"]
    run = tmp_path / "run"
    proc = subprocess.Popen([BIN / "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
                             *args, "--output_dir", str(run), "--fault.stall_timeout=30"], cwd=ROOT, env=env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (run / "metrics.jsonl").exists() or len(metrics(run)[0]) < 2:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        rank1 = processes_below(proc.pid, "train.py", "--local_rank=1")
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)  # a step and a save; the watchdog's 30 s if the ranks disagree
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 75, err[-4000:]
    stopped_at = len(metrics(run)[0])
    assert 2 <= stopped_at < steps
    assert f"stopped at step {stopped_at} (another rank was signalled)" in err
    assert (run / "checkpoints" / f"step_{stopped_at:08d}" / "complete.json").exists()

    resumed = launch(args + ["--output_dir", str(run)], cache)
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped_at:08d}'}" in resumed.stderr
    want, _ = reference_losses(tiny_llama, run, steps, 3e-3, 3, 0.1, weight_decay=0.1)
    got = metrics(run)[0]
    assert len(got) == steps and got == pytest.approx(want, rel=2e-5, abs=0)
