"""DiLoCo's settings and layout: every bad input is one line before anything is built; the replica arithmetic."""
from pathlib import Path

import pytest
from transformers import AutoConfig

from dstrain import components
from dstrain.components.diloco import replicas_for
from dstrain.config import load_recipe, parse_overrides
from dstrain.errors import UserError
from dstrain.parallel.dist import DistContext
from dstrain.parallel.ds_config import DeviceCaps, load, resolve
from dstrain.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[2]


def validate(overrides: list[str], ds: str = "zero2.json", world: int = 4, ranks_per_node: int = 2):
    recipe = load_recipe("tiny/pretrain", parse_overrides(overrides))
    raw = load(ds)
    layout = Layout.from_ds_config(raw, world, replicas=replicas_for(recipe, world, ranks_per_node))
    setup = components.Setup(recipe, layout, raw, "fp32", AutoConfig.from_pretrained(ROOT / "recipes/tiny/model"),
                             Path("/nonexistent"), DistContext(0, 0, world), print)
    components.validate_all(components.build(recipe, raw), setup)
    return layout


@pytest.mark.parametrize("overrides,ds,world,message", [
    (["--diloco.every=500"], "zero2.json", 4, "diloco.every=500 is more than train.max_steps=150"),
    (["--diloco.every=50", "--diloco.warmup_steps=150"], "zero2.json", 4,
     "diloco.warmup_steps=150 is not less than train.max_steps=150"),
    (["--diloco.every=5", "--diloco.replicas=3"], "zero2.json", 4, "diloco.replicas=3 does not divide the 4"),
    (["--diloco.every=5"], "zero2.json", 2, "needs at least 2 replicas, but the 2 ranks form 1"),
    (["--diloco.every=5", "--compression.method=powersgd"], "zero1.json", 4,
     "compression.method=powersgd compresses the every-step gradient all-reduce"),
    (["--diloco.every=20"], "zero2.json", 4, r"eval.every=50 must be a multiple of diloco.every=20 .*eval.every=40"),
    (["--diloco.every=10", "--checkpoint.every=auto"], "zero2.json", 4, "checkpoint.every=auto must be a multiple"),
    (["--diloco.every=5", "--diloco.fragments=6"], "zero2.json", 4,
     "diloco.fragments=6 is more than diloco.every=5: .* choose diloco.fragments <= 5"),
    (["--diloco.every=5", "--diloco.fragments=5", "--diloco.overlap=5"], "zero2.json", 4,
     "diloco.overlap=5 is not less than diloco.every=5: .* choose diloco.overlap < 5"),
])
def test_bad_settings_are_one_line_before_anything_is_built(overrides, ds, world, message):
    with pytest.raises(UserError, match=message) as error:
        validate(overrides, ds, world)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("key,value", [("dtype", "int3"), ("every", "-1"), ("outer_lr", "0"),
                                       ("outer_momentum", "1"), ("warmup_steps", "-5"), ("fragments", "0"),
                                       ("overlap", "-1"), ("mix", "1.5")])
def test_bad_values_are_refused_when_the_recipe_loads(key, value):
    with pytest.raises(UserError, match=f"diloco.{key}"):
        load_recipe("tiny/pretrain", parse_overrides([f"--diloco.{key}={value}"]))


def test_streaming_needs_no_eval_or_checkpoint_at_the_syncs():
    """With fragments or overlap no step has every replica on the shared weights, so evaluations and checkpoints
    may come at any step (a checkpoint keeps the syncs in flight: the e2e test)."""
    validate(["--diloco.every=20", "--diloco.fragments=4", "--checkpoint.every=auto"])
    validate(["--diloco.every=20", "--diloco.overlap=1"])


def test_fragments_cut_the_model_in_blocks_and_sync_at_staggered_steps():
    """diloco.fragments: consecutive INT8_BLOCK-aligned pieces covering the model once; each fragment syncs once
    per diloco.every steps, at its own step, the last at the multiples of every (one fragment: the whole model
    there, as without streaming)."""
    from dstrain.components.diloco import INT8_BLOCK, due, fragment_bounds

    assert fragment_bounds(1000, 1) == [0, 1000]
    bounds = fragment_bounds(1000, 3)
    assert bounds == [0, 256, 640, 1000] and all(b % INT8_BLOCK == 0 for b in bounds[:-1])
    assert fragment_bounds(100, 3) == [0, 0, 0, 100]  # smaller than a block: the last one holds it all
    for every, fragments in ((4, 3), (10, 4), (5, 5), (7, 1)):
        sends = [due(step, every, fragments) for step in range(1, 3 * every + 1)]
        assert all(len(s) <= 1 for s in sends)  # one fragment at a time
        for p in range(fragments):  # each once per interval, every `every` steps
            steps = [i + 1 for i, s in enumerate(sends) if p in s]
            assert len(steps) == 3 and steps[1] - steps[0] == every == steps[2] - steps[1], (every, fragments, p)
        assert due(every, every, fragments) == [fragments - 1]
    assert [due(s, 4, 3) for s in range(1, 9)] == [[0], [1], [], [2], [0], [1], [], [2]]


def test_one_replica_per_node_by_default_and_the_replica_arithmetic():
    layout = validate(["--diloco.every=10"], world=4, ranks_per_node=2)
    assert layout.replicas == 2 and layout.replica_size == 2
    assert layout.data_parallel == 4 and layout.replica_data_parallel == 2 == layout.gradients_averaged_over
    assert layout.zero_shards == 2  # ZeRO partitions within a replica
    ranks = [Layout(4, rank=r, replicas=2) for r in range(4)]
    assert [(x.replica, x.replica_data_parallel_rank, x.data_parallel_rank) for x in ranks] == \
        [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert replicas_for(load_recipe("tiny/pretrain", {}), 4, 2) == 1  # off: one replica, the world


def test_pipeline_stages_inside_replicas_of_consecutive_ranks():
    """ds_internals.pipeline_in_replicas' topology [replica, pipe, data]: 8 ranks, 2 replicas of 2 stages x 2
    data-parallel ranks; without replicas DeepSpeed's own order (rank = stage x dp + dp_rank)."""
    from dstrain.parallel.ds_internals import pipeline_in_replicas

    ranks = [Layout(8, pipeline_stages=2, rank=r, replicas=2) for r in range(8)]
    assert [(x.replica, x.pipeline_stage, x.data_parallel_rank, x.replica_data_parallel_rank) for x in ranks] == [
        (0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 0), (0, 1, 1, 1), (1, 0, 2, 0), (1, 0, 3, 1), (1, 1, 2, 0), (1, 1, 3, 1)]
    topology = pipeline_in_replicas(2)[1](2, 2)  # the same arithmetic as DeepSpeed's grid reads it
    for x in ranks:
        coord = topology.get_coord(x.rank)
        assert (coord.replica, coord.pipe, coord.data) == (x.replica, x.pipeline_stage, x.replica_data_parallel_rank)
    assert topology.get_axis_comm_lists("data") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # inside a replica
    assert topology.get_axis_comm_lists("pipe") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.get_rank_repr(rank=5) == ""  # layer files named as without replicas
    plain = [Layout(4, pipeline_stages=2, rank=r) for r in range(4)]
    assert [(x.pipeline_stage, x.data_parallel_rank) for x in plain] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_deepspeed_sees_one_replicas_share_of_the_global_batch():
    recipe = load_recipe("tiny/pretrain", parse_overrides(["--diloco.every=10", "--diloco.replicas=2"]))
    cfg = resolve(load("zero2.json"), recipe, 4, DeviceCaps("cpu", bf16=True, fp16=False), replicas=2)
    assert cfg["train_batch_size"] == 8 * 1 * 2  # micro 8 x accumulation 1 x the replica's 2 ranks


@pytest.mark.parametrize("dtype,bound", [("bf16", 2 ** -8), ("int8", 1 / 127), ("int4", 1 / 7)])
def test_what_is_sent_plus_what_is_carried_is_the_pseudo_gradient(dtype, bound):
    """Error feedback: the decoded payload and the carry add up to what was to be sent, and the payload is
    within the format's rounding of it (int8/int4: half a step of the block's scale / 127 or / 7), and equal to
    the reference loop's own rounding (tests/helpers.py)."""
    import torch

    from dstrain.components.diloco import INT8_BLOCK, decode, encode
    from tests.helpers import _int_round

    values = torch.randn(1000) * torch.logspace(-6, 0, 1000)
    payload = encode(values, dtype)
    sent = decode(payload, dtype, values.numel())
    carry = values - sent
    assert torch.equal(sent + carry, values)
    blocks = torch.nn.functional.pad(values.abs(), (0, -1000 % INT8_BLOCK)).view(-1, INT8_BLOCK).amax(1)
    worst = (carry.abs() / blocks.repeat_interleave(INT8_BLOCK)[:1000]).max() if dtype != "bf16" else \
        (carry.abs() / values.abs()).max()
    assert 0 < worst <= bound / 2 if dtype != "bf16" else 0 < worst <= bound
    if dtype != "bf16":
        assert torch.allclose(sent, _int_round(values, round(1 / bound)), rtol=0, atol=1e-7 * float(blocks.max()))
    sizes = sum(t.numel() * t.element_size() for t in payload)
    assert sizes == {"bf16": 2000, "int8": 1024 + 8 * 4, "int4": 512 + 8 * 4}[dtype]


def _diloco_checkpoint(tmp_path, world=2, replicas=2, global_batch=24):
    from dstrain.run.checkpoint import Resume
    path = tmp_path / "step_00000003"
    path.mkdir(exist_ok=True)
    return Resume(path, {"global_batch": global_batch, "data_parallel": world, "world_size": world,
                         "sequence_parallel": 1, "replicas": replicas})


def test_whole_replicas_join_and_leave_on_resume_and_other_sizes_are_refused(tmp_path):
    from dstrain.config import TrainConfig
    from dstrain.errors import UserError
    from dstrain.parallel.layout import Layout
    from dstrain.run.resume import adapt_to_world

    said = []
    train = TrainConfig(micro_batch_size=4, grad_accum_steps=3)
    ckpt = _diloco_checkpoint(tmp_path)
    assert adapt_to_world(ckpt, train, Layout(2, replicas=2), said.append) == (train, ckpt)  # as saved
    grown, resume = adapt_to_world(ckpt, train, Layout(3, replicas=3), said.append)
    assert grown.grad_accum_steps == 2 and not resume.universal  # each replica's engine loads as saved
    assert said == ["DiLoCo replicas changed from 2 to 3: replica 2 (a copy of replica 0) joined; shared weights "
                    "and outer momentum kept, the carried rounding reset; grad_accum_steps 3 -> 2 keeps the global "
                    "batch at 24"]
    shrunk, _ = adapt_to_world(_diloco_checkpoint(tmp_path, world=4, replicas=4), train, Layout(2, replicas=2),
                               said.append)
    assert shrunk.grad_accum_steps == 3 and "replica 2, 3 left, its inner state dropped" in said[-1]
    with pytest.raises(UserError, match=r"holds DiLoCo replicas of 1 rank\(s\) and this run makes replicas of 2; "
                                        r"add or remove whole replicas"):
        adapt_to_world(ckpt, train, Layout(4, replicas=2))
    with pytest.raises(UserError, match="was trained with DiLoCo \\(2 replicas\\); resume it with the diloco section"):
        adapt_to_world(ckpt, train, Layout(2))
    with pytest.raises(UserError, match="was trained without DiLoCo; resume it with diloco.every=0"):
        adapt_to_world(_diloco_checkpoint(tmp_path, replicas=1), train, Layout(2, replicas=2))
    with pytest.raises(UserError, match="cannot make up"):  # 24 samples over 5 replicas of micro-batches of 4
        adapt_to_world(ckpt, train, Layout(5, replicas=5))
    with pytest.raises(UserError, match="was trained with a global batch of 24 samples, this run has 16"):
        adapt_to_world(ckpt, TrainConfig(micro_batch_size=4, grad_accum_steps=2), Layout(2, replicas=2))


def test_each_rank_keeps_its_slice_of_the_outer_state_and_resumes_it_on_another_world(tmp_path):
    """The outer state (shared weights, momentum, carried rounding) is cut into a replica's S slices, one per rank:
    on another world (a replica joined or left) rank r loads the file of the rank that held its slice in replica 0
    (its index in its replica), not rank 0's, which holds slice 0 only. A checkpoint from before the cut (the whole
    model's state on every rank) is cut on load."""
    import torch

    from dstrain.components.diloco import Diloco, slice_length
    from dstrain.config import DilocoSection
    from dstrain.run.checkpoint import Checkpointer

    n, size = 300, 2
    chunk = slice_length(n, size)  # 256: slice 0 is [0, 256), slice 1 [256, 300)
    whole = torch.arange(n, dtype=torch.float32)
    path = tmp_path / "step_00000003"
    path.mkdir()
    for rank in range(4):  # 2 replicas of 2 ranks saved their slices
        i = rank % size
        part = whole[i * chunk:min(n, (i + 1) * chunk)]
        flights = [{"lo": 128, "hi": 300, "lands": 5, "mix": 0.5, "mean": part[max(0, 128 - i * chunk):] * 2 + i}]
        torch.save({"anchor": part + 1000 * rank, "momentum": -part, "carry": part * 0 + rank, "flights": flights},
                   path / f"diloco_rank{rank}.pt")
    resume = _diloco_checkpoint(tmp_path, world=4, replicas=2)
    for rank in range(6):  # resumed on 3 replicas of 2
        outer = Diloco(DilocoSection(every=3))

        class Unit:
            layout = Layout(6, rank=rank, replicas=3)

        outer.unit, outer.numel = Unit(), n
        i = rank % size
        outer.mine = slice(i * chunk, min(n, (i + 1) * chunk))
        outer.anchor = torch.zeros(outer.mine.stop - outer.mine.start)
        checkpointer = Checkpointer.__new__(Checkpointer)
        checkpointer.ctx = DistContext(rank, rank, 6)
        checkpointer._load_extra(resume, "diloco", outer)
        assert torch.equal(outer.anchor, whole[outer.mine] + 1000 * i), rank  # the same slice, from rank i's file
        assert torch.equal(outer.momentum, -whole[outer.mine]) and outer.carry is None
        # a streaming sync in flight (its replicas' mean) lands on every replica: the slice's, kept
        (flight,) = outer.flights
        assert (flight.lo, flight.hi, flight.lands, flight.mix) == (128, 300, 5, 0.5)
        assert torch.equal(flight.pseudo, whole[max(128, outer.mine.start):outer.mine.stop] * 2 + i), rank

    torch.save({"anchor": whole, "momentum": None, "carry": torch.ones(n - chunk)}, path / "diloco_rank1.pt")
    outer.load_state_dict(torch.load(path / "diloco_rank1.pt"), same_world=True)  # the whole model's: cut
    assert torch.equal(outer.anchor, whole[chunk:]) and outer.momentum is None and torch.equal(outer.carry,
                                                                                              torch.ones(n - chunk))
    with pytest.raises(RuntimeError, match="the checkpoint's shared weights have 10 elements; this rank's slice has "
                                           "44 of 300"):
        outer.load_state_dict({"anchor": torch.zeros(10), "momentum": None, "carry": None}, same_world=True)


def _sync_worker(rank: int, store: str, dtype: str, bucket: int, device: str = "cpu", home: str = "cpu") -> None:
    """One of 4 gloo ranks in 2 replicas of 2: three parameters (877 elements: slices [0, 512) and [512, 877), cut
    into buckets of `bucket`), two syncs after each replica moved its weights its own way; the weights after each
    are the outer step written out by hand over the whole vector (torch.optim.SGD's Nesterov, the rounding
    carried). device: the weights' and the collectives'; home: the outer state's (tests/gpu: "cuda" and "cpu", as
    with an offloaded optimizer on a GPU)."""
    import torch
    import torch.distributed as tdist

    from dstrain.components import diloco
    from dstrain.config import DilocoSection
    from dstrain.parallel import ds_internals

    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    diloco.BUCKET = bucket
    unit = ds_internals.ReplicaUnit(Layout(4, rank=rank, replicas=2))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(device)) for shape in ((3, 100), (77,), (5, 100))]
    lr, mu = 0.7, 0.9
    outer = diloco.Diloco(DilocoSection(every=2, dtype=dtype, outer_lr=lr, outer_momentum=mu))
    outer.unit, outer.params, outer.numel = unit, params, 877
    outer.home, outer.comm = torch.device(home), torch.device(device)
    size, index = unit.get_data_parallel_world_size(), unit.get_data_parallel_rank()
    chunk = diloco.slice_length(877, size)
    outer.mine = slice(min(877, index * chunk), min(877, (index + 1) * chunk))
    outer.anchor = outer._read()
    flat = lambda: torch.cat([p.detach().reshape(-1).cpu() for p in params])  # noqa: E731
    anchor, buf, carry = flat(), None, [torch.zeros(877), torch.zeros(877)]
    for sync in range(2):
        moved = []
        for k in range(2):  # each replica's own weights now
            moved.append(anchor + torch.randn(877, generator=torch.Generator().manual_seed(10 * sync + k)) * 0.01)
        with torch.no_grad():
            for p, value in zip(params, moved[unit.layout.replica].split([p.numel() for p in params])):
                p.copy_(value.view_as(p))
        assert outer.anchor.device.type == home
        outer.sync()
        mean = torch.zeros(877)
        for k in range(2):
            pseudo = anchor - moved[k] + carry[k]
            sent = pseudo if dtype == "fp32" else diloco.decode(diloco.encode(pseudo, dtype), dtype, 877)
            carry[k] = pseudo - sent if dtype != "fp32" else carry[k]
            mean += sent
        mean /= 2
        buf = mean.clone() if buf is None else buf.mul_(mu).add_(mean)
        anchor = anchor - lr * (mean + mu * buf)
        assert torch.allclose(flat(), anchor, rtol=0, atol=1e-6), (rank, sync, (flat() - anchor).abs().max())
    tdist.destroy_process_group()


@pytest.mark.parametrize("dtype,bucket", [("int4", 128), ("fp32", 256)])
def test_the_sync_in_buckets_across_replicas_of_two_ranks_is_the_outer_step(tmp_path, dtype, bucket):
    """The sync's collectives go a bucket (diloco.BUCKET elements) at a time, across replicas and within one, and
    parameters straddle both the slices and the buckets: the weights after two syncs are the outer step written out
    by hand (a bucket's pieces put in the wrong place, one dropped, or the carried rounding of one bucket written
    over another's all move them by more than the bound)."""
    import torch.multiprocessing as mp

    mp.start_processes(_sync_worker, args=(str(tmp_path / "store"), dtype, bucket), nprocs=4, start_method="fork")
