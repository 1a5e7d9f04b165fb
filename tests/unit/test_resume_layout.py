"""resume.adapt_to_world on sequence-parallel checkpoints: the same sp size is required; another data-parallel size
is served by universal conversion of ZeRO-3's per-rank files only (tests/e2e/test_sequence_parallel.py resumes a
ZeRO-3 sp run on twice the ranks); ZeRO-0/1/2's files are refused in one line before anything is converted."""
import pytest

from dstrain.config import TrainConfig
from dstrain.errors import UserError
from dstrain.layout import Layout
from dstrain.resume import Resume, adapt_to_world

TRAIN = TrainConfig(micro_batch_size=4, grad_accum_steps=2)


def checkpoint(tmp_path, files, **manifest):
    path = tmp_path / f"step_{len(list(tmp_path.iterdir())):08d}"
    path.mkdir()
    for name in files:
        (path / name).write_bytes(b"")
    return Resume(path, {"global_batch": 8, "data_parallel": 1, "world_size": 2, "sequence_parallel": 2} | manifest)


def test_zero3_sequence_parallel_checkpoint_converts_for_more_ranks(tmp_path):
    ckpt = checkpoint(tmp_path, ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    train, resume = adapt_to_world(ckpt, TRAIN, Layout(4, sequence_parallel=2), log=lambda _: None)
    assert train.grad_accum_steps == 1 and resume.universal


def test_zero2_sequence_parallel_checkpoint_stays_on_its_world(tmp_path):
    ckpt = checkpoint(tmp_path, ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    assert adapt_to_world(ckpt, TRAIN, Layout(2, sequence_parallel=2))[0] == TRAIN  # same world: as saved
    with pytest.raises(UserError, match="resumes only on the same world size: launch 2 ranks, or train with a ZeRO-3"):
        adapt_to_world(ckpt, TRAIN, Layout(4, sequence_parallel=2), log=lambda _: None)


def test_another_sequence_parallel_size_is_refused(tmp_path):
    ckpt = checkpoint(tmp_path, ["zero_pp_rank_0_mp_rank_00_model_states.pt"])
    with pytest.raises(UserError, match="trained with sequence_parallel_size=2 and this run has 4"):
        adapt_to_world(ckpt, TRAIN, Layout(4, sequence_parallel=4))
    plain = checkpoint(tmp_path, [], sequence_parallel=1)
    with pytest.raises(UserError, match="trained with sequence_parallel_size=1 and this run has 2"):
        adapt_to_world(plain, TRAIN, Layout(2, sequence_parallel=2))
