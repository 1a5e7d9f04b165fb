"""Pipeline conversion errors and the tensor-parallel checks that need no process group."""
import pytest

from dstrain.components import pipeline
from dstrain.errors import UserError
from dstrain.parallel.ds_config import check_pipeline
from tests.helpers import ROOT


def test_unknown_architecture_is_refused_by_name():
    from transformers import OPTConfig, OPTForCausalLM
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16))
    with pytest.raises(UserError, match="pipeline stages are not supported for model type 'opt' yet"):
        pipeline.convert(model, 2, "parameters", False)


def test_more_stages_than_layers():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(UserError, match="pipeline stages=3 exceed the model's 2 decoder layers"):
        pipeline.convert(model, 3, "parameters", False)


def test_layer_names_cover_every_parameter_once():
    """The export map must account for every HF parameter (tied head excluded), in order."""
    from transformers import LlamaConfig, LlamaForCausalLM
    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied))
        specs, names = pipeline._specs(model)
        covered = set()
        for index, prefix in names.items():
            module = specs[index].build()
            covered |= {prefix + pipeline.strip_wrapper(k) for k in module.state_dict()}
        expected = set(model.state_dict()) - ({"lm_head.weight"} if tied else set())
        assert covered == expected


def test_zero2_with_pipeline_rejected():
    with pytest.raises(UserError, match="work with ZeRO stage 0 or 1, not 3"):
        check_pipeline({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 3}})
    check_pipeline({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}})


def test_tensor_parallel_size_must_divide_heads():
    from transformers import LlamaConfig

    from dstrain.components.tensor_parallel import check_heads
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2)
    check_heads(config, 2)
    with pytest.raises(UserError, match="autotp_size=4 does not divide the model's num_key_value_heads=2"):
        check_heads(config, 4)


@pytest.mark.parametrize("family,style", [("olmo2", "rowwise_split_input"), ("phi3", "rowwise_split_input"),
                                          ("glm4", "rowwise_split_input"), ("deepseek_v3", "mla_kv_a_proj")])
def test_a_tensor_parallel_plan_autotp_cannot_apply_is_one_line_before_anything_is_built(family, style):
    """Issue 85: these families' transformers plans hold a style DeepSpeed's AutoTP refuses: before, every rank's
    traceback from deepspeed.initialize once the model was built; now one line from the config alone."""
    from transformers import AutoConfig

    from dstrain.components.tensor_parallel import check_plan
    with pytest.raises(UserError) as caught:
        check_plan(AutoConfig.for_model(family), {})
    line = str(caught.value)
    assert line.startswith(f"tensor_parallel with {family}: DeepSpeed's AutoTP cannot apply") and style in line
    assert "\n" not in line and line.endswith("use a ds_config without tensor_parallel (ZeRO-3 shards the weights "
                                              "instead)")
    for attention_only in ("llama", "qwen3", "gemma3_text", "mistral"):  # held exact on 2 ranks (docs/models.md)
        check_plan(AutoConfig.for_model(attention_only), {})


def _tp_check(family_config, check_layouts=True, section=None):
    from dstrain.components.tensor_parallel import check_family
    said = []
    check_family(family_config, section or {}, check_layouts, said.append)
    return said


@pytest.mark.parametrize("family,reason", [
    ("codegen", "AutoTP's split gives other logits than the whole model (0.89 apart on a small copy over 2 ranks)"),
    ("fuyu", "AutoTP's split gives other logits than the whole model"),
    ("bart", "AutoTP fails on it (AssertionError: Not able to determine model policy automatically"),
    ("bloom", "AutoTP fails on it (RuntimeError"),
    ("lfm2", "AutoTP finds no layer to split between the embedding and the head")])
def test_a_family_autotp_splits_wrong_fails_on_or_splits_nothing_of_is_one_line_before_the_build(family, reason):
    """Issue 85: scripts/family_tensor_parallel.py --all over every family the matrix builds found CodeGen's (its
    fused qkv_proj) and Fuyu's splits 0.89 and 1.07 off the whole model's logits: a wrong model with exit 0 before;
    others failed after the build with a traceback from every rank (bart's AutoTP parse, bloom's first forward), and
    LFM2's split nothing (refused after the engine existed). Now one line from the config, before anything is built."""
    from transformers import AutoConfig
    with pytest.raises(UserError) as caught:
        _tp_check(AutoConfig.for_model(family))
    line = str(caught.value)
    assert line.startswith(f"tensor_parallel with {family}: {reason}") and "\n" not in line, line
    assert line.endswith("use a ds_config without tensor_parallel (ZeRO-3 shards the weights instead)")


def test_a_family_held_exact_under_autotp_is_said_and_an_unseen_one_refused_unless_unchecked():
    """The families verified on 2 ranks train with a line saying so; a family the table has not seen (a newer
    transformers, remote code: here a config class registered by the test) is refused with the command that checks
    it, or said unverified with model.check_layouts=false; a JSON with its own partition is said, not checked."""
    from unittest.mock import patch

    import deepspeed
    from transformers import AutoConfig, LlamaConfig
    said = _tp_check(AutoConfig.for_model("llama"))
    assert said == [said[0]] and said[0].startswith("tensor parallelism: llama verified under AutoTP (2 ranks, a "
                                                    "small copy: exact (")

    class UnseenConfig(LlamaConfig):
        model_type = "dstrain_unseen_family"
    with pytest.raises(UserError, match=r"^tensor_parallel with dstrain_unseen_family: AutoTP has not been verified "
                                        r"on this family \(`python scripts/family_tensor_parallel.py "
                                        r"dstrain_unseen_family` checks it"):
        _tp_check(UnseenConfig())
    assert _tp_check(UnseenConfig(), check_layouts=False) == [
        "tensor parallelism: dstrain_unseen_family has not been verified under AutoTP (model.check_layouts=false)"]
    own = _tp_check(AutoConfig.for_model("codegen"), section={"preset_model": "codegen"})
    assert own and "own partition_config / preset_model (not verified" in own[0]
    # verdicts found with another deepspeed or transformers than the installed one: said with the command
    from dstrain.components import tensor_parallel as tp
    table = dict(tp.verdicts(), deepspeed="0.0.1")
    with patch.object(tp, "verdicts", lambda: table):
        said = _tp_check(AutoConfig.for_model("llama"))
    assert said[0].endswith("found with deepspeed 0.0.1 and transformers " + table["transformers"] + ", this is "
                            + deepspeed.__version__ + " and " + table["transformers"] +
                            ": `make family-tensor-parallel` checks again")
    # a split whose logits came out in another shape (the script records no difference) is refused all the same
    shaped = dict(table, rows=[{"family": "llama", "verdict": "differs", "difference": None}])
    with patch.object(tp, "verdicts", lambda: shaped), pytest.raises(UserError, match=r"^tensor_parallel with llama: "
                                                                     r"AutoTP's split gives other logits than the "
                                                                     r"whole model \(logits of another shape on"):
        _tp_check(AutoConfig.for_model("llama"))


def test_the_tensor_parallel_table_covers_every_family_the_matrix_builds_and_docs_show_it():
    """dstrain/components/tensor_parallel_families.json (scripts/family_tensor_parallel.py --all --write) has a verdict
    for every family docs/family_matrix.json built small, for the installed deepspeed and transformers, and
    docs/models.md shows it."""
    import json

    import deepspeed
    import transformers

    from dstrain.components import tensor_parallel as tp
    table = tp.verdicts()
    built = {r["family"] for r in json.loads((ROOT / "docs/family_matrix.json").read_text())["rows"] if r["built"]}
    assert built <= {r["family"] for r in table["rows"]}
    assert (table["deepspeed"], table["transformers"]) == (deepspeed.__version__, transformers.__version__)
    assert {r["verdict"] for r in table["rows"]} <= {"exact", "plan", "fails", "differs", "splits nothing"}
    assert tp.table(table) in (ROOT / "docs/models.md").read_text()
