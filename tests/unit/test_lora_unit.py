"""LoRA without launching: the recipe section against peft's LoraConfig, the one-pass refusals, the memory model
(frozen base, 4-bit base, adapters with full states), FLOPs, and the run identity a LoRA run directory carries."""
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dstrain import components
from dstrain.components.lora import count_parameters
from dstrain.config import load_recipe, parse_overrides
from dstrain.errors import UserError
from dstrain.parallel import ds_config as dsc
from dstrain.parallel.dist import DistContext
from dstrain.parallel.layout import Layout
from dstrain.planner import memory

ROOT = Path(__file__).resolve().parents[2]
GPU = dsc.DeviceCaps("cuda", bf16=True, fp16=True)
GiB = 1024 ** 3


def recipe(*overrides, name="tiny/chat_sft"):
    return load_recipe(name, parse_overrides(list(overrides)))


def test_one_flag_turns_a_recipe_into_lora():
    assert not recipe().lora.enabled
    r = recipe("--lora.r=16", "--lora.alpha=32", "--lora.target_modules=[q_proj, v_proj]",
               "--lora.options.init_lora_weights=gaussian", "--lora.use_rslora=true")
    config = r.lora.peft_config(base="/models/base")
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (16, 32, {"q_proj", "v_proj"})
    assert config.init_lora_weights == "gaussian" and config.use_rslora and config.task_type == "CAUSAL_LM"
    assert config.base_model_name_or_path == "/models/base"
    assert recipe("--lora.r=8").lora.peft_config().target_modules == "all-linear"  # peft's meaning


@pytest.mark.parametrize("overrides,message", [
    (["--lora.options.lora_alfa=3"], "lora.options.lora_alfa is not a field of peft's LoraConfig (did you mean "
                                     "'lora_alpha'?)"),
    (["--lora.options.r=4"], "lora.options.r: lora.r, not an option"),
    (["--lora.lora_r=8"], "'lora.lora_r' (here it is 'lora.r')"),
    (["--lora.lora_alpha=32"], "'lora.lora_alpha' (here it is 'lora.alpha')"),
    (["--lora.bias=some"], "lora.bias='some' is not one of none, all, lora_only"),
    (["--lora.dropout=1.5"], "lora.dropout=1.5 must be in [0, 1)"),
    (["--lora.quantize=8bit"], "lora.quantize='8bit' is not one of 4bit"),
    (["--lora.r=-1"], "lora.r=-1 must be 0 (off) or a rank"),
    (["--lora.r=8", "--lora.target_modules=7"], "lora.target_modules=7 should be all-linear"),
    (["--lora.r=8", "--lora.options.layers_to_transform=[0]"], "lora: peft refuses these options"),
])
def test_bad_lora_options_are_one_line(overrides, message):
    with pytest.raises(UserError) as err:
        recipe(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def tiny_with_weights(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("tiny-weights")
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.num_hidden_layers = 1
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "recipes/tiny/model" / name, out / name)
    return out


def validate(overrides, ds="zero3.json", precision="fp32", world=2, config=None):
    r = recipe(*overrides)
    raw = dsc.load(ds)
    config = config or AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    setup = components.Setup(r, Layout.from_ds_config(raw, world), raw, precision, config, Path("/nonexistent"),
                             DistContext(0, 0, world), print)
    features = components.build(r, raw)
    components.validate_all(features, setup)
    return features


@pytest.mark.parametrize("ds,extra,message", [
    ("pipe2_zero1.json", [], "lora is not supported with pipeline stages"),
    ("tp2_zero1.json", [], "lora is not supported with tensor parallelism"),
    ("zero3.json", ["--lora.quantize=4bit"], "lora.quantize=4bit (QLoRA) needs a CUDA GPU"),
    ("zero3.json", ["--lora.target_modules=[nope]"], "lora.target_modules names 'nope', which is no module of the "
                                                     "model"),
    # issue 85: peft passed over a name that matched nothing beside one that did (v_proj untrained, said trained)
    ("zero3.json", ["--lora.target_modules=[q_proj, vv_proj]"], "lora.target_modules names 'vv_proj', which is no "
                                                               "module of the model (did you mean 'v_proj'?)"),
])
def test_conflicts_are_refused_before_anything_is_built(tiny_with_weights, ds, extra, message):
    if "quantize" in extra and torch.cuda.is_available():
        pytest.skip("the CPU refusal; a GPU runs QLoRA")
    with pytest.raises(UserError) as err:
        validate([f"--model.name_or_path={tiny_with_weights}", "--lora.r=8", *extra], ds)
    assert message in str(err.value), str(err.value)


def test_a_base_without_weights_is_refused(tiny_with_weights):
    with pytest.raises(UserError, match="which has no weights: the frozen base would be random"):
        validate(["--lora.r=8"])  # recipes/tiny/model: a config, no weights
    features = validate([f"--model.name_or_path={tiny_with_weights}", "--lora.r=8"])
    assert validate([f"--model.name_or_path={tiny_with_weights}", "--lora.r=8",
                     "--lora.target_modules=[model.layers.0.self_attn.q_proj, v_proj]"])  # peft's suffixes match
    # counted on the setup's config (the tiny recipe's 4 layers) at r=8: 8 x (in + out) of 7 linears per layer:
    # q and o 128 + 128, k and v 128 + 64 (2 kv heads), gate, up and down 128 + 344
    assert components.trained_parameters(features) == 4 * 8 * (2 * 256 + 2 * 192 + 3 * 472)


def test_a_tokenizer_larger_than_the_frozen_embeddings_is_refused(tiny_with_weights):
    """train.py would resize the embeddings: rows nobody trains, which export cannot rebuild from the base."""
    config = AutoConfig.from_pretrained(tiny_with_weights)
    config.vocab_size = 500  # the tiny tokenizer has 576 tokens
    with pytest.raises(UserError, match="the tokenizer has 576 tokens and the base's embeddings 500 rows"):
        validate([f"--model.name_or_path={tiny_with_weights}", "--model.tokenizer=recipes/tiny/model", "--lora.r=8"],
                 config=config)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import LlamaConfig
    out = {}
    for name, size in {"8b": (4096, 14336, 32, 32), "70b": (8192, 28672, 80, 64)}.items():
        hidden, ffn, layers, heads = size
        path = tmp_path_factory.mktemp(name)
        LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=8, max_position_embeddings=131072,
                    rope_theta=500000.0).save_pretrained(path)
        out[name] = path
    return out


def shipped(name, path, *extra):
    return load_recipe(name, parse_overrides([f"--model.name_or_path={path}", "--model.tokenizer=recipes/tiny/model",
                                              *extra]))


def test_lora_memory_counts_states_for_adapters_only(configs):
    full = shipped("llama-3.1-8b/lora_sft.yaml", configs["8b"], "--lora.r=0")
    lora = shipped("llama-3.1-8b/lora_sft.yaml", configs["8b"])
    config = AutoConfig.from_pretrained(configs["8b"])
    psi = memory.count_parameters(config)
    _, adapters, linear = count_parameters(config, lora.lora)
    assert adapters == 41_943_040  # r=16 on q,k,v,o,gate,up,down of 32 layers: 16 x (sum of in + out)
    cfg = dsc.resolve(dsc.load("zero2.json"), lora, 8, GPU, hidden_size=4096)
    layout = Layout.from_ds_config(cfg, 8)
    f = memory.estimate(config, psi, full, cfg, layout)
    a = memory.estimate(config, psi, lora, cfg, layout, adapters)
    assert a.device["parameters"] == 2 * (psi + adapters)  # bf16 base + adapters, whole on each rank (ZeRO-2)
    assert a.device["gradients"] == 2 * adapters // 8 and a.device["optimizer_states"] == 12 * (adapters // 8)
    assert f.device_total - a.device_total > 12 * GiB  # the full fine-tune's gradients and Adam states (1/8 each)
    q = memory.estimate(config, psi, lora, cfg, layout, adapters, quantized=linear)
    assert q.device["parameters"] == int(2 * (psi - linear + adapters) + memory.NF4_BYTES * linear)


def test_shipped_lora_recipes_fit_where_they_say(configs):
    fits, text = memory.preflight(shipped("llama-3.1-8b/lora_sft.yaml", configs["8b"]), dsc.load("zero2.json"),
                                  "zero2.json", 8, 8, GPU, memory.target_device("h100-80gb", None))
    assert fits, text
    assert "LoRA r=16: 41.9M adapter parameters train" in text
    # 70B QLoRA on two 24 GB GPUs, ZeRO-3 with parameters and optimizer offloaded to host memory
    r = shipped("llama-3.1-70b/qlora_sft.yaml", configs["70b"])
    fits, text = memory.preflight(r, dsc.load(r.ds_config), r.ds_config, 2, 2, GPU,
                                  memory.target_device("rtx4090-24gb", None))
    assert fits, text
    assert "linear weights in 4 bit" in text and "host memory" in text, text
    host = float(text.split("host memory: ")[1].split(" GiB")[0])
    assert 30 < host < 64, text  # the recipe's header plans ~64 GB of RAM per node


def test_lora_flops_count_no_weight_gradients_for_the_base():
    from dstrain.flops import flops_per_token
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    full = flops_per_token(config, 1_000_000, 64)
    lora = flops_per_token(config, 1_000_000, 64, adapters=10_000)
    matmul = 1_000_000  # tied embeddings: every parameter is in a matmul
    assert full - lora == pytest.approx(6 * matmul - (4 * matmul + 6 * 10_000))


def test_a_lora_run_directory_is_bound_to_its_adapters():
    from dstrain.run.resume import run_identity
    full = run_identity(recipe().to_dict())
    lora = run_identity(recipe("--lora.r=16").to_dict())
    other = run_identity(recipe("--lora.r=16", "--lora.target_modules=[q_proj]").to_dict())
    assert full["lora.r"] == 0 and lora["lora.r"] == 16 and lora != other
    assert run_identity({"model": {"name_or_path": "x"}})["lora.r"] == 0  # a recipe.yaml from before LoRA


def test_a_missing_run_export_says_which_run_writes_it(tmp_path):
    """tiny/lora_chat_sft.yaml names runs/tiny-pretrain/hf: before `make train` it does not exist (here a path of
    the same shape that surely does not, so a developer's own runs/ cannot hide the message)."""
    from dstrain.model import load_config
    missing = tmp_path / "runs" / "tiny-pretrain" / "hf"
    with pytest.raises(UserError) as err:
        load_config(recipe(f"--model.name_or_path={missing}", name="tiny/lora_chat_sft.yaml").model, 64)
    message = str(err.value)
    assert f"cannot load '{missing}': no such directory" in message and "\n" not in message
    assert f"{missing} is written when the run {missing.parent} finishes (for runs/tiny-pretrain: make train)" \
        in message
    with pytest.raises(UserError) as err:
        load_config(recipe(f"--model.name_or_path={tmp_path / 'model'}").model, 64)
    assert "finishes" not in str(err.value)
