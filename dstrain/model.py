"""Build any AutoModelForCausalLM (hub id, local dir, or config for a from-scratch run) and its tokenizer, or an
image-text-to-text model and its processor (dstrain/vision.py).

Under ZeRO-3 an HfDeepSpeedConfig is alive while the model is constructed, so transformers builds and
loads it inside `deepspeed.zero.Init`: parameters are partitioned as they are created and no rank ever
holds the whole model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import vision
from .config import ModelConfig, TrainConfig
from .errors import UserError, closest
from .hub import offline_unless_hub_reachable
from .paths import local_or_hub

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def looks_local(name: str) -> bool:
    """A path, not a hub id ("org/name" or "name"): absolute, relative with ./ ../ ~, or several levels deep."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def _unreachable(name: str, error: Exception) -> UserError:
    if looks_local(name):
        # a run's hf/ exists once that run finished: tiny/lora_chat_sft.yaml starts from `make train`'s
        written = f"; {name} is written when the run {Path(name).parent} finishes (for runs/tiny-pretrain: " \
                  f"make train)" if Path(name).name == "hf" else ""
        return UserError(f"cannot load '{name}': no such directory (it is not a hub id either); check the path "
                         f"in model.name_or_path / model.tokenizer{written}")
    from huggingface_hub import is_offline_mode
    if is_offline_mode():  # the Hub unreachable (paths.offline_unless_hub_reachable) or HF_HUB_OFFLINE set
        return UserError(f"cannot load '{name}': the Hugging Face Hub is offline here and it is not cached; "
                         f"`hf download {name} --local-dir DIR` where it is reachable (--preflight needs only "
                         f"config.json), then model.name_or_path=DIR")
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if len(first) > 80:
        first = first[:80].rsplit(" ", 1)[0] + " ..."
    return UserError(f"cannot load '{name}': not a local directory, and the Hugging Face Hub did not provide it "
                     f"({first}); run `hf download {name} --local-dir DIR` and set model.name_or_path=DIR")


CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
OTHER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForRewardModel")


def load_config(cfg: ModelConfig, seq_len: int):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    location = local_or_hub(cfg.name_or_path)
    offline_unless_hub_reachable(location)
    try:
        config = AutoConfig.from_pretrained(location, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        if Path(location).exists():
            raise UserError(f"model.name_or_path {location} has no usable config.json: "
                            f"{str(e).splitlines()[0]}") from None
        raise _unreachable(cfg.name_or_path, e) from None
    for key, value in cfg.config_overrides.items():
        if not hasattr(config, key):
            raise UserError(f"model.config_overrides: '{key}' is not a field of {type(config).__name__}"
                            f"{closest(key, config.to_dict().keys())}")
        setattr(config, key, value)
    heads = [a for a in getattr(config, "architectures", None) or [] if a.endswith(OTHER_HEADS)]
    if heads and not any(a.endswith(CAUSAL_HEADS) for a in config.architectures):
        # transformers loads it as a causal LM with the head dropped ("score.weight UNEXPECTED") and a new random
        # lm_head (or the embeddings tied in): it trained and exported as a language model (issue 85)
        raise UserError(f"'{cfg.name_or_path}' is a {heads[0]} checkpoint (a {heads[0].rsplit('For', 1)[1]} head, "
                        f"e.g. a reward model), not a causal language model: its head would be dropped; train a "
                        f"causal LM checkpoint (the base it was made from)")
    remote_causal = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote_causal and not vision.is_vision(config):
        raise UserError(f"'{cfg.name_or_path}' is a {config.model_type} model, which has no causal-LM head in "
                        f"transformers; choose a causal language model (Llama, GPT-2, Mistral, Qwen2, ...)")
    text = vision.text_config(config)  # a vision-language model's language model
    max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if max_positions is not None and seq_len > max_positions:
        raise UserError(f"train.seq_len={seq_len} exceeds the model's maximum positions ({max_positions}); "
                        f"set train.seq_len<={max_positions}")
    return location, config


def hidden_size(config) -> int | None:
    config = vision.text_config(config)
    return getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)


def has_weights(location: str) -> bool:
    path = Path(location)
    return path.is_dir() and any((path / f).exists() for f in WEIGHT_FILES)


def from_scratch(cfg: ModelConfig, location: str) -> bool:
    if cfg.from_scratch == "auto":
        return Path(location).is_dir() and not has_weights(location)
    if cfg.from_scratch == "false" and Path(location).is_dir() and not has_weights(location):
        raise UserError(f"model.name_or_path {location} has a config but no weights; set model.from_scratch=true "
                        f"(or auto) to start from random weights")
    return cfg.from_scratch == "true"


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    name = cfg.tokenizer or cfg.name_or_path
    offline_unless_hub_reachable(name)
    config = _config_or_none(cfg)
    if config is not None and vision.is_vision(config):  # its processor, whose tokenizer renders and tokenizes
        processor = vision.load_processor(local_or_hub(name), cfg.trust_remote_code, config.model_type)
        tokenizer = processor.tokenizer
        tokenizer._dstrain_processor = processor
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(local_or_hub(name), trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise _unreachable(name, e) from None
    _check_encodes(tokenizer, name, cfg.tokenizer is None)
    _mistral_files(tokenizer, Path(local_or_hub(name)))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _config_or_none(cfg: ModelConfig):
    """The model's config where it can be read (load_config says why where it cannot)."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(local_or_hub(cfg.name_or_path), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return None


def _mistral_files(tokenizer, folder: Path) -> None:
    """A model folder with Mistral's own tokenizer file and no Jinja template: conversations are rendered by
    mistral-common (chat_templates.apply), and the BOS and EOS that transformers' conversion of tekken.json leaves
    unset are mistral-common's."""
    from .chat_templates import mistral_file
    found = mistral_file(folder) if not tokenizer.chat_template else None
    if found is None:
        return
    tokenizer.mistral_common_file = str(found)
    try:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    except ImportError:
        return  # chat_templates.apply names the package when a conversation needs it
    tokenizer._dstrain_mistral = MistralTokenizer.from_file(str(found), mode=ValidationMode.finetuning)
    inner = tokenizer._dstrain_mistral.instruct_tokenizer.tokenizer
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(inner.bos_id)
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(inner.eos_id)


PROBE_TEXT = "The quick brown fox jumps over the lazy dog; 12 cats, 3.5 birds and a question?"


def _check_encodes(tokenizer, name: str, from_model: bool) -> None:
    """A tokenizer that cannot encode text is one line before anything is built: transformers builds a BPE tokenizer
    with no vocabulary from a model folder without tokenizer files (qwen2, gpt2: 1 token, every text encoded to
    nothing), and a run then trained on almost nothing (6,000 documents packed into 42 sequences), without a word.
    Refused: a probe sentence encoded to fewer than one token per 12 characters, or mostly the unknown token."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    unknown = sum(i == tokenizer.unk_token_id for i in ids) if tokenizer.unk_token_id is not None else 0
    if len(ids) >= len(PROBE_TEXT) / 12 and unknown <= len(ids) / 2:
        return
    what = (f"encodes a {len(PROBE_TEXT)}-character sentence to {len(ids)} tokens" if unknown <= len(ids) / 2 else
            f"encodes {unknown} of a sentence's {len(ids)} tokens as unknown")
    where = (f"'{name}' has no tokenizer files (tokenizer.json, or vocab and merges): the tokenizer transformers "
             f"made of it" if from_model and not _has_tokenizer_files(name) else f"the tokenizer of '{name}'")
    raise UserError(f"{where} ({type(tokenizer).__name__}, {len(tokenizer)} tokens) {what}; set model.tokenizer "
                    f"to the tokenizer the model was trained with (a hub id or a folder)")


def _has_tokenizer_files(name: str) -> bool:
    folder = Path(local_or_hub(name))
    if not folder.is_dir():
        return True  # a hub id: its files are in the cache, and the message names the tokenizer itself
    return any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                                                "spiece.model", "tokenizer_config.json"))


def build(cfg: ModelConfig, train: TrainConfig, ds_cfg: dict, tokenizer, load_kwargs: dict | None = None,
          partition_at_build: bool = True) -> tuple[torch.nn.Module, Any]:
    """The model, and the HfDeepSpeedConfig that must stay referenced while a ZeRO-3 model lives.
    `load_kwargs` (from components, e.g. QLoRA's quantization_config and dtype) go to from_pretrained.
    partition_at_build=False builds a ZeRO-3 model whole and lets deepspeed.initialize partition it: transformers'
    zero.Init partitions over the whole world, and DiLoCo's ZeRO-3 partitions within a replica."""
    from transformers.integrations import HfDeepSpeedConfig

    location, config = load_config(cfg, train.seq_len)
    auto = vision.model_class(config)  # AutoModelForCausalLM, or AutoModelForImageTextToText
    zero3 = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0)) == 3 and partition_at_build
    hf_ds_config = HfDeepSpeedConfig(ds_cfg) if zero3 else None  # transformers now builds under zero.Init
    kwargs = {"dtype": torch.float32, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    kwargs.update(load_kwargs or {})
    torch.manual_seed(train.seed)  # same random init on every rank for from-scratch runs
    if from_scratch(cfg, location):
        model = auto.from_config(config, **kwargs)
        init_weights(model, train.seed, zero3)
    else:
        try:
            model = auto.from_pretrained(location, config=config, **kwargs)
        except OSError as e:
            raise _unreachable(cfg.name_or_path, e) from None
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and output is not None and output.weight is not embedding:
        # transformers found distinct embedding and lm_head weights under a config that ties them and kept them
        # apart: record that, so every later step (pipeline, export, resize) treats the model as loaded
        model.config.tie_word_embeddings = False
    if len(tokenizer) > getattr(embedding, "ds_shape", embedding.shape)[0]:
        model.resize_token_embeddings(len(tokenizer))
    if train.activation_checkpointing:
        if not model.supports_gradient_checkpointing:  # transformers' ValueError was a traceback
            raise UserError(f"train.activation_checkpointing: transformers cannot checkpoint "
                            f"{type(model).__name__}; set train.activation_checkpointing=false")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model, hf_ds_config


def init_weights(model: torch.nn.Module, seed: int, zero3: bool) -> None:
    """A from-scratch model's weights as a function of (seed, model) alone, the same under every strategy:
    torch.manual_seed(seed), then the model's own _init_weights on each module in named_modules() order, then
    tie_weights. transformers' from_config consumes the RNG differently inside zero.Init (module constructors
    allocate differently), so ZeRO-3 started from other weights than ZeRO-0/1/2 with the same seed. Under ZeRO-3
    each module's parameters are gathered (every rank draws the same numbers; rank 0's are kept)."""
    import contextlib

    import deepspeed

    torch.manual_seed(seed)
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 and params else \
            contextlib.nullcontext()
        with gather:
            for param in params:
                param._is_hf_initialized = False  # transformers' init functions skip parameters marked done
            model._init_weights(module)
    model.tie_weights()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (embeddings, linear weights); never biases or norm scales (nanoGPT / HF rule)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 partitioned params keep their shape here
        (decay if len(shape) >= 2 else no_decay).append(param)
    # named: DeepSpeed's MoE support splits each group into its expert and non-expert parameters by name
    # (deepspeed/moe/utils.py, under expert parallelism); elsewhere the names are ignored
    return [{"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]


def trainable_count(model: torch.nn.Module) -> int:
    """Parameters that train (the whole tensor's size under zero.Init)."""
    return sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters() if p.requires_grad)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters in the model, elements this rank holds): under zero.Init a rank holds only its partition."""
    total = local = 0
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            total += param.ds_numel
            local += param.ds_tensor.numel()
        else:
            total += param.numel()
            local += param.numel()
    return total, local


def activation_checkpointing(model) -> bool:
    """Whether the model recomputes its activations in backward (transformers 5 renamed the flag)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))
