"""A Hugging Face causal LM as a `deepspeed.pipe.PipelineModule`, reusing the loaded modules and weights.

Layers: token embedding [+ learned positions] -> decoder layers -> final norm -> LM head (loss on the
last stage). Only the hidden states cross stage boundaries: each decoder wrapper rebuilds position ids,
rotary embeddings and the causal mask from them, which costs little and keeps the pipe protocol to a
single tensor. Right-padded SFT batches need no attention mask under a causal mask: real tokens never
attend to the padding after them, and padding carries no label. Tied input/output embeddings are one
`TiedLayerSpec` key on the first and last stage; DeepSpeed keeps the copies equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..parallel.layout import parallel_sizes
from ..run.checkpoint import write_pipeline_names
from . import Component, Setup

# model_type -> adapter name. Qwen2/3 and Mistral share Llama's layout (embed_tokens, layers, norm, rotary_emb).
SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gpt2": "gpt2"}


class Existing(nn.Module):
    """A LayerSpec type (it must subclass nn.Module) whose construction returns the already-loaded module."""

    def __new__(cls, module: nn.Module) -> nn.Module:  # type: ignore[misc]
        return module


def sliding(config: Any, index: int) -> bool:
    """Whether decoder layer `index` attends within a sliding window, as the model's own forward decides it:
    `layer_types` where the config has them (Qwen2/Qwen3 with use_sliding_window), else any `sliding_window` set
    (Mistral). Under sdpa and eager the window lives in the mask only: a wrapper that built the plain causal mask
    trained a Mistral (window 4096) or a windowed Qwen with full attention past the window, exit 0 (issue 85)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


class DecoderPipe(nn.Module):
    """One decoder layer, taking and returning hidden states only."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None = None, index: int = 0):
        super().__init__()
        self.layer = layer
        self.config = config
        self.rotary = [rotary]  # a list keeps the shared rotary module out of this layer's parameters
        self.sliding = sliding(config, index)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masking = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = masking(config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                       position_ids=position_ids)
        kwargs = {"attention_mask": mask}
        if self.rotary[0] is not None:
            kwargs.update(position_embeddings=self.rotary[0](hidden, position_ids), position_ids=position_ids)
        out = self.layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class PositionsPipe(nn.Module):
    """GPT-2's learned absolute positions and embedding dropout, after the token embedding."""

    def __init__(self, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.drop(hidden + self.wpe(positions))


def _lm_head(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embedding.weight)


class TokenMeanLoss:
    """Summed next-token cross-entropy times `scale`, set per step so the pipeline's mean over micro-batches
    and data-parallel replicas equals the mean over every label token of the global batch."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                 ignore_index=-100, reduction="sum")
        return summed * self.scale


@dataclass
class Converted:
    module: Any                      # the PipelineModule
    loss: TokenMeanLoss
    hf_names: dict[int, str]         # pipeline layer index -> HF parameter-name prefix (for export)


def _specs(model: nn.Module) -> tuple[list, dict[int, str]]:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    config = model.config
    kind = SUPPORTED.get(config.model_type)
    if kind is None:
        raise UserError(f"pipeline stages are not supported for model type '{config.model_type}' yet (supported: "
                        f"{', '.join(sorted(SUPPORTED))}); use a config without a pipeline section (ZeRO) "
                        f"or tensor_parallel")
    # what transformers loaded, not what the config says: a file holding a distinct lm_head.weight under a config
    # that ties is loaded untied (transformers warns), and the pipeline must start from those weights
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    specs, names = [], {}

    def add(spec, prefix: str | None):
        if prefix is not None:
            names[len(specs)] = prefix
        specs.append(spec)

    if kind == "llama":
        body, embed, layers, norm = model.model, model.model.embed_tokens, model.model.layers, model.model.norm
        add(TiedLayerSpec("embed", Existing, embed) if tied else LayerSpec(Existing, embed), "model.embed_tokens.")
        for i, layer in enumerate(layers):
            add(LayerSpec(DecoderPipe, layer, config, body.rotary_emb, i), f"model.layers.{i}.")
        add(LayerSpec(Existing, norm), "model.norm.")
    else:  # gpt2
        body = model.transformer
        add(TiedLayerSpec("embed", Existing, body.wte) if tied else LayerSpec(Existing, body.wte), "transformer.wte.")
        add(LayerSpec(PositionsPipe, body.wpe, body.drop), "transformer.")
        for i, layer in enumerate(body.h):
            add(LayerSpec(DecoderPipe, layer, config), f"transformer.h.{i}.")
        add(LayerSpec(Existing, body.ln_f), "transformer.ln_f.")
    if tied:
        add(TiedLayerSpec("embed", Existing, model.get_input_embeddings(), forward_fn=_lm_head), None)
    else:
        add(LayerSpec(Existing, model.get_output_embeddings()), "lm_head.")
    return specs, names


def stages_chained(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """What the pipeline's stages compute one after another for `input_ids`: its layers as _specs builds them (the
    loaded modules, the tied head), run in order in this process. families.check_pipeline holds it against the
    model's own forward."""
    from deepspeed.pipe import TiedLayerSpec

    hidden = input_ids
    for spec in _specs(model)[0]:
        layer = spec.build()
        tied_forward = isinstance(spec, TiedLayerSpec) and spec.forward_fn
        hidden = spec.forward_fn(layer, hidden) if tied_forward else layer(hidden)
    return hidden


def strip_wrapper(key: str) -> str:
    """Parameter name inside a pipeline layer -> name under the layer's HF prefix."""
    for wrapper in ("layer.",):
        if key.startswith(wrapper):
            return key[len(wrapper):]
    return key


def convert(model: nn.Module, stages: int, partition_method: str, activation_checkpointing: bool,
            replicas: int = 1, replica_data_parallel: int = 1) -> Converted:
    """replicas > 1: DiLoCo replicas of consecutive ranks, each a pipeline of `stages` stages x
    replica_data_parallel (ds_internals.pipeline_in_replicas)."""
    from deepspeed.pipe import PipelineModule

    from ..parallel import ds_internals

    specs, names = _specs(model)
    blocks = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    if stages > blocks:
        raise UserError(f"pipeline stages={stages} exceed the model's {blocks} decoder layers; use at most {blocks}")
    loss = TokenMeanLoss()
    kind, where = PipelineModule, {"num_stages": stages}
    if replicas > 1:
        kind, topology = ds_internals.pipeline_in_replicas(replicas)
        where = {"topology": topology(stages, replica_data_parallel)}
    module = kind(layers=specs, loss_fn=loss, partition_method=partition_method,
                  activation_checkpoint_interval=1 if activation_checkpointing else 0, **where)
    return Converted(module, loss, names)


# ----------------------------------------------------------------------------- the component

class Pipeline(Component):
    name = "pipeline"

    def __init__(self, stages: int):
        self.stages = stages

    def validate(self, setup: Setup) -> None:
        if setup.recipe.data.packing:  # stages pass hidden states only: no position_ids reach the attention
            raise UserError(f"data.packing with pipeline stages ({self.stages}) is not supported; set "
                            f"data.packing=false or use a ZeRO config")

    def describe(self) -> dict:
        return {"stages": self.stages}

    def convert(self, model, setup: Setup):
        piped = convert(model, self.stages, setup.ds_cfg["pipeline"].get("partition_method", "parameters"),
                        setup.recipe.train.activation_checkpointing, setup.layout.replicas,
                        setup.layout.replica_data_parallel)
        write_pipeline_names(setup.run_dir, piped.hf_names, setup.ctx)
        return piped.module


def make(raw_ds: dict) -> Pipeline | None:
    stages = parallel_sizes(raw_ds).pipeline
    return Pipeline(stages) if stages > 1 else None
