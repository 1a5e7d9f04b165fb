import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.torchvision_side import activate as _torchvision

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torchvision for the vision families' processors, here and in the warm ranks (tests/torchvision_side.py)
_torchvision()


def _save(model, tokenizer_src: Path, out: Path) -> Path:
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_src / f, out / f)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """The default recipe's Llama architecture with fixed random weights, saved as a real HF checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(config), ROOT / "recipes/tiny/model",
                 tmp_path_factory.mktemp("models") / "tiny-llama")


def _tiny_gpt2(tmp_path_factory, name: str, dropout: float) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=576, n_positions=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return _save(GPT2LMHeadModel(config), ROOT / "recipes/tiny/model", tmp_path_factory.mktemp("models") / name)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    return _tiny_gpt2(tmp_path_factory, "tiny-gpt2", 0.0)


@pytest.fixture(scope="session")
def tiny_gpt2_dropout(tmp_path_factory) -> Path:
    """Dropout in every block: a step's randomness depends on the RNG state a resume must restore."""
    return _tiny_gpt2(tmp_path_factory, "tiny-gpt2-dropout", 0.1)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """One tokenized-data cache for the whole session, as a user's ~/.cache/dstrain would be."""
    return tmp_path_factory.mktemp("dstrain-cache")


@pytest.fixture(scope="session")
def medium_llama(tmp_path_factory) -> Path:
    """23.5M parameters: large enough that model states dwarf allocator noise in peak-memory checks."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.update({"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64})
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(config), ROOT / "recipes/tiny/model",
                 tmp_path_factory.mktemp("models") / "medium-llama")


@pytest.fixture(scope="session")
def tiny_llama_mha(tmp_path_factory) -> Path:
    """tiny_llama with as many key/value heads as query heads (multi-head, not grouped-query, attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.update({"num_hidden_layers": 2, "num_key_value_heads": config.num_attention_heads})
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(config), ROOT / "recipes/tiny/model",
                 tmp_path_factory.mktemp("models") / "tiny-llama-mha")


def _tiny_moe(tmp_path_factory, family: str, folder: str, head_dim: bool, **config) -> Path:
    """A tiny Mixture-of-Experts model of `family` in the tiny Llama's shape and tokenizer (its head_dim too where
    the family takes one), 2 layers with an intermediate size of 128, seeded as every tiny model is."""
    from transformers import AutoConfig, AutoModelForCausalLM
    llama = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    keys = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "bos_token_id",
            "eos_token_id", "pad_token_id", "tie_word_embeddings", "max_position_embeddings") + \
        (("head_dim",) if head_dim else ())
    model_config = AutoConfig.for_model(family, **{k: getattr(llama, k) for k in keys}, num_hidden_layers=2,
                                        intermediate_size=128, **config)
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(model_config), ROOT / "recipes/tiny/model",
                 tmp_path_factory.mktemp("models") / folder)


def _tiny_family(tmp_path_factory, family: str, folder: str, **config) -> Path:
    """A 2-layer model of `family` in the tiny Llama's width and tokenizer (issue 85's layout checks)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    llama = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    keys = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "bos_token_id",
            "eos_token_id", "pad_token_id", "tie_word_embeddings", "max_position_embeddings", "head_dim")
    model_config = AutoConfig.for_model(family, **{k: getattr(llama, k) for k in keys}, num_hidden_layers=2,
                                        intermediate_size=128, **config)
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(model_config), ROOT / "recipes/tiny/model",
                 tmp_path_factory.mktemp("models") / folder)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    """Gemma 3's text model: a sliding-window layer (window 16, under the tests' 64-token rows) then a global one."""
    return _tiny_family(tmp_path_factory, "gemma3_text", "tiny-gemma3", sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="session")
def tiny_mistral_window(tmp_path_factory) -> Path:
    """Mistral with a sliding window of 16 under the tests' 64-token rows (Mistral-7B-v0.1's 4096, scaled down)."""
    return _tiny_family(tmp_path_factory, "mistral", "tiny-mistral-window", sliding_window=16)


@pytest.fixture(scope="session")
def tiny_bamba(tmp_path_factory) -> Path:
    """Bamba: a Mamba-2 layer then an attention layer (a state-space hybrid)."""
    return _tiny_family(tmp_path_factory, "bamba", "tiny-bamba", attn_layer_indices=[1], mamba_n_heads=16,
                        mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """A Mixture-of-Experts model in the tiny Llama's shape (the same tokenizer): 2 layers of 4 routed experts,
    2 per token, with a load-balancing weight of 0.02 (Mixtral's default, 0.001, would hardly move the loss)."""
    return _tiny_moe(tmp_path_factory, "mixtral", "tiny-mixtral", True, num_local_experts=4, num_experts_per_tok=2,
                     router_aux_loss_coef=0.02)


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory) -> Path:
    """DeepSeek-V3's architecture in the tiny Llama's width: 2 layers, each of 4 routed experts (2 per token) beside
    1 shared expert, multi-head latent attention; its router balances with a bias, not a loss."""
    return _tiny_moe(tmp_path_factory, "deepseek_v3", "tiny-deepseek", False, n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=0,
                     kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                     n_group=1, topk_group=1)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE in the tiny Llama's shape: 2 layers, each of 4 routed experts (2 per token, normalised top-k
    weights) of width 64, q/k norms, the load-balancing weight 0.02."""
    return _tiny_moe(tmp_path_factory, "qwen3_moe", "tiny-qwen3-moe", True, moe_intermediate_size=64, num_experts=4,
                     num_experts_per_tok=2, router_aux_loss_coef=0.02, decoder_sparse_step=1, mlp_only_layers=[])


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> Path:
    """Qwen2-MoE in the tiny Llama's shape: 2 layers, each of 4 routed experts (2 per token) of width 64 beside a
    shared expert of width 64 behind its sigmoid gate, the load-balancing weight 0.02."""
    return _tiny_moe(tmp_path_factory, "qwen2_moe", "tiny-qwen2-moe", False, moe_intermediate_size=64,
                     shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                     router_aux_loss_coef=0.02, decoder_sparse_step=1, mlp_only_layers=[])


# The order `make test`'s two workers take the test files in (pytest-xdist, --dist loadfile
# --no-loadscope-reorder): the longest files first, so the run does not end with one worker alone on a
# five-minute file while the other idles. xdist's own order (most tests first) put the one-test Docker file
# last: the whole image build ran on one worker after the other had finished. Figures: worker-seconds per file in
# the parallel part on 2 cores (2026-12-07, 061cf1a's suite run alone here; the speed bench's estimated before it
# joined the parallel part); files not listed follow, e2e before unit.
LONGEST_FIRST = {
    "e2e/test_faults.py": 230, "cluster/test_sweep.py": 230, "cluster/test_docker.py": 200,
    "e2e/test_default_recipe.py": 180, "e2e/test_vs_reference.py": 170, "e2e/test_signals.py": 160,
    "e2e/test_muon.py": 150, "cluster/test_slurm.py": 140, "e2e/test_diloco.py": 140, "e2e/test_lora.py": 140,
    "e2e/test_moe.py": 130, "e2e/test_elastic.py": 130, "e2e/test_bench_speed.py": 110, "e2e/test_memory.py": 110,
    "cluster/test_hostfile.py": 80, "e2e/test_vision.py": 70, "e2e/test_preference.py": 70,
    "e2e/test_prepared_data.py": 70, "e2e/test_resume.py": 60, "e2e/test_errors.py": 50,
    "e2e/test_data_layouts.py": 50, "e2e/test_bench_loss_chunks.py": 50, "e2e/test_run_dir.py": 50,
    "e2e/test_background_save.py": 40, "e2e/test_ring_attention.py": 40, "e2e/test_sequence_parallel.py": 40,
    "e2e/test_gradient_compression.py": 40, "e2e/test_rl_vs_trl.py": 30, "e2e/test_tensor_parallel.py": 30,
    "e2e/test_health.py": 20, "e2e/test_pipeline.py": 20, "e2e/test_init.py": 20,
    # the unit files keep the order they had (make test-fast runs them in one process in this order): with
    # test_compression.py and test_prepared_data.py before test_compiler.py, its background-compile test counted 2
    # graphs for 3 identical blocks in 2 of 3 runs (a guard on the blocks' `cache` keyword failed to build; not
    # explained yet, and not seen alone or in the old order)
    "unit/test_preference.py": 90, "unit/test_ds_internals.py": 80, "unit/test_ring_attention.py": 40,
}
# after every other launched file, before the unit files: the one test that loads DeepSpeed's AsyncIO op, which
# `make test` builds beside the parallel part at the lowest priority (Makefile: PREBUILD_LATER); by then the idle
# moments of the files before it have built most of it
LATE = ("e2e/test_nvme_offload.py",)


def pytest_collection_modifyitems(config, items):
    def weight(item) -> tuple[int, int]:
        name = item.path.relative_to(ROOT / "tests").as_posix()
        return -LONGEST_FIRST.get(name, 0), 1 if name in LATE else 0 if name.startswith(("e2e/", "cluster/")) else 2
    items.sort(key=weight)  # stable: a file's tests keep their order
    # `make test`'s serial part collects only the files that write pytest.mark.serial (Makefile: SERIAL_FILES): a
    # test marked another way (a conftest, a mark made elsewhere) would run in neither part
    unseen = sorted({str(item.path) for item in items if item.get_closest_marker("serial")
                     and "pytest.mark.serial" not in item.path.read_text()})
    if unseen:
        raise pytest.UsageError(f"serial tests in files that do not write pytest.mark.serial: {unseen}")


def vlm_template(placeholder: str) -> str:
    """A template for the tiny vision-language models: an image part renders as the model's placeholder."""
    return ("{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + placeholder + "' }}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def vlm_template_tagged(placeholder: str) -> str:
    """The run's template (conftest.vlm_template) with transformers' assistant-mask tags around what the assistant
    writes: its reply and end of turn."""
    content = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
               "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + placeholder + "' }}"
               "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ eos_token }}")
    template = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
                "{% if message['role'] == 'assistant' %}{% generation %}" + content + "{% endgeneration %}{% else %}" +
                content + "{% endif %}{% endfor %}")
    untagged = template.replace("{% generation %}", "").replace("{% endgeneration %}", "").replace(
        "{% if message['role'] == 'assistant' %}" + content + "{% else %}" + content + "{% endif %}", content)
    assert untagged + "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}" == vlm_template(placeholder)
    return template


VLM_COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
VLM_PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>",
                   "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "smolvlm": "<image>"}


def _tiny_vlm(root: Path, family: str) -> Path:
    """A tiny vision-language model of `family` with its processor, built from configs (no hub), seeded, on the
    tiny Llama's tokenizer (image tokens added), and `data/train.jsonl`: 48 rows in TRL's vision layout (an
    `images` column of paths relative to the file, a user turn with image parts) asking the colours of one or two
    squares of 3 sizes only the images show, or, a third of them, no image at all. llava: recipes/tiny/vlm_model's
    (a CLIP tower of 28 px in 7 px patches: 16 image tokens, a projector, the tiny Llama of 2 layers). gemma3: a SigLIP tower pooled to 4 image tokens that attend to each other both ways
    (token_type_ids), Gemma 3's text model with a sliding and a full attention layer."""
    import json
    import random

    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    if family in ("qwen2_5_vl", "smolvlm") and importlib.util.find_spec("torchvision") is None:
        message = f"{family}'s processor needs torchvision: `make test-fast` puts it beside the venv"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    if family == "llava":  # the tiny vision-language recipe's model (scripts/make_tiny_assets.py: make_vlm)
        from transformers import AutoProcessor
        config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/vlm_model")
        processor = AutoProcessor.from_pretrained(ROOT / "recipes/tiny/vlm_model")
        assert processor.chat_template == vlm_template("<image>")
    elif family == "qwen2_5_vl":  # its processor needs torchvision (tests/torchvision_side.py)
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        tok = AutoTokenizer.from_pretrained(ROOT / "recipes/tiny/model", extra_special_tokens={
            "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>"})
        processor = Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56), tokenizer=tok,
            video_processor=Qwen2VLVideoProcessor(), chat_template=vlm_template(VLM_PLACEHOLDER[family]))
        ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start",
                                                                          "vision_end")}
        config = Qwen2_5_VLConfig(
            text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
                         "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, "bos_token_id": 1,
                         "eos_token_id": 2, "pad_token_id": 3},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 56},
            image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
            vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])
    elif family == "smolvlm":  # its processor needs torchvision and num2words
        from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor
        from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
        tok = AutoTokenizer.from_pretrained(ROOT / "recipes/tiny/model", extra_special_tokens={
            "image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>"},
            additional_special_tokens=[f"<row_{i}_col_{j}>" for i in (1, 2) for j in (1, 2)])
        # each image resized to 56 px on its longest side and cut into 28 px tiles (2 x 2 here), each tile and the
        # whole image one image token (a 28 px tower in 7 px patches, pixel-shuffled by 4)
        processor = SmolVLMProcessor(
            image_processor=SmolVLMImageProcessor(do_image_splitting=True, max_image_size={"longest_edge": 28},
                                                  size={"longest_edge": 56}),
            tokenizer=tok, video_processor=SmolVLMVideoProcessor(), image_seq_len=1,
            chat_template=vlm_template(VLM_PLACEHOLDER[family]))
        config = SmolVLMConfig(
            text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                         "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3},
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 28, "patch_size": 7},
            scale_factor=4, image_token_id=tok.convert_tokens_to_ids("<image>"))
    else:
        from transformers import Gemma3Config, Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        tok = AutoTokenizer.from_pretrained(ROOT / "recipes/tiny/model", extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
        processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                                    tokenizer=tok, chat_template=vlm_template("<start_of_image>"), image_seq_length=4)
        text = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                                sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                bos_token_id=1, eos_token_id=2, pad_token_id=3)
        config = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=7), mm_tokens_per_image=4, boi_token_index=tok.boi_token_id,
            eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"), image_token_index=tok.image_token_id)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(root / "model")
    processor.save_pretrained(root / "model")
    rng = random.Random(0)
    (root / "data" / "images").mkdir(parents=True)
    with open(root / "data" / "train.jsonl", "w") as f:
        for i in range(48):  # one image, two, or none: micro-batches hold different numbers of images
            count = (1, 2, 0)[i % 3]
            colours = [rng.choice(list(VLM_COLOURS)) for _ in range(count)]
            names = []
            for k, colour in enumerate(colours):
                names.append(f"images/{i:03d}_{k}.png")
                Image.new("RGB", rng.choice([(28, 28), (40, 30), (32, 48)]), VLM_COLOURS[colour]).save(
                    root / "data" / names[-1])
            question = {0: "Say hello.", 1: "What colour is it?", 2: "What colours are they?"}[count]
            answer = " and ".join(colours) if colours else "Hello"
            f.write(json.dumps({"images": names, "messages": [
                {"role": "user", "content": [{"type": "image"}] * count + [{"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": f"{answer}."}]}]}) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny LLaVA and its rows (_tiny_vlm)."""
    return _tiny_vlm(tmp_path_factory.mktemp("vlm"), "llava")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_vlm(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL (dynamic resolution: 1 to 4 image tokens an image; 3-D rotary positions; a windowed and a
    full attention block in its vision tower, the merger its projector) and its rows (_tiny_vlm)."""
    return _tiny_vlm(tmp_path_factory.mktemp("vlm-qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_smolvlm_vlm(tmp_path_factory) -> Path:
    """A tiny SmolVLM (each image split into tiles beside the whole, rows of several tiles and images padded with
    blank ones by its processor) and its rows (_tiny_vlm)."""
    return _tiny_vlm(tmp_path_factory.mktemp("vlm-smolvlm"), "smolvlm")


@pytest.fixture(scope="session")
def tiny_gemma3_vlm(tmp_path_factory) -> Path:
    """A tiny Gemma 3 (image tokens attending both ways) and its rows (_tiny_vlm)."""
    return _tiny_vlm(tmp_path_factory.mktemp("vlm-gemma3"), "gemma3")
