"""Next-token cross-entropy (pretraining and SFT): the mean over every label token of the global batch.

Each micro-batch contributes sum_loss * (accum * dp) / global_tokens: DeepSpeed divides by accum and averages over
dp, so SFT batches with uneven response lengths weigh every token equally (unlike a mean of per-micro-batch means).
Under sequence parallelism each rank's sum covers its slice of the sequences, and the sp ranks' gradients add up
(Layout.gradients_averaged_over: what DeepSpeed divides by, dp x sp under ZeRO-3).

Mixture-of-Experts models add their router's load-balancing loss (moe.router_aux_coefficient: the model config's
weight unless the recipe's model.router_aux_loss_coef says otherwise), as transformers computes it: the model's
own `aux_loss` of each micro-batch, so the loss minimised is the token mean above plus coef x the mean of the
global batch's micro-batches' aux losses. A micro-batch holds the same samples on every world size (rank r's m-th
holds global positions (m x world + r) x micro_batch_size on), so that mean does not change with the layout. The
logged `loss` is that sum (what a transformers model returns with labels); `lm_loss` and `aux_loss` are its two
parts. Evaluation is the language model's loss alone (its perplexity means something).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import moe, vision
from ..data import IGNORE_INDEX
from ..errors import UserError


def label_count(batch: dict[str, torch.Tensor]) -> int:
    if "shift_labels" in batch:  # a sequence-parallel slice: its targets are already aligned (data.shard_sequence)
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def real_count(batch: dict[str, torch.Tensor]) -> int:
    """Input tokens that are not padding (packed pretraining rows have none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model is called with. Rows with position_ids (packed, or a sequence-parallel slice) go without
    the attention mask: transformers then derives a causal mask per document from position_ids (and padding
    sits at the end of a row, behind every real token, so a causal mask never lets a real token see it)."""
    if "position_ids" in batch:
        return {k: batch[k] for k in ("input_ids", "position_ids")}
    # a vision-language model's rows add their images (pixel values, sizes) and per-token image marks
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", *vision.MODEL_KEYS)}


def loss_sum(model, batch: dict[str, torch.Tensor], router: bool = False):
    """Summed next-token cross-entropy over the batch's label tokens (fp32 logits); with `router`, also the
    model's router load-balancing loss of this micro-batch and each MoE layer's router logits: (summed, aux,
    logits)."""
    inputs = model_inputs(batch)
    shifted = "shift_labels" in batch  # a sequence-parallel slice: position t's target is shift_labels[t]
    labels = batch["shift_labels"] if shifted else batch["labels"]
    if chunked_loss(model):  # components/chunked_loss.py: no full logits (validate refuses it with `router`)
        return model(**inputs, use_cache=False, sum_loss_labels=labels, labels_shifted=shifted,
                     label_positions=batch.get("label_positions")).loss
    out = model(**inputs, use_cache=False, **({"output_router_logits": True} if router else {}))
    logits = out.logits
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    summed = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    return (summed, out.aux_loss.float(), out.router_logits) if router else summed


def chunked_loss(model) -> bool:
    return bool(getattr(getattr(model, "module", model), "dstrain_loss_chunk_tokens", 0))


class CausalLM:
    name = "causal_lm"
    primary = "label_tokens"
    perplexity = True

    def __init__(self) -> None:
        self.fake_image = None  # a vision-language model's blank image for micro-batches without one
        self.router_aux = 0.0  # the load-balancing loss's weight (validate: 0 for a dense model)
        self.top_k = 0  # routed experts per token, and per MoE layer (the config's; the first step's logits)
        self.experts_in_config = 0
        self.counter = None  # moe.RoutingCounter on the engine's model: the routing figures of an MoE model

    def validate(self, setup) -> None:
        if vision.is_vision(setup.model_config):  # (vision.check has passed: trainer/resolve.py)
            from ..data.formats.images import fake_image
            from ..model import load_tokenizer
            tokenizer = load_tokenizer(setup.recipe.model)
            self.fake_image = fake_image(vision.processor_of(tokenizer), tokenizer.pad_token_id)
        self.router_aux = moe.router_aux_coefficient(setup.recipe.model.router_aux_loss_coef, setup.model_config)
        self.top_k = moe.routed_per_token(setup.model_config)
        self.experts_in_config = moe.routed_experts(setup.model_config)
        # the routing figures are counted at the routers (with or without the loss): not inside pipeline stages
        self.routing = bool(self.experts_in_config) and not setup.layout.is_pipeline
        if not self.router_aux:
            return
        off = "or set model.router_aux_loss_coef: 0 to train without it"
        if setup.recipe.train.loss_chunk_tokens:
            raise UserError(f"train.loss_chunk_tokens: the chunked loss does not add the router's load-balancing "
                            f"loss yet; set train.loss_chunk_tokens: 0, {off}")
        if setup.layout.sequence_parallel * setup.layout.context_parallel > 1 or setup.layout.is_pipeline:
            raise UserError("the router's load-balancing loss is computed per micro-batch, which sequence or "
                            f"context parallelism and pipeline stages split; train without them, {off}")
        setup.log(f"router load-balancing loss: {self.router_aux:g} x the model's aux_loss, averaged over the "
                  "global batch's micro-batches (model.router_aux_loss_coef to change, 0 for off)")

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        if self.router_aux:  # the aux loss is a mean over the global batch's micro-batches
            return {"label_tokens": label_count(batch), "micro_batches": 1}
        return {"label_tokens": label_count(batch)}

    def real_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return real_count(batch)

    def host_batch(self, batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
        """The chunked loss's label positions are found on the host, so the device never has to report how many
        there are (no sync in the step). A vision-language model's micro-batch without images gets a blank one that
        the loss never sees (data/formats/images.py: with_fake_image)."""
        if self.fake_image is not None:
            from ..data.formats.images import with_fake_image
            batch = with_fake_image(batch, self.fake_image)
        if chunked_loss(model):
            from ..components.chunked_loss import label_positions_of
            shifted = "shift_labels" in batch
            batch = dict(batch, label_positions=label_positions_of(batch["shift_labels" if shifted else "labels"],
                                                                   shifted))
        return batch

    def loss_sum(self, model, batch: dict[str, torch.Tensor], totals: dict[str, float]):
        # the model's own flag: DeepSpeedEngine.eval() sets its module's, never the engine's (evaluation added
        # the load-balancing loss to eval_loss, and logged eval_aux_loss, until this read the module's)
        if not (getattr(model, "module", model).training and (self.router_aux or self.counter)):
            return loss_sum(model, batch), None
        if self.counter:
            self.counter.clear()
        if self.router_aux:
            summed, aux, _ = loss_sum(model, batch, router=True)
            # the seam divides by totals[primary]: this makes the aux term coef x the micro-batches' mean
            total = summed + self.router_aux * aux * (totals[self.primary] / totals["micro_batches"])
            parts = [summed.detach().reshape(1), aux.detach().reshape(1)]
        else:
            total, parts = loss_sum(model, batch), []
        if self.counter:
            parts.append(self.counter.take(self.experts_in_config, batch.get("attention_mask")).reshape(-1))
        # summed over the global batch by the step's one all-reduce, with the loss
        return total, torch.cat([p.to(total.device) for p in parts])

    def step_hooks(self, say) -> list:
        return [moe.RouterWatch(self.experts_in_config, self.top_k, say)] if self.counter else []

    def metrics(self, stats, totals: dict[str, float]) -> dict[str, float]:
        if not stats:  # a dense model, or evaluation
            return {}
        figures = moe.load_figures(stats[2 if self.router_aux else 0:], self.experts_in_config) if self.counter \
            else {}
        if not self.router_aux:
            return figures
        return {"lm_loss": stats[0] / totals[self.primary], "aux_loss": stats[1] / totals["micro_batches"], **figures}

    def before_training(self, engine, datasets: list, setup, data_cache, weights: str) -> list:
        if self.routing:
            counter = moe.RoutingCounter(engine.module)
            self.counter = counter if counter.layers else None
        return datasets

    @staticmethod
    def sequences_per_sample(recipe) -> int:
        return 1

    @staticmethod
    def evaluation_keys(recipe) -> list[str]:
        return ["eval_loss", "perplexity"]
