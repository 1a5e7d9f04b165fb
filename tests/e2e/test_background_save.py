"""Checkpoints written in the background (checkpoint.background, on by default): training goes on while the files
are written, the checkpoint holds the state of its own step, a kill -9 during the write leaves the previous one
as the one resume picks, and a failed write is said and tried again. Each run is compared, step by step, with
the plain single-process loop (tests/helpers.py: reference_losses), what an uninterrupted run computes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dstrain.parallel.dist import DistContext
from dstrain.run.checkpoint import verify
from tests.helpers import launch, metrics, reference_losses

ARGS = ["--train.max_steps=12", "--train.lr=3e-3", "--train.warmup_steps=3", "--train.micro_batch_size=4",
        "--train.grad_accum_steps=2", "--train.seq_len=64", "--train.precision=fp32", "--eval.every=0",
        "--log.wandb=false", "--log.progress_bar=false", "--ds_config", "zero2.json", "--checkpoint.every=4",
        "--fault.heartbeat_interval=0.5"]


def uninterrupted(run: Path, tiny_llama: Path) -> list[float]:
    """ARGS' 12 steps in the plain loop (the recipe's min_lr_ratio and weight decay, 0.1)."""
    return reference_losses(tiny_llama, run, 12, 3e-3, 3, 0.1, weight_decay=0.1)[0]


def test_the_checkpoint_holds_its_step_and_a_kill_during_the_next_write_resumes_from_it(tmp_path, cache, tiny_llama):
    """Step 4's files are written slowly (1 s a file) while steps 5 and 6 run (step 6 slowed to 4 s, so the write
    ends during it): the optimizer changes the weights and moments in place meanwhile, so a checkpoint that did not
    copy them at step 4 holds a later state and its resume departs from the uninterrupted losses. The copy of the
    engine's state, deferred to the next step's forward and backward, is slowed too (2 s): step 5's update must
    wait for it. Step 8's write is still going (30 s a file) when rank 1 is killed at step 10: step 8 is not
    complete, and resume takes 4."""
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run)]
    fault = ("save:copy:slow:seconds=2:step=4;save:write:slow:seconds=1:step=4;step:slow:seconds=4:step=6;"
             "save:write:slow:seconds=30:step=8;step:kill:rank=1:step=10")
    first = launch(args, cache, check=False, DSTRAIN_FAULT=fault)
    assert first.returncode != 0, first.stderr[-3000:]
    assert "checkpoints: written in the background" in first.stderr, first.stderr[-3000:]
    overlap = re.search(r"checkpoint step_00000004 complete: written in the background in [\d.]+ s while steps "
                        r"5-(\d+) ran", first.stderr)
    assert overlap and int(overlap.group(1)) >= 6, first.stderr[-3000:]  # training went on during the write
    waited = re.search(r"the step waited ([\d.]+) s for its copy", first.stderr[overlap.start():])
    assert waited and float(waited.group(1)) >= 1.5, first.stderr[-3000:]  # step 5's update waited for the copy
    assert not (run / "checkpoints" / "step_00000008").exists()
    assert (run / "checkpoints" / ".tmp-step_00000008").is_dir()  # the write the kill interrupted

    resumed = launch(args, cache)
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in resumed.stderr
    got = metrics(run)[0]
    assert len(got) == 12 and got == pytest.approx(uninterrupted(run, tiny_llama), rel=1e-5, abs=0)


def test_a_failed_background_write_is_said_and_the_next_save_tries_again(tmp_path, cache, tiny_llama):
    """Also: the run's last save (step 12) is written at once, with no host copy, so a fault in the background
    writer at that step never fires (through the writer, it failed the run: a failure of the last save raises).
    And step 8 is published only once every rank's writer is done: rank 1 writes its files slowly (1 s each)
    while rank 0's are done at once; published when any one writer was done, complete.json listed rank 0's files
    only (rank 1's was not written yet) and the resume of step 8 would fail (seen: this test failed so)."""
    run = tmp_path / "run"
    proc = launch(ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run)], cache,
                  DSTRAIN_FAULT="save:write:enospc:rank=1:step=4;save:write:enospc:rank=1:step=12;"
                                "save:copy:enospc:rank=1:step=12;save:write:slow:seconds=1:rank=1:step=8")
    said = [line for line in proc.stderr.splitlines() if "could not save checkpoint step_00000004" in line]
    assert len(said) == 1 and "No space left on device" in said[0] and "the next save tries again" in said[0], \
        proc.stderr[-3000:]
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000008", "step_00000012"]
    assert not list(checkpoints.glob(".tmp-*"))  # the failed write's files were removed
    listed = {step: set(json.loads((checkpoints / step / "complete.json").read_text())["files"])
              for step in ("step_00000008", "step_00000012")}
    assert listed["step_00000008"] == listed["step_00000012"]  # every rank's files, as the last (written at once)
    assert verify(checkpoints / "step_00000008", DistContext(0, 0, 1)) == []
    got = metrics(run)[0]
    assert len(got) == 12 and got == pytest.approx(uninterrupted(run, tiny_llama), rel=1e-5, abs=0)


def test_every_auto_says_the_interval_it_chose(tmp_path, cache, tiny_llama):
    """checkpoint.every=auto: a first save at step 5 measures the stall, then Young/Daly's interval for the job's
    mean time between failures (a tiny one here, so that the interval falls inside the run)."""
    run = tmp_path / "run"
    proc = launch(ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run), "--checkpoint.every=auto",
                          "--fault.mtbf_hours=0.0005", "--checkpoint.keep_last=20", "--train.max_steps=20"], cache,
                  launcher="warm-python")
    chose = re.search(r"checkpoint.every=auto: every ([\d,]+) steps .* a failure costs about", proc.stderr)
    assert chose, proc.stderr[-3000:]
    every = int(chose.group(1).replace(",", ""))
    want = sorted({5, 20} | {s for s in range(every, 21, every) if s > 5})
    assert sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")) == want
