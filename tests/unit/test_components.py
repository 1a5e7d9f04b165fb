"""Optional features as components: one validation pass refuses every conflict with one line, before
anything is built (a meta-device model stands in where the check needs the model's shape)."""
from pathlib import Path

import pytest
from transformers import AutoConfig

from dstrain import components
from dstrain.components.compression import GradientCompression
from dstrain.config import load_recipe, parse_overrides
from dstrain.errors import UserError
from dstrain.parallel.dist import DistContext
from dstrain.parallel.ds_config import load
from dstrain.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[2]


def setup_for(overrides: list[str], ds: str, world: int = 2, precision: str = "fp32", model_config=None):
    recipe = load_recipe("tiny/pretrain", parse_overrides(overrides))
    raw = load(ds)
    config = model_config or AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    setup = components.Setup(recipe, Layout.from_ds_config(raw, world), raw, precision, config, Path("/nonexistent"),
                             DistContext(0, 0, world), print)
    return components.build(recipe, raw), setup


@pytest.mark.parametrize("overrides,ds,precision,message", [
    (["--train.compile=true"], "pipe2_zero1.json", "fp32", "train.compile is not supported with pipeline stages"),
    (["--train.loss_chunk_tokens=64"], "tp2_zero1.json", "fp32",
     "train.loss_chunk_tokens is not supported with pipeline stages or tensor parallelism"),
    (["--train.loss_chunk_tokens=64"], "zero2.json", "fp16", "needs bf16 or fp32, not fp16"),
])
def test_conflicts_are_refused_in_the_validation_pass(overrides, ds, precision, message):
    features, setup = setup_for(overrides, ds, precision=precision)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        components.validate_all(features, setup)


def test_chunked_loss_checks_the_model_shape_without_building_it():
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.logit_scale = 0.5  # Cohere-style logits scaled after the head: the fused loss would be wrong
    features, setup = setup_for(["--train.loss_chunk_tokens=64"], "zero2.json", model_config=config)
    with pytest.raises(UserError, match="its logits are transformed after the head"):
        components.validate_all(features, setup)
    features, setup = setup_for(["--train.loss_chunk_tokens=64"], "zero2.json")
    components.validate_all(features, setup)  # the plain Llama passes


def test_compression_conflicts_and_state():
    # issue 30: compression is the recipe's section; its conflicts with the DeepSpeed JSON are refused in the one
    # validation pass (they were checked inside ds_config.resolve while the setting lived in the JSON)
    feature, setup = setup_for(["--compression.method=powersgd"], "zero2.json")
    assert [f.name for f in feature] == ["compression"]
    with pytest.raises(UserError, match="compression.method=powersgd works with ZeRO stage 0 or 1, but this config "
                                        "uses ZeRO-2"):
        components.validate_all(feature, setup)
    feature, setup = setup_for(["--compression.method=sign"], "tp2_zero1.json")
    with pytest.raises(UserError, match="not with pipeline stages, tensor or sequence parallelism"):
        components.validate_all(feature, setup)
    feature, setup = setup_for(["--compression.method=powersgd"], "zero1.json")
    components.validate_all(feature, setup)
    configured = dict(setup.ds_cfg, zero_optimization=dict(setup.ds_cfg["zero_optimization"]))
    feature[0].configure(configured, setup)  # the ZeRO-1 knobs the compressed reduction needs
    assert configured["zero_optimization"]["reduce_scatter"] is False
    # state only once a reducer exists (a data-parallel world of one has none): the checkpointer's extras
    component = GradientCompression(feature[0].config)
    assert components.stateful([component]) == {}
    component.reducer = object()
    assert components.stateful([component]) == {"compression": component}


def test_nothing_is_on_unless_asked():
    assert components.build(load_recipe("tiny/pretrain"), load("zero3.json")) == []


@pytest.mark.parametrize("overrides,config_changes,message", [
    (["--model.attn_implementation=eager"], {}, "needs model.attn_implementation sdpa or flash_attention_2"),
    ([], {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 32},
     "sequence_parallel_size=2 must divide the model's 3 attention heads"),
    (["--train.seq_len=129"], {}, "train.seq_len=129 is not divisible by sequence_parallel_size=2"),
    (["--train.compile=true"], {}, "train.compile with sequence_parallel_size=2 is not supported yet"),
])
def test_sequence_parallel_conflicts_are_refused(overrides, config_changes, message):
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.update(config_changes)
    features, setup = setup_for(overrides, "sp2_zero3.json", model_config=config)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        components.validate_all(features, setup)


def test_sequence_parallel_under_zero3_needs_reduce_scatter():
    features, setup = setup_for([], "sp2_zero3.json")
    setup.ds_cfg["zero_optimization"]["reduce_scatter"] = False
    with pytest.raises(UserError, match="needs zero_optimization.reduce_scatter true"):
        components.validate_all(features, setup)


def test_sequence_parallel_passes_the_shipped_tiny_model():
    features, setup = setup_for([], "sp2_zero3.json")
    assert [f.name for f in features] == ["sequence_parallel"]
    components.validate_all(features, setup)
    assert setup.layout.data_parallel == 1 and setup.layout.zero_shards == 2 and setup.layout.token_replicas == 1


def test_packing_is_refused_with_pipeline_stages():
    features, setup = setup_for(["--data.packing=true"], "pipe2_zero1.json")
    with pytest.raises(UserError, match="data.packing with pipeline stages"):
        components.validate_all(features, setup)
