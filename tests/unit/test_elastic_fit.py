"""dstrain/run/elastic.py: the world an elastic launch trains on when the agents formed one the run cannot use."""
import json

import pytest

from dstrain.config import load_recipe, parse_overrides
from dstrain.parallel.ds_config import load
from dstrain.run import elastic


def recipe(*args):
    return load_recipe("tiny/pretrain.yaml", parse_overrides(["--train.micro_batch_size=4",
                                                              "--train.grad_accum_steps=2", *args]))


def checkpoint(run_dir, **manifest):
    step = run_dir / "checkpoints" / "step_00000005"
    step.mkdir(parents=True)
    (step / "complete.json").write_text(json.dumps({"step": 5, **manifest}))


def test_a_usable_world_is_used_whole(tmp_path):
    found = elastic.fit(3, load("zero2.json", {}), recipe(), None, "auto", tmp_path)
    assert found == elastic.Fit(3, 3, "")


def test_tensor_parallel_takes_the_largest_multiple_and_names_why(tmp_path):
    found = elastic.fit(3, load("tp2_zero1.json", {}), recipe(), None, "auto", tmp_path)
    assert (found.formed, found.used) == (3, 2)
    assert "not divisible by" in found.reason


def test_too_few_ranks_for_the_model_parallel_size_waits(tmp_path):
    found = elastic.fit(1, load("pipe2_zero1.json", {}), recipe(), None, "auto", tmp_path)
    assert found.used == 0 and "pipeline stages (2)" in found.reason


def test_the_checkpoints_global_batch_decides(tmp_path):
    """Global batch 16 with micro batches of 4: 3 data-parallel ranks cannot make it up, 2 can (accumulation 2)."""
    checkpoint(tmp_path, global_batch=16, world_size=2, data_parallel=2)
    found = elastic.fit(3, load("zero2.json", {}), recipe(), None, "auto", tmp_path)
    assert found.used == 2 and "cannot make up" in found.reason
    assert elastic.fit(4, load("zero2.json", {}), recipe(), None, "auto", tmp_path).used == 4


def test_a_tensor_parallel_checkpoint_resumes_only_on_its_own_layout(tmp_path):
    checkpoint(tmp_path, global_batch=16, world_size=4, data_parallel=2)
    assert elastic.fit(5, load("tp2_zero1.json", {}), recipe(), None, "auto", tmp_path).used == 4
    assert elastic.fit(3, load("tp2_zero1.json", {}), recipe(), None, "auto", tmp_path).used == 0


@pytest.mark.parametrize("rank,local_rank,trains,world,local", [(0, 0, True, "2", "2"), (1, 1, True, "2", "2"),
                                                                  (2, 2, False, "3", "3")])
def test_apply_narrows_the_ranks_that_train_and_leaves_out_the_rest(tmp_path, monkeypatch, capsys, rank, local_rank,
                                                                    trains, world, local):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert elastic.apply(elastic.Fit(3, 2, "world size 3 is not divisible by ..."), tmp_path) is trains
    import os
    assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"]) == (world, local)
    said = capsys.readouterr().err
    if rank == 0:
        assert "elastic: 3 ranks joined and 2 of them train; rank 2 stands by" in said
        row = json.loads((tmp_path / "events.jsonl").read_text())
        assert (row["event"], row["world_formed"], row["world_used"]) == ("fit", 3, 2)
    else:
        assert said == ""


def test_the_spare_rank_leaves_when_the_run_writes_its_summary(tmp_path):
    import threading
    import time
    threading.Timer(0.3, lambda: (tmp_path / "summary.json").write_text("{}")).start()
    began = time.monotonic()
    assert elastic.stand_by(tmp_path, poll_s=0.05) == 0
    assert time.monotonic() - began < 5


def test_a_world_no_number_of_nodes_can_train_is_bad_input_not_a_wait(tmp_path):
    """A ZeRO-2 checkpoint under Ulysses resumes on its own world only; bad values fail at any size. Waiting for
    nodes that cannot help would hang the job: one line and exit 2, as outside elastic launches."""
    from dstrain.errors import UserError
    checkpoint(tmp_path, global_batch=16, world_size=2, data_parallel=2, sequence_parallel=2)
    with pytest.raises(UserError, match="sequence_parallel_size=2"):
        elastic.fit(1, load("zero2.json", {}), recipe(), None, "auto", tmp_path)
    with pytest.raises(UserError, match="pipeline.stages=0"):
        elastic.fit(2, load("pipe2_zero1.json", {"pipeline": {"stages": 0}}), recipe(), None, "never", tmp_path / "x")


def test_a_one_rank_world_is_tried_when_only_it_fits(tmp_path):
    """Issue 58's audit: a fit that never tried a 1-rank world passed every test. A run written for 1 rank with a
    global batch of 12 (micro 4 x accumulation 3), checkpointed there; 2 ranks joined, which cannot make up 12 from
    micro batches of 4: 1 of them trains, the other stands by."""
    written = recipe("--train.grad_accum_steps=3", "--world_size=1")
    checkpoint(tmp_path, global_batch=12, world_size=1, data_parallel=1)
    found = elastic.fit(2, load("zero2.json", {}), written, None, "auto", tmp_path)
    assert (found.formed, found.used) == (2, 1), found
