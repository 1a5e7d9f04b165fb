"""dstrain.layout.Layout: sizes, and this rank's coordinates in DeepSpeed's own rank order."""
import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from dstrain.errors import UserError
from dstrain.layout import Layout


def test_sizes_from_a_deepspeed_config():
    assert Layout.from_ds_config({}, 8).data_parallel == 8
    pipe = Layout.from_ds_config({"pipeline": {"stages": 2}}, 8)
    assert (pipe.data_parallel, pipe.samples_shared_by, pipe.is_pipeline, pipe.splits_model) == (4, 2, True, True)
    tp = Layout.from_ds_config({"tensor_parallel": {"autotp_size": 4}}, 8)
    assert (tp.data_parallel, tp.samples_shared_by, tp.is_pipeline, tp.splits_model) == (2, 4, False, True)
    with pytest.raises(UserError, match="world size 6 is not divisible by pipeline stages \\(4\\)"):
        Layout.from_ds_config({"pipeline": {"stages": 4}}, 6)


@pytest.mark.parametrize("stages,world", [(2, 4), (2, 8), (4, 8)])
def test_pipeline_coordinates_follow_deepspeeds_topology(stages, world):
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=world // stages)
    for rank in range(world):
        layout = Layout(world, pipeline_stages=stages, rank=rank)
        coord = topology.get_coord(rank)
        assert (layout.pipeline_stage, layout.data_parallel_rank) == (coord.pipe, coord.data), rank


def test_tensor_parallel_coordinates_follow_the_autotp_mesh():
    # deepspeed.utils.groups._init_tp_mesh_device: a (data_parallel, tensor_parallel) mesh, row-major
    # (tests/unit/test_ds_internals.py checks that order in DeepSpeed's source)
    coords = [(Layout(8, tensor_parallel=2, rank=r).data_parallel_rank, Layout(8, tensor_parallel=2, rank=r)
               .tensor_parallel_rank) for r in range(8)]
    assert coords == [(r // 2, r % 2) for r in range(8)]


def test_data_parallel_only():
    assert [Layout(4, rank=r).data_parallel_rank for r in range(4)] == [0, 1, 2, 3]
