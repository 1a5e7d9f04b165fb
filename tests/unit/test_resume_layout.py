"""resume.adapt_to_world on sequence-parallel checkpoints: the same sp size is required; another data-parallel size
is served by universal conversion of ZeRO-3's per-rank files only (tests/e2e/test_sequence_parallel.py resumes a
ZeRO-3 sp run on twice the ranks); ZeRO-0/1/2's files are refused in one line before anything is converted."""
import re
from pathlib import Path

import pytest

from dstrain.config import TrainConfig
from dstrain.errors import UserError
from dstrain.parallel.layout import Layout
from dstrain.run.resume import Resume, adapt_to_world

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


@pytest.mark.parametrize("ranks, accum, universal", [(1, 8, True), (2, 4, False), (4, 2, True), (8, 1, True)])
def test_a_user_set_accumulation_is_re_derived_to_keep_the_global_batch(tmp_path, ranks, accum, universal):
    """Saved on 2 data-parallel ranks x micro 4 x the user's grad_accum_steps 4 = 32 samples a step: each world
    keeps 32 (the arithmetic one e2e test guarded before: tests/e2e/test_faults.py resumes 2 -> 1 only)."""
    ckpt = checkpoint(tmp_path, ["zero_pp_rank_0_mp_rank_00_optim_states.pt"], global_batch=32, data_parallel=2,
                      sequence_parallel=1)
    said = []
    train, resume = adapt_to_world(ckpt, TrainConfig(micro_batch_size=4, grad_accum_steps=4), Layout(ranks),
                                   log=said.append)
    assert (train.grad_accum_steps, resume.universal) == (accum, universal)
    assert Layout(ranks).global_batch(train.micro_batch_size, train.grad_accum_steps) == 32
    assert said == ([] if ranks == 2 else [f"world changed from 2 to {ranks} data-parallel ranks: grad_accum_steps 4 "
                                           f"-> {accum} keeps the global batch at 32"])


def test_a_global_batch_no_world_can_make_up_or_a_changed_one_is_refused(tmp_path):
    ckpt = checkpoint(tmp_path, ["zero_pp_rank_0_mp_rank_00_optim_states.pt"], global_batch=32, data_parallel=2,
                      sequence_parallel=1)
    with pytest.raises(UserError, match="has a global batch of 32 samples, which 3 ranks x micro_batch_size 4 "
                                        "cannot make up"):
        adapt_to_world(ckpt, TrainConfig(micro_batch_size=4, grad_accum_steps=4), Layout(3), log=lambda _: None)
    with pytest.raises(UserError, match="global batch of 32 samples, this run has 16"):  # same world, accum changed
        adapt_to_world(ckpt, TrainConfig(micro_batch_size=4, grad_accum_steps=2), Layout(2))


def test_another_sequence_parallel_size_is_refused(tmp_path):
    ckpt = checkpoint(tmp_path, ["zero_pp_rank_0_mp_rank_00_model_states.pt"])
    with pytest.raises(UserError, match="trained with sequence_parallel_size=2 and this run has 4"):
        adapt_to_world(ckpt, TRAIN, Layout(4, sequence_parallel=4))
    plain = checkpoint(tmp_path, [], sequence_parallel=1)
    with pytest.raises(UserError, match="trained with sequence_parallel_size=1 and this run has 2"):
        adapt_to_world(plain, TRAIN, Layout(2, sequence_parallel=2))


# Each identity key changed alone (issue 29: every refused case changed several keys at once, so dropping data.path
# or seq_len from the identity passed): recipe overrides of a base recipe -> the key the refusal must name.
ONE_KEY_CHANGES = {
    "model.name_or_path": ["--model.name_or_path=other/model", "--model.tokenizer=recipes/tiny/model"],
    "model.tokenizer": ["--model.tokenizer=other/tokenizer"],
    "model.config_overrides": ["--model.config_overrides={rope_theta: 1000.0}"],
    "data.format": ["--data.format=prompt_response"],
    "data.path": ["--data.path=other/data"],
    "data.name": ["--data.name=subset"],
    "train.seq_len": ["--train.seq_len=64"],
    "data.text_field": ["--data.text_field=body"],
    "data.chat_template": ["--data.chat_template=chatml"],
}
LORA_KEY_CHANGES = {"lora.r": ["--lora.r=8"], "lora.target_modules": ["--lora.target_modules=[q_proj]"], "lora.quantize": ["--lora.quantize=4bit"]}


@pytest.mark.parametrize("key", [*ONE_KEY_CHANGES, *LORA_KEY_CHANGES])
def test_each_identity_key_alone_refuses_another_run(key, tmp_path):
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.run.resume import check_same_run, run_identity

    base_args = ["--model.tokenizer=recipes/tiny/model"] + (["--lora.r=4"] if key in LORA_KEY_CHANGES else [])
    changes = {**ONE_KEY_CHANGES, **LORA_KEY_CHANGES}[key]
    base = run_identity(load_recipe("tiny/pretrain.yaml", parse_overrides(base_args)).to_dict())
    changed = run_identity(load_recipe("tiny/pretrain.yaml", parse_overrides(base_args + changes)).to_dict())
    both = [k for k in changed if k in base]  # a format's own fields come and go with data.format
    assert [k for k in both if changed[k] != base[k]] == [key], "the case must change exactly one key"
    run_dir = tmp_path / "run"
    resume = Resume(run_dir / "checkpoints" / "step_00000003", {"run": base})
    check_same_run(resume, base, run_dir)  # the same run continues
    with pytest.raises(UserError, match=rf"holds another run \({re.escape(key)} "):
        check_same_run(resume, changed, run_dir)


def test_every_identity_key_has_a_one_key_case():
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.run.resume import run_identity

    keys = set(run_identity(load_recipe("tiny/pretrain.yaml", parse_overrides(["--lora.r=4",
                                                                               "--data.chat_template=chatml"]))
                            .to_dict()))
    assert keys <= set(ONE_KEY_CHANGES) | set(LORA_KEY_CHANGES), keys - set(ONE_KEY_CHANGES) - set(LORA_KEY_CHANGES)


# ----------------------------------------------------------------------------- another ZeRO stage (issue 69)

def _stage_checkpoint(tmp_path, layout: str, stage: int):
    files = {"zero3": ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
             "zero12": ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
             "bf16_zero1": ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
             "plain": ["mp_rank_00_model_states.pt"]}[layout]
    return checkpoint(tmp_path, files, zero_stage=stage, sequence_parallel=1)


def _ds(stage: int, precision: str = "fp32", **extra) -> dict:
    return {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16"}} | extra


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[2] / "ds_configs").glob("*.json")))
def test_every_shipped_config_has_the_checkpoint_layout_its_stage_saves(name):
    """optimizer_layout predicts the files DeepSpeed writes; tests/e2e/test_faults.py's chains load each layout."""
    from dstrain.parallel.ds_config import load, zero_stage
    from dstrain.run.resume import optimizer_layout

    cfg = load(name, {})
    assert optimizer_layout(cfg) == {0: "plain", 1: "zero12", 2: "zero12", 3: "zero3"}[zero_stage(cfg)]


def test_zero1_bf16_with_fp32_accumulation_is_the_bf16_optimizers_layout():
    from dstrain.run.resume import optimizer_layout

    assert optimizer_layout(_ds(1, "bf16", data_types={"grad_accum_dtype": "fp32"})) == "bf16_zero1"
    assert optimizer_layout(_ds(1, "bf16")) == "zero12"


@pytest.mark.parametrize("saved, stage, target, precision", [
    ("zero12", 2, 3, "fp32"), ("zero3", 3, 2, "bf16"), ("zero3", 3, 1, "fp32"), ("zero12", 2, 0, "fp32"),
    ("zero3", 3, 0, "fp32"), ("bf16_zero1", 1, 2, "bf16")])
def test_another_stage_converts_through_the_universal_checkpoint(tmp_path, saved, stage, target, precision):
    from dstrain.run.resume import adapt_to_stage

    said = []
    resume = adapt_to_stage(_stage_checkpoint(tmp_path, saved, stage), _ds(target, precision), "adamw", Layout(2),
                            said.append)
    assert resume.universal and resume.into_plain == (target == 0)
    assert said == [f"ZeRO stage changed from ZeRO-{stage} to ZeRO-{target}: the optimizer state is converted through "
                    f"DeepSpeed's universal checkpoint and continues exactly"]


def test_the_same_layout_loads_as_saved(tmp_path):
    from dstrain.run.resume import adapt_to_stage

    ckpt = _stage_checkpoint(tmp_path, "zero12", 1)
    assert adapt_to_stage(ckpt, _ds(2), "adamw", Layout(2)) is ckpt  # ZeRO-1 and 2: one optimizer, one layout
    # a DiLoCo checkpoint keeps each replica's files in a folder of its own: found there, same stage, as saved
    diloco = tmp_path / "step_diloco"
    (diloco / "replica_0").mkdir(parents=True)
    (diloco / "replica_0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    replicas = Resume(diloco, {"zero_stage": 2, "replicas": 2})
    assert adapt_to_stage(replicas, _ds(2), "adamw", Layout(4, replicas=2)) is replicas
    with pytest.raises(UserError, match="DiLoCo checkpoints resume on the stage they were saved with"):
        adapt_to_stage(replicas, _ds(3), "adamw", Layout(4, replicas=2))


@pytest.mark.parametrize("saved, stage, target, precision, optimizer, want", [
    ("plain", 0, 3, "fp32", "adamw", r"saved under ZeRO-0, whose optimizer state DeepSpeed's universal checkpoint "
                                     r"cannot read, and this run is ZeRO-3; continue it under ZeRO-0 .* --init_from "),
    ("zero12", 2, 0, "bf16", "adamw", r"ZeRO-0 in bf16 keeps its optimizer in DeepSpeed's fp16/bf16 wrapper, .* "
                                      r"--train.precision=fp32, under ZeRO-1/2/3, or start a new --output_dir from its "
                                      r"weights alone with --init_from "),
    ("zero3", 3, 0, "fp32", "muon", r"Muon's state converts between ZeRO-1/2/3 only")])
def test_what_no_converter_carries_is_one_line(tmp_path, saved, stage, target, precision, optimizer, want):
    from dstrain.run.resume import adapt_to_stage

    with pytest.raises(UserError, match=want) as caught:
        adapt_to_stage(_stage_checkpoint(tmp_path, saved, stage), _ds(target, precision), optimizer, Layout(2))
    assert "\n" not in str(caught.value)
