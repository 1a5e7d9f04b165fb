"""DeepSpeed JSON loading, "auto" filling, batch arithmetic and key validation; every shipped config and
every real recipe is resolved and then accepted by DeepSpeed's own config parser."""
import json
import re

import pytest

from dstrain.config import RECIPES_DIR, load_recipe, parse_overrides
from dstrain.errors import UserError
from dstrain.parallel import ds_config as dsc
from dstrain.parallel.layout import Layout

CPU = dsc.DeviceCaps("cpu", bf16=True, fp16=False)
GPU = dsc.DeviceCaps("cuda", bf16=True, fp16=True)
SHIPPED = sorted(p.name for p in dsc.DS_CONFIGS_DIR.glob("*.json"))


class DataParallelOnly:
    """The mpu interface DeepSpeedConfig asks for the data-parallel world size."""
    def __init__(self, n):
        self.n = n

    def get_data_parallel_world_size(self):
        return self.n

    def get_model_parallel_world_size(self):
        return 1


def deepspeed_accepts(cfg, dp):
    """DeepSpeed's own parser and batch assertion, as a rank of a dp-wide data-parallel group."""
    from unittest import mock

    import deepspeed.runtime.config as ds_runtime_config
    with mock.patch.object(ds_runtime_config.dist, "get_rank", return_value=0):
        return ds_runtime_config.DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=DataParallelOnly(dp))


def recipe(*overrides):
    return load_recipe("tiny/pretrain.yaml", parse_overrides(list(overrides)))


def test_shipped_set_is_complete():
    for name in ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme", "pipe2_zero1",
                 "tp2_zero1"):
        assert f"{name}.json" in SHIPPED and f"{name}_fp16.json" in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_resolves_and_deepspeed_accepts_it(name):
    raw = dsc.load(name)
    assert dsc._find_auto(raw), "shipped configs leave recipe-owned values to the recipe"
    r = recipe("--train.grad_accum_steps=3")
    world = 16 if name.startswith("sp8") else 8 if name.startswith("sp2cp2") else 4
    cfg = dsc.resolve(raw, r, world_size=world, caps=GPU, hidden_size=128)
    assert dsc._find_auto(cfg) is None
    layout = Layout.from_ds_config(cfg, world)
    dp = layout.data_parallel
    assert dp == (2 if ("pipe2" in name or "tp2" in name or "sp" in name or "cp" in name) else 4)
    engine_dp = dp * layout.context_parallel  # DeepSpeed counts a ring's ranks as data-parallel ones
    parsed = deepspeed_accepts(cfg, engine_dp)
    assert parsed.train_batch_size == 8 * 3 * engine_dp
    assert parsed.gradient_accumulation_steps == 3
    assert parsed.gradient_clipping == 1.0  # train.max_grad_norm unset: 1.0 with AdamW
    assert cfg["optimizer"]["params"]["lr"] == r.train.lr
    assert cfg["optimizer"]["params"]["betas"] == r.train.betas
    assert parsed.bfloat16_config.enabled == (not name.endswith("_fp16.json"))
    assert parsed.float16_config.enabled == name.endswith("_fp16.json")
    assert "scheduler" not in cfg  # none: dstrain.trainer.schedule from the recipe


def test_an_auto_scheduler_is_the_recipes_schedule():
    raw = dict(dsc.load("zero2"), scheduler={"type": "auto", "params": "auto"})
    assert "scheduler" not in dsc.resolve(raw, recipe(), 2, GPU)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads_in_the_hugging_face_trainer(name, tmp_path):
    """Issue 29 item 7: people carry these JSONs to their own Trainer scripts; {"scheduler": {"params": "auto"}}
    failed in transformers' fill_match. TrainingArguments fills the "auto" values from its own arguments."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=str(dsc.DS_CONFIGS_DIR / name), use_cpu=True,
                             report_to=[], per_device_train_batch_size=2, gradient_accumulation_steps=3)
    filled = args.hf_deepspeed_config.config
    assert filled["train_micro_batch_size_per_gpu"] == 2 and filled["gradient_accumulation_steps"] == 3
    assert filled["optimizer"]["params"]["lr"] == args.learning_rate


@pytest.mark.parametrize("name", [n for n in SHIPPED if n.endswith("_fp16.json")])
def test_fp16_on_cpu_is_a_clear_error(name):
    with pytest.raises(UserError, match=r"fp16 is not supported on this device \(cpu\); use a bf16 config"):
        dsc.resolve(dsc.load(name), recipe(), 2, CPU)


def test_precision_auto_on_cpu_is_fp32_and_explicit_wins():
    cfg = dsc.resolve(dsc.load("zero2.json"), recipe(), 2, CPU)
    assert cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
    cfg = dsc.resolve(dsc.load("zero2.json"), recipe("--train.precision=bf16"), 2, CPU)
    assert cfg["bf16"]["enabled"] is True
    cfg = dsc.resolve(dsc.load("zero2.json"), recipe(), 2, GPU)
    assert cfg["bf16"]["enabled"] is True  # on a GPU "auto" follows the JSON


def test_explicit_batch_mismatch_names_the_fix():
    raw = dsc.load("zero2.json") | {"train_batch_size": 64}
    with pytest.raises(UserError) as err:
        dsc.resolve(raw, recipe(), 2, CPU)
    assert str(err.value) == ('train_batch_size=64 but micro_batch_size 8 x grad_accum_steps 1 x data-parallel '
                              'world 2 = 16; set train_batch_size to "auto" or choose train.grad_accum_steps so '
                              'the product is 64')
    raw["train_batch_size"] = 16  # a consistent explicit value is fine
    assert dsc.resolve(raw, recipe(), 2, CPU)["train_batch_size"] == 16


def test_explicit_value_disagreeing_with_recipe():
    raw = dsc.load("zero2.json")
    raw["optimizer"]["params"]["lr"] = 0.1
    with pytest.raises(UserError, match=r"optimizer.params.lr=0.1 disagrees with recipe train.lr=0.003"):
        dsc.resolve(raw, recipe(), 2, CPU)


@pytest.mark.parametrize("patch,message", [
    ({"zero_optimisation": {"stage": 2}}, "unknown DeepSpeed config key 'zero_optimisation' (did you mean "
                                          "'zero_optimization'?)"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     "unknown DeepSpeed config key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
     "'zero_optimization.offload_param.pin_memroy' (did you mean 'pin_memory'?)"),
    ({"bf16": {"enable": True}}, "'bf16.enable' (did you mean 'enabled'?)"),
    ({"pipeline": {"stage": 2}}, "unknown DeepSpeed config key 'pipeline.stage' (did you mean 'stages'?)"),
])
def test_unknown_keys_name_the_closest(patch, message):
    with pytest.raises(UserError) as err:
        dsc.validate_keys(dsc.load("zero2.json") | patch)
    assert message in str(err.value)


def test_lookup_by_name_and_errors(tmp_path):
    assert dsc.resolve_path("zero3") == dsc.DS_CONFIGS_DIR / "zero3.json"
    with pytest.raises(UserError, match=r"'zero4.json' not found.*did you mean"):
        dsc.resolve_path("zero4.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"a\": ")
    with pytest.raises(UserError, match="not valid JSON"):
        dsc.load(bad)


def test_ds_overrides_merge_before_validation():
    cfg = dsc.load("zero2.json", {"zero_optimization": {"stage": 1}})
    assert cfg["zero_optimization"]["stage"] == 1 and cfg["zero_optimization"]["overlap_comm"] is True
    with pytest.raises(UserError, match="did you mean 'overlap_comm'"):
        dsc.load("zero2.json", {"zero_optimization": {"overlap_com": False}})


def test_leftover_auto_is_reported():
    raw = dsc.load("zero2.json")
    raw["zero_optimization"]["reduce_bucket_size"] = "auto"
    with pytest.raises(UserError, match="'zero_optimization.reduce_bucket_size' is \"auto\" but no recipe"):
        dsc.resolve(raw, recipe(), 2, CPU)


def test_world_not_divisible_by_model_parallel():
    raw = dsc.load("zero1.json") | {"tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(UserError, match="world size 3 is not divisible"):
        dsc.resolve(raw, recipe(), 3, CPU)


def test_autotps_vocabulary_parallel_head_is_off_unless_asked_and_refused_when_asked():
    """Issue 85: DeepSpeed's unset vocab_parallel_lm_head turns on for a tied head whose model plans a row-wise
    embedding (Gemma 3): each rank got its half of the logits and train.py ended in `IndexError: Target 518 is out
    of bounds` at the first step (tiny Gemma 3 under tp2_zero1.json without the key)."""
    raw = dsc.load("zero1.json") | {"tensor_parallel": {"autotp_size": 2}}
    assert dsc.resolve(raw, recipe(), 2, CPU)["tensor_parallel"]["vocab_parallel_lm_head"] is False
    raw["tensor_parallel"]["vocab_parallel_lm_head"] = True
    with pytest.raises(UserError, match=r"^tensor_parallel.vocab_parallel_lm_head=true .* set it to false$"):
        dsc.resolve(raw, recipe(), 2, CPU)
    assert "tensor_parallel" not in dsc.resolve(dsc.load("zero1.json"), recipe(), 2, CPU)


REAL = [p for p in sorted(RECIPES_DIR.rglob("*.yaml")) if not p.is_relative_to(RECIPES_DIR / "tiny")]


@pytest.mark.parametrize("path", REAL, ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_real_recipes_batch_arithmetic_at_their_world_size(path):
    r = load_recipe(path)
    assert r.world_size, "real recipes name the world size they were written for"
    cfg = dsc.resolve(dsc.load(r.ds_config), r, r.world_size, GPU, hidden_size=4096)
    dp = Layout.from_ds_config(cfg, r.world_size).data_parallel  # sequence-parallel ranks share their samples
    expected = r.train.micro_batch_size * r.train.grad_accum_steps * dp
    assert cfg["train_batch_size"] == expected
    assert deepspeed_accepts(cfg, dp).train_batch_size == expected
    assert cfg["bf16"]["enabled"] is True


def test_zero3_sizes_scale_with_the_model():
    raw = dsc.load("zero3.json")
    with pytest.raises(UserError, match="is \"auto\" but no recipe value fills it"):
        dsc.resolve(raw, recipe(), 2, CPU)               # needs the model's hidden size
    small = dsc.resolve(raw, recipe(), 2, CPU, hidden_size=768)["zero_optimization"]
    big = dsc.resolve(raw, recipe(), 2, CPU, hidden_size=4096)["zero_optimization"]
    assert small["reduce_bucket_size"] == 768 ** 2 and big["reduce_bucket_size"] == 4096 ** 2
    assert big["stage3_max_live_parameters"] == 12 * 4096 ** 2 and big["stage3_param_persistence_threshold"] == 40960
    explicit = dsc.resolve(dsc.load("zero3.json", {"zero_optimization": {"reduce_bucket_size": 123}}), recipe(), 2,
                           CPU, hidden_size=768)
    assert explicit["zero_optimization"]["reduce_bucket_size"] == 123   # a value in the JSON is kept


def test_sequence_parallel_combinations_are_checked_before_deepspeed_asserts():
    """Issue 16: --ds.sequence_parallel_size=2 failed with DeepSpeed's AssertionError. Issue 19: it trains; what
    cannot combine with it is refused in one line, and the data-parallel size counts it."""
    cfg = dsc.resolve(dsc.load("zero2.json") | {"sequence_parallel_size": 2}, recipe(), 4, CPU)
    assert cfg["train_batch_size"] == 8 * 2  # micro 8 x 2 data-parallel groups of 2 sequence-parallel ranks
    cases = {"pipe2_zero1.json": "together with pipeline stages is not supported",
             "tp2_zero1.json": "together with tensor parallelism (AutoTP) is not supported"}
    for name, message in cases.items():
        with pytest.raises(UserError, match=re.escape(message)):
            dsc.resolve(dsc.load(name) | {"sequence_parallel_size": 2}, recipe(), 4, CPU)
    with pytest.raises(UserError, match=re.escape("sequence_parallel_size='2' must be a positive integer")):
        dsc.resolve(dsc.load("zero2.json") | {"sequence_parallel_size": "2"}, recipe(), 4, CPU)
    with pytest.raises(UserError, match=re.escape("world size 4 is not divisible by pipeline stages (1) x "
                                                  "tensor-parallel size (1) x sequence-parallel size (3)")):
        dsc.resolve(dsc.load("zero2.json") | {"sequence_parallel_size": 3}, recipe(), 4, CPU)


@pytest.mark.parametrize("override, message", [
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage=4 is not valid: Input should be 0, 1, 2, 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     r"zero_optimization.offload_optimizer.device='gpu' is not valid"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
])
def test_deepspeeds_own_value_checks_are_part_of_validation(override, message):
    """Issue 29 item 4: these failed inside deepspeed.initialize, after the run directory was written."""
    from dstrain.config import merge
    with pytest.raises(UserError, match=message):
        dsc.resolve(merge(dsc.load("zero2"), override), recipe(), 2, GPU)
