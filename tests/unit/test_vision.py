"""Vision-language rows and models in-process (issue 86): the data path against the processor's own output, the
images as datasets' Image feature, the refusals, and which modules are the vision tower, the projector and the
language model (what freezing and LoRA's exclusion act on) on LLaVA and on Qwen2-VL's naming."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from dstrain import vision
from dstrain.config import DataConfig, ModelConfig
from dstrain.data.formats import images as rows_with_images
from dstrain.errors import UserError
from tests.conftest import VLM_PLACEHOLDER


@pytest.fixture(scope="module")
def processor(tiny_vlm):
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(tiny_vlm / "model")
    processor.tokenizer._dstrain_processor = processor
    return processor


def _messages(*texts):
    out = []
    for n, text in enumerate(texts):
        role = "user" if n % 2 == 0 else "assistant"
        content = [{"type": "image"}, {"type": "text", "text": text}] if role == "user" else text
        out.append({"role": role, "content": content})
    return out


def test_two_turns_two_images_train_on_the_replies_only(processor):
    """Each image part becomes the processor's image tokens in the prompt's pieces; the labels are the replies
    (and their end of turn) exactly, never an image token; the pixels are the processor's for the two images."""
    from PIL import Image
    tok = processor.tokenizer
    pictures = [Image.new("RGB", (28, 28), (200, 0, 0)), Image.new("RGB", (40, 30), (0, 0, 200))]
    messages = _messages("What colour?", "Red.", "And this one?", "Blue.")
    ids, labels, extras = rows_with_images.tokens(messages, pictures, tok, processor)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == 32  # 16 a picture: (28 / 7)^2 patches
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert tok.decode(trained) == "Red.</s>Blue.</s>"
    assert all(label == -100 for i, label in zip(ids, labels) if i == image_id)
    whole = processor(text=[tok.apply_chat_template(messages, tokenize=False)], images=pictures, return_tensors="np")
    assert ids == whole["input_ids"][0].tolist()  # the same ids as the processor on the whole conversation
    assert torch.allclose(torch.tensor(extras["pixel_values"]), torch.tensor(whole["pixel_values"]))


def test_images_as_datasets_image_feature_give_the_rows_paths_give(tiny_vlm, processor, tmp_path):
    """The same rows with their images as files and as datasets' Image feature (decoded to PIL images, as a
    save_to_disk or parquet dataset gives them) tokenize to the same ids, labels and pixels."""
    import datasets
    lines = [json.loads(line) for line in (tiny_vlm / "data/train.jsonl").read_text().splitlines()[:4]]
    as_paths = datasets.Dataset.from_list(lines)
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()),
                                  "messages": as_paths.features["messages"]})
    as_feature = datasets.Dataset.from_dict(
        {"images": [[str(tiny_vlm / "data" / p) for p in r["images"]] for r in lines],
         "messages": [r["messages"] for r in lines]}, features=features)
    as_feature.save_to_disk(str(tmp_path / "saved"))
    as_feature = datasets.load_from_disk(str(tmp_path / "saved"))
    from dstrain.data.formats.chat import to_messages, to_tools
    out = []
    for data, path in ((as_paths, tiny_vlm / "data/train.jsonl"), (as_feature, tmp_path / "saved")):
        cfg = DataConfig(path=str(path), format="chat", val_fraction=0)
        out.append(rows_with_images.tokenize(data, cfg, processor.tokenizer, 64, None, to_messages, to_tools)[0])
    for a, b in zip(*out):
        assert a == b


def test_an_image_that_does_not_fit_and_a_template_without_images_are_one_line(tiny_vlm, processor):
    from PIL import Image
    tok = processor.tokenizer
    ids, labels, extras = rows_with_images.tokens(_messages("What colour?", "Red."), [Image.new("RGB", (28, 28))],
                                                  tok, processor)
    with pytest.raises(UserError, match=r"row 3: its images end at token 17 and train.seq_len=10 would cut an image"):
        rows_with_images.fit(ids, labels, extras, 10, 0, rows_with_images.image_token_ids(processor), "data row 3")
    saved = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m['content'] if m['content'] is string else '' }}{% endfor %}"
        with pytest.raises(UserError, match=r"does not render an image part as the processor's image token \(<image>"):
            rows_with_images.check_template(tok, processor)
    finally:
        tok.chat_template = saved


def test_image_parts_reach_a_vision_model_and_are_refused_for_a_text_model():
    from dstrain.chat_templates import normalize
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert normalize(messages, {}, images=True)[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Hi"}]
    with pytest.raises(UserError, match="content parts of type image; only text parts are trained"):
        normalize(messages, {})


def test_tower_projector_and_language_model_are_told_apart(tiny_vlm):
    """LLaVA's modules by our generic split, checked against its own attribute names; peft's exclusion pattern
    matches the tower's and projector's linear layers and none of the language model's (Qwen2-VL's names too)."""
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm / "model")
    parts = vision.vision_parts(model)
    assert {id(p) for p in parts["tower"]} == {id(p) for p in model.model.vision_tower.parameters()}
    assert {id(p) for p in parts["projector"]} == {id(p) for p in model.model.multi_modal_projector.parameters()}
    assert vision.vision_parameters(model) == sum(p.numel() for part in parts.values() for p in part)
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    excluded = {n for n in linear if re.fullmatch(vision.NOT_LANGUAGE_MODEL, n)}
    assert excluded == {n for n in linear if not n.startswith("model.language_model.")} and excluded
    for name in ("model.visual.blocks.0.attn.qkv", "model.visual.merger.mlp.0"):
        assert re.fullmatch(vision.NOT_LANGUAGE_MODEL, name)
    assert not re.fullmatch(vision.NOT_LANGUAGE_MODEL, "model.language_model.layers.0.self_attn.q_proj")
    note = vision.freeze(model, type("Model", (), {"train_vision_tower": False, "train_projector": True})())
    assert "the vision tower frozen" in note
    assert not any(p.requires_grad for p in parts["tower"]) and all(p.requires_grad for p in parts["projector"])


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "smolvlm"])
def test_a_blank_image_after_an_imageless_micro_batch_changes_nothing_but_runs_the_tower(request, family):
    """with_fake_image: the real tokens' logits are the same to fp32 rounding with the blank image appended, the
    loss's gradient reaches the vision tower as exact zeros (its parameters all get a gradient, as every rank's
    collectives need), and the per-token inputs mark the blank image's tokens only."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from dstrain.data.formats.images import fake_image, with_fake_image
    root = request.getfixturevalue("tiny_vlm" if family == "llava" else f"tiny_{family}_vlm")
    processor = AutoProcessor.from_pretrained(root / "model")
    model = AutoModelForImageTextToText.from_pretrained(root / "model", dtype=torch.float32).train()
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."},
                                                    {"role": "assistant", "content": "Hello."}], tokenize=False)
    enc = processor.tokenizer([text, text[:-8]], padding="max_length", max_length=24, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "labels": torch.where(enc["attention_mask"].bool(), enc["input_ids"], -100)}
    if family != "llava":
        batch["token_type_ids" if family == "gemma3" else "mm_token_type_ids"] = torch.zeros_like(batch["input_ids"])
    faked = with_fake_image(batch, fake_image(processor, processor.tokenizer.pad_token_id))
    assert "pixel_values" in faked and faked["input_ids"].shape[1] > 24
    assert torch.equal(faked["input_ids"][:, :24], batch["input_ids"]) and faked["attention_mask"][:, 24:].sum() == 0
    if family == "gemma3":
        assert faked["token_type_ids"][0, 24:].sum() == 4 and faked["token_type_ids"][:, :24].sum() == 0
    plain = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    with_blank = model(**{k: v for k, v in faked.items() if k != "labels"}).logits
    real = batch["attention_mask"].bool()
    assert torch.allclose(with_blank[:, :24][real], plain[real], atol=1e-5)
    logits, labels = with_blank[:, :-1], faked["labels"][:, 1:]
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)).backward()
    tower = getattr(model.model, {"qwen2_5_vl": "visual", "smolvlm": "vision_model"}.get(family, "vision_tower"))
    tower = dict(tower.named_parameters())
    reached = {n for n, p in tower.items() if p.grad is not None}
    assert all(torch.count_nonzero(tower[n].grad) == 0 for n in reached)
    model.zero_grad(set_to_none=True)  # the parameters a real image's loss reaches: the same ones
    from PIL import Image
    image = VLM_PLACEHOLDER[family] if family == "qwen2_5_vl" else processor.image_token  # Qwen: the start tag too
    pictured = processor(text=[image + "Red."], images=[Image.new("RGB", (28, 28), (200, 0, 0))],
                         return_tensors="pt")
    model(**pictured, labels=pictured["input_ids"]).loss.backward()
    assert reached == {n for n, p in tower.items() if p.grad is not None} and reached


def test_llavas_layout_trains_as_trls(tiny_vlm, processor, tmp_path):
    """LLaVA's layout (`image`: one path; ShareGPT `conversations` with `<image>` in the human turn's text) gives the
    same rows as the same data in TRL's vision layout; given to a text model, its image column is one line."""
    import datasets

    from dstrain.data.formats import chat
    lines = [json.loads(line) for line in (tiny_vlm / "data/train.jsonl").read_text().splitlines()[:6]]
    lines = [r for r in lines if len(r["images"]) == 1]
    llava = []
    for r in lines:
        user, reply = r["messages"]
        question = "".join("<image>" if p["type"] == "image" else p["text"] for p in user["content"])
        llava.append({"image": r["images"][0], "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": reply["content"][0]["text"]}]})
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(llava))
    (tmp_path / "images").symlink_to(tiny_vlm / "data" / "images")
    out = []
    for data, cfg in ((datasets.Dataset.from_list(lines), DataConfig(path=str(tiny_vlm / "data/train.jsonl"),
                                                                     format="chat", val_fraction=0)),
                      (datasets.Dataset.from_list(llava), DataConfig(path=str(path), format="chat", val_fraction=0,
                                                                     messages_field="conversations"))):
        out.append(chat.tokenize(data, cfg, processor.tokenizer, 64, None)[0])
    assert len(out[0]) == len(out[1]) == len(lines) > 0
    for a, b in zip(*out):
        assert a == b
    from transformers import AutoTokenizer
    text_model = AutoTokenizer.from_pretrained(tiny_vlm / "model")
    cfg = DataConfig(path=str(path), format="chat", val_fraction=0, messages_field="conversations")
    assert vision.processor_of(text_model) is None
    with pytest.raises(UserError, match=r"has images \(its 'image' column\), and the model is a text model"):
        rows_with_images.refuse_for_text_model(datasets.Dataset.from_list(llava), cfg)
    preference = datasets.Dataset.from_list([{"prompt": "Which?", "chosen": "a", "rejected": "b", "images": ["x.png"]}])
    with pytest.raises(UserError, match=r"has images \(its 'images' column\)"):  # any data format
        rows_with_images.refuse_for_text_model(preference, DataConfig(path="pairs.jsonl", format="preference"))


def test_lora_adapts_the_language_model_alone_unless_asked(tiny_vlm):
    """Lora.validate's default on a vision-language model: adapters on the language model's linear layers only
    (r x (in + out) each); lora.vision_tower=true puts them on the tower's and projector's too."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from dstrain.components.lora import Lora
    from dstrain.config import LoraSection, Recipe
    config = AutoConfig.from_pretrained(tiny_vlm / "model")
    model = AutoModelForImageTextToText.from_config(config)
    language = sum(8 * (m.in_features + m.out_features) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.startswith("model.language_model."))
    everywhere = sum(8 * (m.in_features + m.out_features) for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n != "lm_head")
    counted = {}
    for on in (False, True):
        recipe = Recipe()
        recipe.model.name_or_path, recipe.lora = str(tiny_vlm / "model"), LoraSection(r=8, vision_tower=on)
        setup = type("Setup", (), {"recipe": recipe, "model_config": config, "init_from": None, "precision": "fp32",
                                   "ds_cfg": {}, "log": print,
                                   "layout": type("Layout", (), {"is_pipeline": False, "tensor_parallel": 1})()})()
        lora = Lora(recipe.lora)
        lora.validate(setup)
        counted[on] = lora.trainable
    assert counted == {False: language, True: everywhere} and language < everywhere


@pytest.fixture(scope="module")
def real_vlm_configs(tmp_path_factory):
    """The hub configs of the two vision recipes' models (their published shapes), saved locally: no hub here."""
    from transformers import AutoConfig

    q25 = tmp_path_factory.mktemp("qwen2.5-vl-7b")
    AutoConfig.for_model(
        "qwen2_5_vl", image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        tie_word_embeddings=False,
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_theta=1000000.0, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                           hidden_act="silu")).save_pretrained(q25)
    q3 = tmp_path_factory.mktemp("qwen3-vl-8b")
    AutoConfig.for_model(
        "qwen3_vl", image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        tie_word_embeddings=False,
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                         rope_theta=5000000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20],
                                       "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                           out_hidden_size=4096, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                           hidden_act="gelu_pytorch_tanh")).save_pretrained(q3)
    return {"qwen2.5-vl-7b/lora_sft.yaml": q25, "qwen3-vl-8b/sft_zero3.yaml": q3}


# the published sizes: Qwen2.5-VL-7B-Instruct 8.29B, Qwen3-VL-8B-Instruct 8.77B (their model cards)
@pytest.mark.parametrize("name,published", [("qwen2.5-vl-7b/lora_sft.yaml", 8.29e9),
                                            ("qwen3-vl-8b/sft_zero3.yaml", 8.77e9)])
def test_the_vision_recipes_fit_the_hardware_they_name(real_vlm_configs, name, published):
    """Each shipped vision-language recipe passes --preflight on the GPUs its first lines name (one node of 8 H100
    80GB), counting the whole model: vision tower and projector with the language model."""
    from pathlib import Path

    from dstrain.config import load_recipe, parse_overrides
    from dstrain.parallel import ds_config as dsc
    from dstrain.planner import memory

    path = Path(__file__).parents[2] / "recipes" / name
    assert "--device h100-80gb" in path.read_text() and f"--recipe {name}" in path.read_text()
    recipe = load_recipe(name, parse_overrides([f"--model.name_or_path={real_vlm_configs[name]}",
                                                "--model.tokenizer=recipes/tiny/model"]))
    gpu = dsc.DeviceCaps("cuda", bf16=True, fp16=True)
    fits, text = memory.preflight(recipe, dsc.load(recipe.ds_config), recipe.ds_config, 8, 8, gpu,
                                  memory.target_device("h100-80gb", None))
    assert fits, text
    counted = [float(n.replace(",", "")) * 1e6 for n in re.findall(r"([\d,]+\.\d)M parameters", text)]
    assert counted and abs(counted[0] - published) < 0.01 * published, text  # the tower counted too
    if recipe.lora.enabled:  # adapters on the language model's linear layers alone, as the run puts them (the
        # preflight counted the tower's and projector's too: 51.8M against the run's 40.4M)
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(real_vlm_configs[name])
        with torch.device("meta"):
            language_model = vision.model_class(config).from_config(config).model.language_model
        adapters = sum(recipe.lora.r * (m.in_features + m.out_features) for m in language_model.modules()
                       if isinstance(m, torch.nn.Linear))
        assert f"LoRA r={recipe.lora.r}: {adapters / 1e6:,.1f}M adapter parameters train" in text, text


def test_the_estimate_counts_a_frozen_tower_as_weights_and_its_activations_as_the_sequences_bound_them(
        real_vlm_configs, monkeypatch):
    """Issue 86: the preflight counted the tower and projector with gradients and optimizer states although they
    are frozen by default, and none of the tower's activations. Qwen3-VL-8B's recipe (ZeRO-3 on 8 ranks, bf16,
    tower and projector frozen, 1 x 4096 tokens a micro-batch, activation checkpointing): the optimizer holds the
    language model's states alone; the frozen tower runs one layer at a time over at most 4096 x 4 patches (every
    token an image token, each merged from 2 x 2 patches of 16 x 16 pixels x 2 frames); trained, it keeps each of
    its 27 layers' inputs (checkpointed) or every layer's activations. Seen failing before the change: the
    optimizer states held the tower's and projector's too, and the activations no tower term."""
    from transformers import AutoConfig

    from dstrain.config import load_recipe, parse_overrides
    from dstrain.parallel import ds_config as dsc
    from dstrain.parallel.layout import Layout
    from dstrain.planner import memory

    name = "qwen3-vl-8b/sft_zero3.yaml"
    config = AutoConfig.from_pretrained(real_vlm_configs[name])

    def estimate(*extra):
        recipe = load_recipe(name, parse_overrides([f"--model.name_or_path={real_vlm_configs[name]}",
                                                    "--model.tokenizer=recipes/tiny/model", *extra]))
        cfg = dsc.resolve(dsc.load("zero3.json"), recipe, 8, dsc.DeviceCaps("cuda", bf16=True, fp16=True),
                          hidden_size=4096)
        psi = memory.count_parameters(config)
        return recipe, psi, memory.estimate(config, psi, recipe, cfg, Layout.from_ds_config(cfg, 8))

    sizes = vision.part_sizes(config)
    assert sizes["tower"] > 5e8 and 0 < sizes["projector"] < sizes["tower"] and not sizes["gated"]
    # Qwen2.5-VL's tower has gated MLPs (gate, up, down): 4 f elements a patch
    assert vision.part_sizes(AutoConfig.from_pretrained(real_vlm_configs["qwen2.5-vl-7b/lora_sft.yaml"]))["gated"]
    recipe, psi, frozen = estimate()
    _, _, trained = estimate("--model.train_vision_tower=true", "--model.train_projector=true")
    assert frozen.device["optimizer_states"] == 12 * ((psi - sizes["tower"] - sizes["projector"]) // 8)
    assert trained.device["optimizer_states"] == 12 * (psi // 8)
    assert frozen.device["parameters"] == trained.device["parameters"] == 2 * psi // 8  # weights either way
    patches, h, f = 4096 * 4, 1152, 4304
    layer, pixels = patches * (8 * h + 2 * f) * 2, patches * 3 * 16 * 16 * 2 * 2  # an MLP of two projections
    text_only = 36 * 4096 * 4096 * 2  # the language model's checkpointed layer inputs, as for a text model
    assert frozen.activations_checkpointed - trained.activations_checkpointed == layer - (27 * patches * h * 2 + layer)
    assert frozen.activations_full - trained.activations_full == layer - 27 * layer
    assert frozen.activations_checkpointed > text_only + layer + pixels  # the tower's one layer and pixels on top
    assert memory.vision_activations(config, recipe, 1, 2, None) == (layer + pixels, layer + pixels)
    said = memory.vision_report(config, recipe, None, 2)
    assert (f"the vision tower's {sizes['tower'] / 1e6:,.1f}M and the projector's {sizes['projector'] / 1e6:,.1f}M "
            f"parameters are counted above as weights only: frozen") in said, said
    assert "one layer's at a time (a frozen tower runs without gradients)" in said and "16,384 patches" in said
    monkeypatch.setattr(vision, "tower_shape", lambda config: None)  # a family whose config names no merge
    assert "the tower's activations are not counted (qwen3_vl's config names no" in \
        memory.vision_report(config, recipe, None, 2)


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "smolvlm"])
def test_every_row_is_what_trls_vision_collator_makes(request, family):
    """Each tiny family's 48 rows (one image, two, or none) tokenized as a run tokenizes them, against TRL's
    DataCollatorForVisionLanguageModeling on the same rows (assistant_only_loss, the template with transformers'
    generation tags): the same ids and labels token for token, the same pixels (Qwen2.5-VL's patches and grid,
    SmolVLM's tiles of every image), the same per-token inputs."""
    import datasets
    from PIL import Image
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from dstrain.data.formats import chat
    from dstrain.model import load_tokenizer
    from tests.conftest import vlm_template_tagged
    root = request.getfixturevalue("tiny_vlm" if family == "llava" else f"tiny_{family}_vlm")
    rows = [json.loads(line) for line in (root / "data/train.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(root / "model")))
    ours, _ = chat.tokenize(datasets.Dataset.from_list(rows), DataConfig(path=str(root / "data/train.jsonl"),
                                                                         format="chat", val_fraction=0),
                            tokenizer, 64, None)
    collator = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(root / "model"),
                                                     assistant_only_loss=True,
                                                     chat_template=vlm_template_tagged(VLM_PLACEHOLDER[family]))
    assert len(ours) == len(rows)
    for mine, row in zip(ours.with_format("torch"), rows):
        theirs = collator([{"images": [Image.open(root / "data" / p).convert("RGB") for p in row["images"]],
                            "messages": row["messages"]}])
        n = theirs["input_ids"].shape[1]
        assert torch.equal(mine["input_ids"][:n], theirs["input_ids"][0])
        assert torch.equal(mine["labels"][:n], theirs["labels"][0]) and (mine["labels"][n:] == -100).all()
        assert mine["attention_mask"].sum() == n
        for key in ("pixel_values", "image_grid_thw", "pixel_attention_mask"):
            if key in theirs:
                assert torch.allclose(mine[key].reshape(-1).float(), theirs[key].reshape(-1).float(), atol=1e-6)
            elif key in mine:
                assert len(mine[key]) == 0, key
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in theirs:
                assert torch.equal(mine[key][:n], theirs[key][0]) and not mine[key][n:].any()


def test_a_processor_that_needs_torchvision_without_it_is_one_line_with_the_fix(tiny_qwen2_5_vl_vlm, tiny_smolvlm_vlm):
    """Where torchvision is missing, Qwen2.5-VL's and SmolVLM's processors do not load: the line names the class
    transformers names and the fix. Before: transformers' message starts with a newline, so the line said
    "processor ()" with no fix (its "Torchvision" capitalized). One interpreter without the suite's torchvision."""
    import os
    import subprocess
    import sys
    folders = {"qwen2_5_vl": tiny_qwen2_5_vl_vlm / "model", "smolvlm": tiny_smolvlm_vlm / "model"}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # without tests/conftest.py's torchvision
    code = ("import sys\nfrom dstrain import vision\nfrom dstrain.errors import UserError\n"
            "for family, folder in zip(sys.argv[1::2], sys.argv[2::2]):\n    try:\n"
            "        vision.load_processor(folder, False, family)\n    except UserError as error:\n        print(error)\n")
    if subprocess.run([sys.executable, "-c", "import torchvision"], env=env, capture_output=True).returncode == 0:
        pytest.skip("torchvision is installed in the venv itself: no processor is refused here")
    out = subprocess.run([sys.executable, "-c", code, *[str(x) for kv in folders.items() for x in kv]],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        f"'{folder}' is a {family} vision-language model, and transformers cannot load its processor ({name} "
        f"requires the Torchvision library but it was not found in your environment); its processor needs "
        f"torchvision: pip install torchvision (the release matching torch)"
        for (family, folder), name in zip(folders.items(), ("Qwen2VLVideoProcessor", "SmolVLMVideoProcessor"))]


def test_the_torchvision_shim_declares_its_operators_once_however_often_it_is_loaded():
    """CI of stop 97: a pytest-xdist worker ran the side folder's sitecustomize at start (PYTHONPATH) and
    tests/conftest.py loaded it again (the worker gets its controller's sys.path, without the folder); both declared
    torchvision::nms and the first import of transformers failed ("Only a single TORCH_LIBRARY"). As that worker."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.torchvision_side import SIDE as TORCHVISION_SIDE
    if not (TORCHVISION_SIDE / "sitecustomize.py").exists():
        pytest.skip("the venv has its own torchvision: no shim (scripts/torchvision_side.py)")
    script = f"""
import importlib.util, site, sys
side = {str(TORCHVISION_SIDE)!r}
assert sys.modules["sitecustomize"].__file__.startswith(side)
sys.path = [p for p in sys.path if p != side]          # pytest-xdist's worker: the controller's sys.path
assert importlib.util.find_spec("torchvision") is None  # the interpreter's copy has fired
spec = importlib.util.spec_from_file_location("second_copy", side + "/sitecustomize.py")
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
site.addsitedir(side)                                  # as tests/conftest.py does
import torchvision, transformers
assert transformers.utils.is_torchvision_available()
"""
    env = {**os.environ, "PYTHONPATH": str(TORCHVISION_SIDE)}
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=Path.home())
    assert got.returncode == 0, got.stderr[-800:]
