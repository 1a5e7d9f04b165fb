"""dstrain.components.compile: decoder blocks compiled in a background thread while training runs eager, then switched.

Reference: the same model trained eager in the same process. Checked: training is never blocked (the first
steps run before the compile ends), the switch happens at a step boundary and only after the thread finished,
one graph serves every block and nothing recompiles after the switch, inductor really generated kernels,
losses and weights follow the eager run to fp32 roundoff, evaluation stays eager, and a failed compile leaves
training eager with a warning.
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.fixture
def inductor_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield tmp_path / "inductor"
    torch._dynamo.reset()


def test_background_compile_switches_at_a_step_boundary_and_matches_eager(inductor_dir):
    from torch._dynamo.utils import counters

    from dstrain.components.compile import RegionalCompile, blocks_of

    eager, model = _model(), _model()
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)  # SGD: weights move with the gradients themselves
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    blocks = blocks_of(model)
    assert len(blocks) == 3
    regional = RegionalCompile(blocks, wait=False)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    said, want, got = [], [], []
    for step in (1, 2):  # eager steps: nothing compiles during step 1, the thread starts after it
        want.append(_step(eager, eager_opt, ids))
        got.append(_step(model, opt, ids))
        assert (regional.thread is None) == (step == 1), "the compile must not start inside step 1"
        regional.poll(step, said.append)
        assert regional.thread.is_alive(), "the step waited for the compile"  # blocks take seconds, a step ms
        assert not regional.active and not said
    assert regional.ready.wait(timeout=240), "the background compile never finished"
    assert not regional.active, "only poll switches, between steps"
    regional.poll(2, said.append)
    assert regional.active and regional.error is None and said and "steps from" in said[0], said
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs for 3 identical blocks"
    for _ in range(3):  # compiled steps: no recompiles, same losses as eager
        want.append(_step(eager, eager_opt, ids))
        got.append(_step(model, opt, ids))
    assert counters["stats"]["unique_graphs"] == graphs, "the training thread recompiled after the switch"
    assert list(inductor_dir.rglob("*.py")), "inductor generated no kernels"
    assert got == pytest.approx(want, rel=1e-5)  # measured gap ~1e-7
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    with torch.no_grad():  # evaluation runs the eager blocks (no inference graph is compiled)
        model.eval()
        model(input_ids=ids, use_cache=False)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_failed_compile_leaves_training_eager_with_a_warning(inductor_dir):
    from dstrain.components.compile import RegionalCompile, blocks_of

    model = _model()
    reference = copy.deepcopy(model)
    regional = RegionalCompile(blocks_of(model), wait=False)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")
    regional.compiled = [broken] * len(regional.compiled)
    ids = torch.randint(0, 96, (2, 16))
    said = []
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    assert _step(model, opt, ids) == _step(reference, ref_opt, ids)
    regional.poll(1, said.append)  # starts the thread
    regional.thread.join(timeout=60)
    regional.poll(1, said.append)
    assert not regional.active and len(said) == 1 and "inductor exploded" in said[0] and "eager" in said[0]
    assert _step(model, opt, ids) == _step(reference, ref_opt, ids)  # eager, unchanged
    regional.poll(2, said.append)
    assert len(said) == 1, "the warning is said once"


def test_a_compile_that_fails_once_is_retried(inductor_dir):
    """The trace can race the training thread's .grad updates (seen on 2 ranks under ZeRO-2): an attempt that
    fails is retried, and the run switches to the compiled blocks, saying it took more than one attempt."""
    from dstrain.components.compile import RegionalCompile, blocks_of

    model = _model()
    regional = RegionalCompile(blocks_of(model), wait=False)
    real, calls = list(regional.compiled), []

    def flaky(i):
        def call(*args, **kwargs):
            calls.append(i)
            if len(calls) == 1:
                raise AssertionError("int(sym)=0 != hint=2176768")
            return real[i](*args, **kwargs)
        return call
    regional.compiled = [flaky(i) for i in range(len(real))]
    said = []
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(0, 96, (2, 16)))
    regional.poll(1, said.append)
    assert regional.ready.wait(timeout=240)
    regional.poll(2, said.append)
    assert regional.active and regional.error is None and "(2 attempts)" in said[0], said
    assert calls == [0, 0, 1, 2]  # the first attempt stopped at block 0; the second traced every block


def test_where_blocks_cannot_compile_off_the_training_thread():
    from dstrain.components.compile import whole_model_reason

    assert whole_model_reason(2, 1, False, [object()]) == ""
    assert "ZeRO-3" in whole_model_reason(3, 1, False, [object()])
    assert "tensor-parallel" in whole_model_reason(1, 2, False, [object()])
    assert "checkpointing" in whole_model_reason(0, 1, True, [object()])
    assert "_no_split_modules" in whole_model_reason(2, 1, False, [])


def test_compile_wait_needs_compile():
    from dstrain.config import TrainConfig
    from dstrain.errors import UserError

    with pytest.raises(UserError, match="train.compile=true"):
        TrainConfig(compile_wait=True)
    TrainConfig(compile=True, compile_wait=True)



def test_other_ranks_of_a_node_compile_after_the_leader(tmp_path):
    """Followers wait for the leader's marker (inductor's disk cache is warm after it) and go on without it
    after a timeout; the leader writes the marker even when its compile failed."""
    from dstrain.components.compile import RegionalCompile, blocks_of

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("stop here")

    def started(leader: bool, marker, **kw) -> RegionalCompile:
        model = _model()
        regional = RegionalCompile(blocks_of(model), wait=False, leader=leader, marker=marker, attempts=1, **kw)
        regional.compiled = [broken] * len(regional.compiled)
        _step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(0, 96, (2, 16)))
        regional.poll(1, lambda text: None)
        return regional

    marker = tmp_path / "markers" / "launch"
    follower = started(False, marker)
    assert not follower.ready.wait(timeout=1.5) and not calls, "the follower compiled before the leader"
    leader = started(True, marker)
    assert leader.ready.wait(timeout=60) and marker.exists(), "a failed leader must still write its marker"
    assert follower.ready.wait(timeout=10) and len(calls) == 2
    lone = started(False, tmp_path / "never", follow_timeout=0.5)  # no leader at all
    assert lone.ready.wait(timeout=10) and len(calls) == 3


def test_ranks_switch_together_or_not_at_all():
    """A rank whose compile is done waits for the others (ZeRO-2's buckets need the same gradient order on
    every rank); a failure on any rank keeps every rank eager."""
    from dstrain.components.compile import RegionalCompile, blocks_of

    others = {"ready": 0.0, "failed": 0.0}  # the other rank of a world of 2, as the collective would sum it

    def count(values):
        return [values[0] + others["ready"], values[1] + others["failed"]]

    model = _model()
    regional = RegionalCompile(blocks_of(model), wait=False, count=count, world=2)
    regional.compiled = list(regional.eager)  # the switch logic only: "compiled" = the eager forward
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(0, 96, (2, 16)))
    said = []
    regional.poll(1, said.append)
    assert regional.ready.wait(timeout=30) and regional.error is None
    regional.poll(2, said.append)
    assert not regional.active and regional.switched_at is None, "switched before the other rank was ready"
    others["ready"] = 1.0
    regional.poll(3, said.append)
    assert regional.active and regional.switched_at == 4 and "steps from 4" in said[-1]

    model = _model()
    regional = RegionalCompile(blocks_of(model), wait=False, count=count, world=2)
    regional.compiled = list(regional.eager)
    others["failed"] = 1.0
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(0, 96, (2, 16)))
    regional.poll(1, said.append)
    regional.ready.wait(timeout=30)
    regional.poll(2, said.append)
    assert not regional.active and "1 other rank" in said[-1] and "eager" in said[-1]
