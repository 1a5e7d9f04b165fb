"""Vision-language models (issue 86): image-text-to-text models (LLaVA, Gemma 3, ...) built with
AutoModelForImageTextToText and their AutoProcessor, what planning reads of them (the language model's config, the
vision tower's parameters), and the layouts they train under or refuse in one line. Their rows (TRL's vision layout)
are tokenized by dstrain/data/formats/images.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError

PER_IMAGE = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask")  # concatenated per micro-batch
PER_TOKEN = ("token_type_ids", "mm_token_type_ids")  # padded to the row's length with 0
MODEL_KEYS = (*PER_IMAGE, *PER_TOKEN)


def is_vision(config) -> bool:
    """An image-text-to-text model (a vision tower, a projector and a language model)."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    return getattr(config, "vision_config", None) is not None and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def model_class(config):
    """The Auto class that builds `config` with its head: AutoModelForImageTextToText for a vision-language model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vision(config) else AutoModelForCausalLM


def text_config(config):
    """The language model's config: what planning (FLOPs, memory, the layout checks) reads."""
    return config.get_text_config() if is_vision(config) else config


def load_processor(location: str, trust_remote_code: bool, model_type: str):
    from transformers import AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, AttributeError, ImportError, TypeError) as error:
        # a video processor needs torchvision (Qwen2-VL, Qwen2.5-VL, SmolVLM): transformers fails in its class check
        # with "\nQwen2VLVideoProcessor requires the Torchvision library ..." (its first line empty)
        said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        said = said.split(". ")[0]
        hint = ("; its processor needs torchvision: pip install torchvision (the release matching torch)"
                if "video_processor" in str(error).lower() or "torchvision" in str(error).lower() else "")
        raise UserError(f"'{location}' is a {model_type} vision-language model, and transformers cannot load its "
                        f"processor ({said[:160]}){hint}") from None
    if not hasattr(processor, "image_processor") or not getattr(processor, "image_token", None):
        raise UserError(f"'{location}' is a {model_type} vision-language model whose processor "
                        f"({type(processor).__name__}) has no image processor or image token: not trainable here")
    return processor


def vision_parameters(model) -> int:
    """Parameters outside the language model and its head (the vision tower and the projector): a text token does
    not run through them, so MFU's 6 N per token leaves them out (flops.flops_per_token's `inactive`)."""
    config = getattr(model, "config", None)
    if config is None or not is_vision(config):
        return 0
    return _whole(p for part in vision_parts(model).values() for p in part)


def part_sizes(config) -> dict:
    """{"tower": n, "projector": m, "gated": bool}: the vision tower's and the projector's parameters, and whether
    the tower's MLPs are gated (a gate projection beside up and down: Qwen2.5-VL's, Pixtral's; CLIP's, SigLIP's and
    Qwen3-VL's are not), read off a model built on the meta device (no tensor storage, but tens of MiB of Python
    objects: memory.record reads the peak before it), once per config (the preflight's search estimates many
    layouts)."""
    key = config.to_json_string()
    if key not in _PART_SIZES:
        import torch
        from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        with torch.device("meta"):
            model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)](config)
        parts = vision_parts(model)
        tower = {id(p) for p in parts["tower"]}
        modules = {name.split(".")[-2] for name, p in model.named_parameters() if id(p) in tower}
        _PART_SIZES[key] = {"tower": _whole(parts["tower"]), "projector": _whole(parts["projector"]),
                            "gated": any("gate" in name for name in modules)}
    return dict(_PART_SIZES[key])


_PART_SIZES: dict[str, dict] = {}


def frozen_parameters(config, model_cfg) -> int:
    """The tower's and projector's parameters that model.train_vision_tower / train_projector leave frozen (0 for a
    text model): they keep their weights only, no gradient or optimizer state."""
    if not is_vision(config):
        return 0
    sizes = part_sizes(config)
    return (0 if model_cfg.train_vision_tower else sizes["tower"]) + \
        (0 if model_cfg.train_projector else sizes["projector"])


def tower_shape(config) -> dict | None:
    """What the memory estimate reads of a vision-language model's tower: width, depth and MLP width, the input
    elements of one patch, and how many patches one image token of the language model stands for (Qwen2-VL,
    Qwen2.5-VL, Mistral 3: the merger's spatial_merge_size squared; Idefics3 / SmolVLM: the pixel shuffle's
    scale_factor squared; Gemma 3: the tower's patches pooled to mm_tokens_per_image; LLaVA: one token a patch).
    None where the config says none of these (the preflight then says the tower's activations are not counted)."""
    vc = getattr(config, "vision_config", None)
    if vc is None:
        return None
    hidden = getattr(vc, "hidden_size", None) or getattr(vc, "embed_dim", None)
    layers = getattr(vc, "num_hidden_layers", None) or getattr(vc, "depth", None)
    if not hidden or not layers:
        return None
    ffn = getattr(vc, "intermediate_size", None) or int(getattr(vc, "mlp_ratio", 4) * hidden)
    patch = getattr(vc, "patch_size", None) or 14
    pixels = getattr(vc, "num_channels", None) or getattr(vc, "in_channels", None) or 3
    pixels *= patch * patch * (getattr(vc, "temporal_patch_size", None) or 1)
    merge = getattr(vc, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None)
    if merge:
        per_token = merge * merge
    elif getattr(config, "scale_factor", None):
        per_token = config.scale_factor ** 2
    elif getattr(config, "mm_tokens_per_image", None) and getattr(vc, "image_size", None):
        per_token = (vc.image_size // patch) ** 2 / config.mm_tokens_per_image
    elif config.model_type in ("llava", "llava_next", "vipllava"):
        per_token = 1
    else:
        return None
    return {"hidden": hidden, "layers": layers, "ffn": ffn, "patch_elements": pixels, "patches_per_token": per_token,
            "gated": part_sizes(config)["gated"]}


def _whole(params) -> int:
    """Elements of the whole tensors (under zero.Init a rank holds a partition)."""
    return sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in params)


# where transformers' vision-language models keep the module between the vision tower and the language model (LLaVA,
# Gemma 3, Mistral 3: multi_modal_projector; Idefics3 / SmolVLM: connector; Qwen2-VL: the tower's merger)
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector", "aligner")


def vision_parts(model) -> dict[str, list]:
    """{"tower": [...], "projector": [...]}: the parameters outside the language model and its head, the
    projector's by its module's name."""
    decoder = model.get_decoder()
    inside = {id(p) for p in decoder.parameters()}
    head = model.get_output_embeddings()
    inside |= {id(p) for p in head.parameters()} if head is not None else set()
    parts = {"tower": [], "projector": []}
    for name, param in model.named_parameters():
        if id(param) not in inside:
            parts["projector" if any(p in name.split(".") for p in PROJECTORS) else "tower"].append(param)
    return parts


def freeze(model, cfg) -> str | None:
    """The vision tower and the projector trained or frozen as model.train_vision_tower / train_projector say; the
    log's line when any is frozen."""
    if not is_vision(model.config):
        return None
    parts = vision_parts(model)
    frozen = [name for name, on in (("tower", cfg.train_vision_tower), ("projector", cfg.train_projector))
              if not on and parts[name]]
    for name in frozen:
        for param in parts[name]:
            param.requires_grad_(False)
    if not frozen:
        return None
    count = _whole(p for n in frozen for p in parts[n])
    return (f"vision-language model: the {' and the '.join('vision tower' if n == 'tower' else n for n in frozen)} "
            f"frozen ({count:,} parameters; model.train_vision_tower / model.train_projector to train them)")


# the modules of a vision-language model outside its language model (peft's exclude_modules, a full match): LoRA's
# adapters go on the language model alone unless lora.vision_tower
NOT_LANGUAGE_MODEL = (r"(.*\.)?(vision_tower|visual|vision_model|vision_encoder|" + "|".join(PROJECTORS) +
                      r")(\..*)?")

FROZEN_BASE = "frozen_base.json"  # in model_config/: where a frozen tower's weights are read from at export


def record_frozen(model, location: str, out: Path) -> None:
    """model_config/frozen_base.json: the frozen parameters' names and the folder they were loaded from.
    Checkpoints leave frozen parameters out (checkpoint.has_frozen); export reads them from there."""
    names = [name for name, p in model.named_parameters() if not p.requires_grad]
    where = Path(location)
    out.mkdir(parents=True, exist_ok=True)
    (out / FROZEN_BASE).write_text(json.dumps({"base": str(where.resolve()) if where.exists() else location,
                                               "parameters": names}, indent=1))


def frozen_weights(model_files: Path, names: list[str], remote: bool) -> dict:
    """The frozen parameters `names` as loaded at the run's start (frozen_base.json's base), or {} when the run
    recorded none."""
    import torch
    record = model_files / FROZEN_BASE
    if not record.exists() or not names:
        return {}
    from transformers import AutoConfig
    base = json.loads(record.read_text())["base"]
    try:
        config = AutoConfig.from_pretrained(base, trust_remote_code=remote)
        loaded = model_class(config).from_pretrained(base, config=config, dtype=torch.float32,
                                                     trust_remote_code=remote)
    except OSError as error:
        raise UserError(f"the run froze {len(names)} parameters of {base} (its vision tower or projector), which "
                        f"cannot be loaded ({str(error).splitlines()[0]}); restore it there, or set \"base\" in "
                        f"{record}") from None
    state = loaded.state_dict()
    return {name: state[name] for name in names if name in state}


def processor_of(tokenizer):
    """The processor load_tokenizer attached to a vision-language model's tokenizer, or None (a text model)."""
    return getattr(tokenizer, "_dstrain_processor", None)


# what a vision-language run cannot do yet, and the line that says so
REFUSED = {
    "packing": ("data.packing", "rows with images are not packed yet; set data.packing=false"),
    "sequence": ("sequence or context parallelism", "image tokens would be split across ranks; train without "
                 "sequence_parallel_size / ring attention"),
    "pipeline": ("pipeline parallelism", "the vision tower is not cut into stages; use ZeRO-3 instead"),
    "tensor": ("tensor parallelism", "AutoTP does not shard the vision tower; use ZeRO-3 instead"),
    "loss_chunk": ("train.loss_chunk_tokens", "the chunked loss reads the language model's hidden states alone; "
                   "set train.loss_chunk_tokens=0"),
}


def check(setup) -> None:
    """A vision-language run's layout and data format: supported, or one line naming what is not."""
    recipe, layout = setup.recipe, setup.layout
    model_type = setup.model_config.model_type
    found = [key for key, on in (("packing", recipe.data.packing),
                                 ("sequence", layout.sequence_parallel * layout.context_parallel > 1),
                                 ("pipeline", layout.is_pipeline), ("tensor", layout.tensor_parallel > 1),
                                 ("loss_chunk", bool(recipe.train.loss_chunk_tokens))) if on]
    if found:
        what, fix = REFUSED[found[0]]
        raise UserError(f"{what} with a vision-language model ({model_type}): {fix}")
    if recipe.data.format != "chat":
        raise UserError(f"data.format={recipe.data.format} with a vision-language model ({model_type}): only "
                        f"conversations (data.format=chat, TRL's vision layout) are trained yet")

