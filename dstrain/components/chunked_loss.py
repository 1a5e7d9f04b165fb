"""Chunked, fused LM-head + cross-entropy for large vocabularies (`train.loss_chunk_tokens`).

The plain path materialises logits for every position (tokens x vocabulary, then an fp32 copy, then its
gradient): at a 128k vocabulary that is the largest tensor of a step. Here the head runs on label tokens
only, a chunk of them at a time: each chunk's fp32 logits give its loss and, in the same pass, the
gradients of the hidden states and of the head's weight (softmax minus one-hot), so nothing is recomputed
in backward and no chunk's logits outlive it. What backward receives is kept: grad(hidden) for the label
tokens and grad(weight) in the weight's dtype. The sum is the same as F.cross_entropy(reduction="sum")
over the full logits, up to summation order.

Installed by replacing two instance methods (the state dict, checkpoints and export do not change):
  model.forward(..., sum_loss_labels=labels[, label_positions, labels_shifted]) -> CausalLMOutputWithPast,
                                            .loss = summed loss, no logits (per_token=True: the loss of each
                                            label position, in label_positions' order: preference training)
  lm_head.forward(hidden, labels=...)       -> the fused loss, called as a module so ZeRO-3 gathers the
                                               weight around it (and again before its backward).
Any other call (labels absent) takes the model's own code unchanged.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ..config import Recipe
from ..data import IGNORE_INDEX
from ..errors import UserError
from . import Component, Setup

# config fields of models whose logits are not lm_head(last hidden state): softcapping, scaling
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias).float()  # model dtype matmul, fp32 softmax: as the plain path


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, labels); gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = _chunk_logits(h, weight, bias)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            probs = logits.sub_(lse[:, None]).exp_()  # d(sum loss)/d(logits) = softmax - one_hot
            probs[torch.arange(y.shape[0], device=y.device), y] -= 1.0
            grad_logits = probs.to(hidden.dtype)
            torch.matmul(grad_logits, weight, out=grad_hidden[start:start + chunk])
            grad_weight.addmm_(grad_logits.t(), h)
            if grad_bias is not None:
                grad_bias += probs.sum(0)
            del logits, probs, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        grad_bias = (grad_bias * grad_total).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return grad_hidden * grad_total, grad_weight * grad_total, grad_bias, None, None


class _FusedLinearTokenNLL(torch.autograd.Function):
    """cross_entropy(hidden @ weight.T + bias, labels) per token, chunk by chunk. A per-token loss feeds a non-linear
    objective (DPO's per-sequence log-probs), so the upstream gradient of each token is known only in backward:
    forward keeps the log-sum-exp per token and backward recomputes each chunk's logits (one more head matmul)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(nll)
        for start in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[start:start + chunk], weight, bias)
            lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[start:start + chunk, None]).squeeze(1)
            nll[start:start + chunk] = lse[start:start + chunk] - picked
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk = chunk
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start:start + ctx.chunk], labels[start:start + ctx.chunk]
            probs = _chunk_logits(h, weight, bias).sub_(lse[start:start + ctx.chunk, None]).exp_()
            probs[torch.arange(y.shape[0], device=y.device), y] -= 1.0
            probs.mul_(grad_nll[start:start + ctx.chunk, None].float())
            grad_logits = probs.to(hidden.dtype)
            torch.matmul(grad_logits, weight, out=grad_hidden[start:start + ctx.chunk])
            grad_weight.addmm_(grad_logits.t(), h)
            if grad_bias is not None:
                grad_bias += probs.sum(0)
            del probs, grad_logits
        grad_bias = grad_bias.to(bias.dtype) if bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None


def linear_cross_entropy_tokens(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token cross-entropy [tokens] (fp32) of `hidden @ weight.T (+ bias)`, `chunk` rows of logits at a time."""
    return _FusedLinearTokenNLL.apply(hidden, weight, bias, labels, chunk)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T (+ bias)` against labels (all valid), `chunk` rows at a time."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunk)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):  # evaluation: the loss only
        logits = _chunk_logits(hidden[start:start + chunk], weight, bias)
        total += F.cross_entropy(logits, labels[start:start + chunk], reduction="sum")
    return total


def _head_forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, chunk: int = 0,
                  per_token: bool = False):
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    if per_token:
        return linear_cross_entropy_tokens(hidden, self.weight, self.bias, labels, chunk)
    return linear_cross_entropy_sum(hidden, self.weight, self.bias, labels, chunk)


def check(model: torch.nn.Module) -> str | None:
    """Why this model cannot use the fused loss, or None."""
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"its logits are transformed after the head ({name}={value})"
    base = getattr(model, "base_model", model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is model or not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear:
        return "its head is not a plain Linear layer over a base model's last hidden state"
    return None


def check_precision(chunk_tokens: int, precision: str) -> None:
    if precision == "fp16":  # the gradients are formed in forward, before fp16 loss scaling could protect them
        raise UserError(f"train.loss_chunk_tokens={chunk_tokens} needs bf16 or fp32, not fp16 (its gradients would "
                        f"underflow unscaled); use train.precision=bf16 or set train.loss_chunk_tokens=0")


def check_model(model: torch.nn.Module, chunk_tokens: int) -> None:
    why = check(model)
    if why:
        raise UserError(f"train.loss_chunk_tokens={chunk_tokens} cannot be used with {type(model).__name__}: "
                        f"{why}; set train.loss_chunk_tokens=0")


def label_positions_of(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Flat indices of the next-token targets that carry a loss (computed where `labels` lives); `shifted`:
    labels[t] is already position t's target."""
    return ((labels if shifted else labels[:, 1:]) != IGNORE_INDEX).reshape(-1).nonzero().squeeze(1)


def install(model: torch.nn.Module, chunk_tokens: int, precision: str) -> None:
    """Route `model(..., sum_loss_labels=labels)` through the fused, chunked head + loss."""
    check_precision(chunk_tokens, precision)
    check_model(model, chunk_tokens)
    head, base = model.get_output_embeddings(), model.base_model
    head.forward = types.MethodType(_head_forward, head)
    original = model.forward
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, *args, sum_loss_labels: torch.Tensor | None = None, label_positions: torch.Tensor | None = None,
                labels_shifted: bool = False, per_token: bool = False, **kwargs):
        if sum_loss_labels is None:
            return original(*args, **kwargs)
        kwargs.pop("labels", None)
        hidden = base(*args, **kwargs)[0]  # last hidden state, after the final norm
        if labels_shifted:  # sum_loss_labels[t] is position t's target (a sequence-parallel slice)
            hidden, targets = hidden.reshape(-1, hidden.shape[-1]), sum_loss_labels.reshape(-1)
        else:  # position t predicts label t + 1
            hidden, targets = hidden[:, :-1].reshape(-1, hidden.shape[-1]), sum_loss_labels[:, 1:].reshape(-1)
        if label_positions is None:  # found on the device: a host sync (train_step passes them from the host)
            label_positions = label_positions_of(sum_loss_labels, labels_shifted)
        # prompts and padding drop out here: the head sees label tokens only
        loss = head(hidden.index_select(0, label_positions), labels=targets.index_select(0, label_positions),
                    chunk=chunk_tokens, per_token=per_token)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = types.MethodType(forward, model)
    model.dstrain_loss_chunk_tokens = chunk_tokens


# ----------------------------------------------------------------------------- the component

class ChunkedLoss(Component):
    name = "loss_chunk_tokens"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def validate(self, setup: Setup) -> None:
        if setup.layout.splits_model:
            raise UserError("train.loss_chunk_tokens is not supported with pipeline stages or tensor parallelism "
                            "(their heads are split or staged); set train.loss_chunk_tokens=0")
        check_precision(self.tokens, setup.precision)
        from ..vision import model_class
        with torch.device("meta"):  # the model's shape without its weights: nothing is built or read
            shape = model_class(setup.model_config).from_config(setup.model_config)
        check_model(shape, self.tokens)

    def describe(self) -> dict:
        return {"tokens": self.tokens}

    def convert(self, model, setup: Setup):
        install(model, self.tokens, setup.precision)
        return model


def make(recipe: Recipe) -> ChunkedLoss | None:
    return ChunkedLoss(recipe.train.loss_chunk_tokens) if recipe.train.loss_chunk_tokens else None
