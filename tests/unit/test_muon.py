"""Muon's configuration, refusals and tagging, without a launch (tests/e2e/test_muon.py trains against the plain
loop; tests/unit/test_ds_internals.py checks the DeepSpeed internals it relies on)."""
from pathlib import Path

import pytest
import torch

from dstrain import components
from dstrain.components import muon
from dstrain.config import load_recipe, parse_overrides
from dstrain.errors import UserError
from dstrain.parallel import ds_config as dsc
from dstrain.parallel.dist import DistContext
from dstrain.parallel.layout import Layout

CPU = dsc.DeviceCaps("cpu", bf16=True, fp16=False)
ROOT = Path(__file__).resolve().parents[2]


def recipe(*overrides):
    return load_recipe("tiny/pretrain.yaml", parse_overrides(list(overrides)))


def resolve(ds: str, *overrides, world: int = 2, patch: dict | None = None) -> dict:
    raw = dsc.load(ds)
    if patch:
        raw = dsc.merge(raw, patch)
    return dsc.resolve(raw, recipe(*overrides), world_size=world, caps=CPU, hidden_size=128)


def test_muon_fills_deepspeeds_keys_from_the_recipe():
    cfg = resolve("zero2.json", "--train.optimizer=muon", "--train.muon_lr=0.03", "--train.lr=1e-3",
                  "--train.muon_momentum=0.9")
    opt = cfg["optimizer"]
    assert opt["type"] == "Muon"  # the shipped JSON's AdamW (named for the HF Trainer) turned into Muon
    assert {k: opt["params"][k] for k in ("muon_lr", "adam_lr", "lr", "momentum", "torch_adam")} == {
        "muon_lr": 0.03, "adam_lr": 1e-3, "lr": 1e-3, "momentum": 0.9, "torch_adam": True}
    assert cfg["gradient_clipping"] == 0.0  # unset under Muon: 0
    assert "reduce_scatter" not in cfg["zero_optimization"]
    assert resolve("zero3.json", "--train.optimizer=muon")["zero_optimization"]["reduce_scatter"] is False
    assert resolve("zero2.json")["gradient_clipping"] == 1.0 and resolve("zero2.json")["optimizer"]["type"] == "AdamW"
    # ZeRO-0 clips the gradient itself: allowed
    assert resolve("zero0.json", "--train.optimizer=muon", "--train.max_grad_norm=0.5")["gradient_clipping"] == 0.5


def test_a_json_asking_for_muon_is_followed():
    cfg = resolve("zero1.json", patch={"optimizer": {"type": "Muon"}})
    assert cfg["optimizer"]["type"] == "Muon" and cfg["optimizer"]["params"]["muon_lr"] == 0.02
    assert cfg["gradient_clipping"] == 0.0
    features = components.build(recipe(), dsc.merge(dsc.load("zero1.json"), {"optimizer": {"type": "Muon"}}))
    assert [f.name for f in features] == ["muon"]


@pytest.mark.parametrize("ds,overrides,patch,message", [
    ("zero2.json", ["--train.max_grad_norm=1.0"], None, "gradient clipping (1) with Muon under ZeRO-2: DeepSpeed "
     "0.19.8 clips Muon's orthogonalised update, not the gradient"),
    ("zero3.json", [], {"gradient_clipping": 1.0}, "gradient clipping (1) with Muon under ZeRO-3"),
    ("pipe2_zero1.json", [], None, "Muon with pipeline stages (2) is not supported"),
    ("tp2_zero1.json", [], None, "Muon with tensor parallelism (AutoTP) (2) is not supported"),
    ("zero3.json", [], {"zero_optimization": {"reduce_scatter": True}}, "reduce_scatter=true with Muon under ZeRO-3"),
    ("zero2.json", [], {"optimizer": {"type": "Lamb"}}, "train.optimizer=muon but the DeepSpeed config's optimizer "
     "type is 'Lamb'"),
])
def test_what_deepspeed_gets_wrong_is_refused(ds, overrides, patch, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(ds, "--train.optimizer=muon", *overrides, patch=patch, world=4)


def test_adamw_recipe_with_a_muon_json_is_a_contradiction():
    with pytest.raises(UserError, match="train.optimizer=adamw but the DeepSpeed config's optimizer type is Muon"):
        resolve("zero2.json", "--train.optimizer=adamw", patch={"optimizer": {"type": "Muon"}})


@pytest.mark.parametrize("override,message", [
    ("--train.optimizer=lion", "train.optimizer=.lion. is not one of auto, adamw, muon"),
    ("--train.muon_lr=0", "train.muon_lr=0.0 must be positive"),
    ("--train.muon_momentum=1", r"train.muon_momentum=1(.0)? must be in \[0, 1\)"),
    ("--train.max_grad_norm=-1", r"train.max_grad_norm=-1(.0)? must be 0"),
])
def test_bad_values_are_one_line(override, message):
    with pytest.raises(UserError, match=message):
        recipe(override)


def _setup(r, raw, saved_world=None):
    from transformers import AutoConfig
    return components.Setup(r, Layout.from_ds_config(raw, 2), raw, "fp32", AutoConfig.from_pretrained(
        ROOT / "recipes/tiny/model"), Path("/nonexistent"), DistContext(0, 0, 2), print, None, saved_world)


def test_muon_with_lora_is_refused_when_the_recipe_loads_and_when_the_json_names_muon():
    """Issue 69: refused by the component only, after deepspeed and transformers were imported (15-25 s); the
    recipe now refuses it at once, and the component still does when the JSON's optimizer type is Muon."""
    with pytest.raises(UserError, match="train.optimizer=muon with LoRA"):
        recipe("--train.optimizer=muon", "--lora.r=8")
    r = recipe("--lora.r=8")
    raw = dsc.load("zero2.json")
    raw["optimizer"]["type"] = "Muon"
    (feature,) = [f for f in components.build(r, raw) if f.name == "muon"]
    with pytest.raises(UserError, match="train.optimizer=muon with LoRA"):
        feature.validate(_setup(r, raw))


@pytest.mark.parametrize("overrides,saved,message", [
    (["--diloco.every=4"], None, "train.optimizer=muon with DiLoCo"),
    ([], 4, "this Muon run's checkpoint was saved on 4 ranks: resuming it on another world size with the "
     "optimizer on NVMe"),
])
def test_component_refusals(overrides, saved, message):
    r = recipe("--train.optimizer=muon", *overrides)
    raw = dsc.load("zero3_nvme.json" if saved else "zero2.json")
    (feature,) = [f for f in components.build(r, raw) if f.name == "muon"]
    with pytest.raises(UserError, match=message):
        feature.validate(_setup(r, raw, saved))


def test_tags_are_what_a_parameter_is_not_its_name():
    """GPT-2's wte/wpe (no "embed" in the name) stay on AdamW, as Llama's embed_tokens; a tied head is the
    embedding; an untied head (any name) is AdamW; frozen parameters are counted nowhere; ZeRO-3's flat
    partitions are read by their ds_shape."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    got = muon.tag(gpt2)
    on = {n for n, p in gpt2.named_parameters() if p.dstrain_muon}
    assert on == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                  "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}
    assert got["counts"]["muon_tensors"] == 4 and got["counts"]["muon_elements"] == 16 * 48 + 16 * 16 + 2 * 16 * 64
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    llama.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    got = muon.tag(llama)
    off = {n for n, p in llama.named_parameters() if not p.dstrain_muon}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.mlp.down_proj.weight"} <= off
    assert got["counts"]["muon_tensors"] == 6 and got["counts"]["adamw_tensors"] == 5  # 3 norms, embed, head
    flat = torch.nn.Linear(4, 3, bias=False)
    flat.weight.data = torch.empty(0)
    flat.weight.ds_shape = torch.Size([3, 4])  # what zero.Init leaves: a flat local tensor, the layer's shape aside
    assert muon.tag(flat)["shapes"] == {(3, 4): 1}


def test_a_muon_run_does_not_continue_as_adamw(tmp_path):
    """Muon's and AdamW's optimizer states do not load into each other (DeepSpeed raised on the parameter groups):
    the run directory is bound to the optimizer it trains with, and the line offers --init_from (weights only)."""
    from dstrain.run.checkpoint import Resume
    from dstrain.run.resume import check_same_run, run_identity

    raw = dsc.load("zero2.json")
    muon_run = run_identity(recipe("--train.optimizer=muon").to_dict(), dsc.optimizer_of(raw, recipe(
        "--train.optimizer=muon").train))
    adamw_run = run_identity(recipe().to_dict(), dsc.optimizer_of(raw, recipe().train))
    resume = Resume(tmp_path / "run" / "checkpoints" / "step_00000003", {"run": muon_run})
    check_same_run(resume, muon_run, tmp_path / "run")
    with pytest.raises(UserError, match=r"holds another run \(train.optimizer muon -> adamw\); .* --init_from"):
        check_same_run(resume, adamw_run, tmp_path / "run")
    old = Resume(tmp_path / "run" / "checkpoints" / "step_00000003", {"run": run_identity(recipe().to_dict())})
    check_same_run(old, adamw_run, tmp_path / "run")  # a checkpoint from before the key: not refused

