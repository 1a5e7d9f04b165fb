"""Pipeline conversion errors that need no process group."""
import pytest

from dstrain.components import pipeline
from dstrain.errors import UserError
from dstrain.parallel.ds_config import check_pipeline


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
