"""dstrain.parallel.layout.Layout: sizes, and this rank's coordinates in DeepSpeed's own rank order."""
import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from dstrain.errors import UserError
from dstrain.parallel.layout import Layout


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


def test_a_recipe_keeps_its_global_batch_on_another_world_or_is_refused():
    """Issue 16: `python train.py --recipe llama-3.2-1b/sft` (written for 8 ranks, 8 x 4 x 4 = 128) trained at
    world 1 with a global batch of 16 without a word."""
    from dstrain.parallel.layout import keep_global_batch
    eight, one = Layout(8), Layout(1)
    assert keep_global_batch(4, 4, eight, one) == 32          # 4 x 32 x 1 = 128
    assert keep_global_batch(4, 4, eight, Layout(16)) == 2    # 4 x 2 x 16 = 128
    assert keep_global_batch(2, 1, Layout(4, tensor_parallel=2), Layout(2, tensor_parallel=2)) == 2  # dp 2 -> 1
    with pytest.raises(UserError, match=r"written for world_size 8 \(global batch 128\); on 3 ranks no "
                                        r"grad_accum_steps keeps it: 128 samples do not split over 3"):
        keep_global_batch(4, 4, eight, Layout(3))
    with pytest.raises(UserError, match=r"choose train.micro_batch_size among 1, 2, 4 \(divisors of 4\)"):
        keep_global_batch(8, 1, Layout(2), Layout(4))         # 16 on 4 ranks: 4 per rank, micro 8 cannot


def test_batch_hints_name_only_sizes_that_work():
    """Issue 16: a global batch of 8 resumed on 3 ranks suggested 'a micro_batch_size that divides 8' (none can)."""
    from dstrain.parallel.layout import batch_hint
    assert "do not split over 3 data-parallel ranks" in batch_hint(8, 3) and "1, 2, 4, 8" in batch_hint(8, 3)
    assert batch_hint(24, 3) == "choose train.micro_batch_size among 1, 2, 4, 8 (divisors of 8)"


def test_sequence_parallel_groups_are_consecutive_ranks():
    """deepspeed.runtime.sequence_parallel.parallel_state_sp: sp group i = ranks [i*sp, (i+1)*sp); its ranks read
    the same samples (one data-parallel index), hold disjoint tokens, and ZeRO spans all of them."""
    cfg = {"sequence_parallel_size": 4}
    layouts = [Layout.from_ds_config(cfg, 8, rank) for rank in range(8)]
    assert [(x.data_parallel_rank, x.sequence_parallel_rank) for x in layouts] == \
        [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    x = layouts[0]
    assert (x.data_parallel, x.samples_shared_by, x.token_replicas, x.zero_shards) == (2, 4, 1, 8)
    assert x.gradients_averaged_over == 2 and x.describe().endswith("x sequence-parallel 4")


def test_the_layout_is_the_only_reader_of_the_parallel_sizes():
    """Issue 30: the sizes were parsed from the DeepSpeed JSON in eight places; now layout.parallel_sizes only."""
    import re
    from pathlib import Path

    from dstrain.parallel.layout import parallel_sizes
    root = Path(__file__).resolve().parents[2]
    reads = re.compile(r"""\.get\(\s*["'](stages|autotp_size|sequence_parallel_size)["']""")
    offenders = [f"{p.relative_to(root)}:{i}" for p in [*(root / "dstrain").rglob("*.py"), root / "train.py"]
                 if p.name != "layout.py" for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert offenders == []
    sizes = parallel_sizes({"pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": None}})
    assert (sizes.pipeline, sizes.tensor, sizes.sequence, sizes.model) == (2, 1, 1, 2)
    for bad, key in (({"sequence_parallel_size": 0}, "sequence_parallel_size=0"),
                     ({"pipeline": {"stages": "2"}}, "pipeline.stages='2'"),
                     ({"tensor_parallel": {"autotp_size": True}}, "tensor_parallel.autotp_size=True")):
        with pytest.raises(UserError, match=re.escape(key) + " must be a positive integer"):
            parallel_sizes(bad)


def test_one_batch_policy_for_train_py_and_the_cluster_check(monkeypatch):
    """Issue 30: the cluster check refused a world train.py adapts to (it re-derives grad_accum_steps); both now
    call layout.recipe_accumulation, and the global batch is computed by Layout.global_batch only."""
    import re
    from pathlib import Path

    from dstrain import cluster
    from dstrain.cluster import world_report
    from dstrain.errors import UserError as Unreachable
    from dstrain.parallel.layout import recipe_accumulation

    def offline(*args):  # the Hub model's config is only needed for ZeRO-3 bucket sizes (a lookup took 70 s)
        raise Unreachable("no network here")
    monkeypatch.setattr(cluster, "load_config", offline)
    report = world_report(2, ["--recipe", "llama-3.2-1b/sft.yaml"])
    assert "global batch 128 = micro 4 x accum 16 x data-parallel 2" in report
    assert report.endswith("(the recipe was written for world_size 8; on 2 grad_accum_steps 4 -> 16 keeps its "
                           "global batch of 128)")
    assert recipe_accumulation(Layout(2), {}, 4, 4, 8, None)[0] == 16  # what train.py trains with on 2 ranks
    with pytest.raises(UserError, match="on 3 ranks no grad_accum_steps keeps it"):
        world_report(3, ["--recipe", "llama-3.2-1b/sft.yaml"])
    assert "accum 4 x data-parallel 3" in world_report(3, ["--recipe", "llama-3.2-1b/sft.yaml", "--world_size", "3"])
    root = Path(__file__).resolve().parents[2]
    product = re.compile(r"micro_batch_size \* .*grad_accum_steps|grad_accum_steps \* .*data_parallel")
    offenders = [f"{p.relative_to(root)}:{i}" for p in [*(root / "dstrain").rglob("*.py"), root / "train.py"]
                 if p.name != "layout.py" for i, line in enumerate(p.read_text().splitlines(), 1)
                 if product.search(line)]
    assert offenders == []
