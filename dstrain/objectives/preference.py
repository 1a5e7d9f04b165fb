"""Preference training on chosen/rejected pairs: DPO and its kin, with TRL's names and meaning (DPOConfig's
`sigmoid`, `ipo`, `hinge`, `robust`; CPOConfig's `simpo`; ORPOConfig's odds ratio), so a TRL user can move over.

A micro-batch of B pairs runs as one forward of 2B rows (chosen, then rejected), as TRL does. Each sequence's
log-probability is the sum over its response tokens (the average per token for `ipo`'s scores, `simpo` and `orpo`).
The step's loss is the mean over every pair of the global batch (steps.py normalises by `pairs`); ORPO's NLL term is
the mean over every chosen token of the global batch.

The reference model costs no second model: for full fine-tuning its log-probs are computed once, before the first
step (the policy then is the reference), with the run's own engine and ZeRO stage, every data-parallel rank its
share, and kept in the run directory (a resumed run reads them) and beside the tokenized data, keyed by the base
weights (a repeated run reuses them). With LoRA the reference is the base with the adapters switched off.
Written by hand (TRL is the test reference, not a runtime dependency): TRL's trainers own their loop, their
DeepSpeed engine and their data collation, none of which this repository's loop can call into.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import moe
from ..config import PreferenceSection
from ..data import IGNORE_INDEX
from ..data.formats.preference import COLUMNS
from ..errors import UserError

STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected")
# ORPO's own, under TRL's ORPOTrainer names: the chosen sequences' NLL (a mean over their tokens), the mean
# log-sigmoid of the log odds ratio, and the mean log odds ratio
ORPO_STATS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
REFERENCE_FILE = "reference_logps.pt"


def sequence_logps(model, batch: dict[str, torch.Tensor], packed: bool = False,
                   chosen_nll: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(summed response log-probs [2B], response token counts [2B], with `chosen_nll` the summed NLL of every real
    token of the chosen rows: ORPO's term, else None) of chosen then rejected rows, from the per-position
    cross-entropy of the 2B sequences (the response positions only, unless `chosen_nll`: the chunked head then
    skips the prompts).

    `packed` (data.packing): the 2B sequences run as one row without their padding, position_ids
    restarting at each, so no sequence attends to another (TRL's padding-free mode). With the chunked head
    (train.loss_chunk_tokens) the full logits are never materialised."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    real = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]]).bool()
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    none = torch.zeros_like(real[:, :1])
    response = torch.cat([labels[:, 1:] != IGNORE_INDEX, none], 1)  # position t predicts a response token
    scored = torch.cat([real[:, 1:], none], 1) if chosen_nll else response
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], 1).masked_fill(~scored, IGNORE_INDEX)
    from ..components.sequence_parallel import shards
    parts = shards()
    if parts is not None:  # sequence (ring) parallelism: this rank's part of every row, sums over the parts
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        nll = token_nll(model, {"input_ids": parts.columns(ids), "position_ids": parts.columns(positions)},
                        parts.columns(targets))
        half = ids.shape[0] // 2
        logps = parts.sum(-(nll * parts.columns(response)).sum(1))
        return logps, response.sum(1), parts.sum(nll[:half].sum()) if chosen_nll else None
    if packed:
        lengths = real.sum(1)
        starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        inputs = {"input_ids": ids[real][None],
                  "position_ids": (torch.arange(int(lengths.sum()), device=ids.device) - starts)[None]}
        nll = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        nll[real] = token_nll(model, inputs, targets[real][None])[0]
    else:
        nll = token_nll(model, {"input_ids": ids, "attention_mask": real.long()}, targets)
    half = batch["chosen_input_ids"].shape[0]
    return -(nll * response).sum(1), response.sum(1), nll[:half].sum() if chosen_nll else None


def token_nll(model, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [rows, cols] (fp32) of each position against `targets` (already aligned: position t's target;
    IGNORE_INDEX -> 0)."""
    from ..components.chunked_loss import label_positions_of
    from .causal_lm import chunked_loss
    if chunked_loss(model):  # the fused, chunked head (components/chunked_loss.py): label positions only
        positions = label_positions_of(targets, shifted=True)
        values = model(**inputs, use_cache=False, sum_loss_labels=targets, labels_shifted=True,
                       label_positions=positions, per_token=True).loss
        return torch.zeros(targets.numel(), dtype=torch.float32, device=targets.device).index_put(
            (positions,), values).view(targets.shape)
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(cfg: PreferenceSection, pc: torch.Tensor, pr: torch.Tensor, nc: torch.Tensor, nr: torch.Tensor,
                rc: torch.Tensor | None, rr: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                           torch.Tensor, torch.Tensor]:
    """Per-pair losses, (chosen, rejected) rewards and the (chosen, rejected) log-probs TRL logs, from summed policy
    log-probs pc/pr, response token counts nc/nr and the reference's rc/rr (None: reference-free losses)."""
    beta, ls = cfg.beta, cfg.label_smoothing
    if cfg.loss in ("simpo", "orpo"):
        ac, ar = pc / nc.clamp(min=1), pr / nr.clamp(min=1)
        if cfg.loss == "simpo":
            logits = ac - ar - cfg.simpo_gamma / beta
            loss = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        else:
            log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
            loss = -beta * F.logsigmoid(log_odds)
        return loss, beta * ac.detach(), beta * ar.detach(), ac, ar
    dc, dr = pc - rc, pr - rr
    delta = dc - dr
    if cfg.loss in ("dpo", "sigmoid"):
        loss = -F.logsigmoid(beta * delta) * (1 - ls) - F.logsigmoid(-beta * delta) * ls
    elif cfg.loss == "robust":
        loss = (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) / (1 - 2 * ls)
    elif cfg.loss == "hinge":
        loss = torch.relu(1 - beta * delta)
    elif cfg.loss == "ipo":  # TRL's length normalisation (confirmed with the IPO authors, per TRL's comment)
        loss = (dc / nc.clamp(min=1) - dr / nr.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(cfg.loss)
    return loss, beta * dc.detach(), beta * dr.detach(), pc, pr


PAD_MULTIPLE = 16  # rows are cut to the micro-batch's longest pair rounded up to this (fewer shapes, aligned)


def trim_padding(batch: dict[str, torch.Tensor], multiple: int = PAD_MULTIPLE) -> dict[str, torch.Tensor]:
    """The micro-batch without the padding columns no row of it uses: pairs are padded to seq_len on disk (so the
    data has one shape), but a step computes only up to its longest pair (as TRL pads each batch to its longest).
    Padding sits at the end of a row, so every real token sees exactly what it saw before. `multiple`: what the
    kept length is rounded up to (sequence shards need a length that splits over them)."""
    longest = max(int(batch[f"{side}_attention_mask"].sum(1).max()) for side in ("chosen", "rejected"))
    keep = -(-longest // multiple) * multiple
    if keep >= batch["chosen_input_ids"].shape[1]:
        return batch
    return {k: v[:, :keep] if k in COLUMNS else v for k, v in batch.items()}


class Preference:
    name = "preference"
    primary = "pairs"
    perplexity = False

    def __init__(self, cfg: PreferenceSection):
        self.cfg = cfg
        self.adapters_off = False  # the reference is the base with LoRA switched off (set in validate)
        self.packed = False  # data.packing: a micro-batch's sequences run as one row without padding (validate)
        self.lead, self.multiple = True, PAD_MULTIPLE  # sequence shards: set in validate

    def validate(self, setup) -> None:
        recipe, layout = setup.recipe, setup.layout
        if layout.is_pipeline:
            raise UserError("data.format=preference does not run on pipeline stages yet; use a ZeRO config")
        if layout.sequence_parallel > 1:
            raise UserError("data.format=preference does not run with Ulysses sequence parallelism yet (its attention "
                            "is built for micro_batch_size rows, a pair is two); use context_parallel_size (ring "
                            "attention) or drop sequence_parallel_size")
        # ring attention: each rank of a ring runs its part of every pair's rows; the pairs are counted (and the
        # loss's value summed) on the ring's first rank only, while every rank's part takes its gradient
        self.lead = layout.sequence_shard == 0
        self.multiple = math.lcm(PAD_MULTIPLE, 2 * layout.sequence_shards)
        if layout.sequence_shards > 1 and recipe.data.packing:
            raise UserError("data.format=preference with data.packing and context_parallel_size is not supported yet "
                            "(a packed row's length does not split over the ring); set data.packing=false")
        from ..model import from_scratch
        from ..paths import local_or_hub
        if self.cfg.needs_reference and setup.init_from is None and from_scratch(
                recipe.model, local_or_hub(recipe.model.name_or_path)):
            raise UserError(f"preference.loss={self.cfg.loss} needs a trained model as its reference, but "
                            f"{recipe.model.name_or_path} starts from random weights; pass --init_from=<a run or "
                            f"its hf/ export> or a model with weights, or use preference.loss=simpo or orpo")
        self.adapters_off = self.cfg.needs_reference and recipe.lora.enabled
        self.packed = recipe.data.packing
        moe.without_router_loss(setup, "data.format=preference")

    # ------------------------------------------------------------------ counts and the loss
    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        if not self.lead:
            return {"pairs": 0, "label_tokens": 0, "chosen_tokens": 0}
        labels = (int((batch[f"{s}_labels"][:, 1:] != IGNORE_INDEX).sum()) for s in ("chosen", "rejected"))
        return {"pairs": int(batch["chosen_input_ids"].shape[0]), "label_tokens": sum(labels),
                "chosen_tokens": int(batch["chosen_attention_mask"][:, 1:].sum())}

    def real_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        if not self.lead:
            return 0
        return int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())

    def host_batch(self, batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
        return trim_padding(batch, self.multiple)

    def loss_sum(self, model, batch: dict[str, torch.Tensor], totals: dict[str, float]):
        logps, lengths, chosen_nll = sequence_logps(model, batch, self.packed, chosen_nll=self.cfg.loss == "orpo")
        pc, pr = logps.chunk(2)
        nc, nr = lengths.chunk(2)
        rc = rr = None
        if self.cfg.needs_reference:
            if "ref_logps" in batch:
                rc, rr = batch["ref_logps"].to(pc.dtype).unbind(1)
            else:
                rc, rr = self._reference_now(model, batch)
        loss, chosen_rewards, rejected_rewards, lc, lr = pair_losses(self.cfg, pc, pr, nc, nr, rc, rr)
        summed = loss.sum()
        if self.cfg.loss == "orpo":  # NLL of the chosen sequences (prompt and response), a mean over tokens
            summed = summed + chosen_nll * (totals["pairs"] / max(totals["chosen_tokens"], 1.0))
        stats = [chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
                 (chosen_rewards - rejected_rewards).sum(), lc.detach().sum(), lr.detach().sum()]
        if self.cfg.loss == "orpo":
            ac, ar = lc.detach(), lr.detach()
            log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
            stats += [chosen_nll.detach(), F.logsigmoid(log_odds).sum(), log_odds.sum()]
        if not self.lead:  # the value counted once per ring, the gradient taken on every rank
            return summed - summed.detach(), torch.stack(stats) * 0
        return summed, torch.stack(stats)

    def metrics(self, stats: list[float], totals: dict[str, float]) -> dict[str, float]:
        out = {name: value / totals["pairs"] for name, value in zip(STATS, stats)}
        if self.cfg.loss == "orpo":
            nll, ratio, odds = stats[len(STATS):]
            out.update(zip(ORPO_STATS, (nll / max(totals["chosen_tokens"], 1.0), ratio / totals["pairs"],
                                        odds / totals["pairs"])))
        return out

    @torch.no_grad()
    def _reference_now(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """LoRA: the reference is the base model, the same engine with its adapters switched off."""
        peft_model = getattr(model, "module", model)
        with peft_model.disable_adapter():
            logps = sequence_logps(model, batch, self.packed)[0]
        return logps.chunk(2)

    # ------------------------------------------------------------------ the reference pass
    @staticmethod
    def sequences_per_sample(recipe) -> int:
        return 2  # chosen and rejected, one forward of 2B rows

    @staticmethod
    def evaluation_keys(recipe) -> list[str]:
        return ["eval_loss"] + [f"eval_{name}" for name in STATS + (ORPO_STATS if recipe.preference.loss == "orpo"
                                                                    else ())]

    def before_training(self, engine, datasets: list, setup, cache_path: Path | None, weights: str) -> list:
        """The datasets with their reference log-probs attached: read from the run directory (a resumed run), or
        from the data cache (the same data and base weights before), or computed now, once."""
        if not self.cfg.needs_reference or self.adapters_off:
            return datasets
        from ..parallel import dist
        layout, ctx, run_dir, log = setup.layout, setup.ctx, setup.run_dir, setup.log
        micro_batch_size = setup.recipe.train.micro_batch_size
        key = hashlib.sha256(json.dumps({"weights": weights, "data": str(cache_path)}).encode()).hexdigest()[:16]
        stored = run_dir / REFERENCE_FILE
        cached = cache_path / f"reference-{key}.pt" if cache_path is not None else None
        tables = None
        for source in (stored, cached):
            if source is not None and source.exists():
                found = torch.load(source)
                if found.get("key") == key:
                    tables, where = found["tables"], source
                    break
        if tables is None:
            tables = [self._compute(engine, d, layout, micro_batch_size) if d is not None else None
                      for d in datasets]
            where = None
            if ctx.is_main:
                payload = {"key": key, "weights": weights, "tables": tables}
                for target in (stored, cached):
                    if target is not None:
                        tmp = target.with_suffix(".tmp")
                        torch.save(payload, tmp)
                        tmp.replace(target)
            dist.barrier()
        how = f"read from {where}" if where else "computed (once: the run directory and the data cache keep them)"
        log(f"reference log-probs of {sum(len(t) for t in tables if t is not None):,} pairs {how}")
        return [WithReference(d, t) if d is not None else None for d, t in zip(datasets, tables)]

    @torch.no_grad()
    def _compute(self, engine, dataset, layout, micro_batch_size: int) -> torch.Tensor:
        """[rows, 2] reference log-probs: each data-parallel rank its strided share, in micro-batches (every rank
        runs the same number of forwards, as ZeRO-3 needs), gathered to every rank."""
        from ..parallel import dist
        n, dp, rank = len(dataset), layout.data_parallel, layout.data_parallel_rank
        share = list(range(rank, n, dp))
        per_rank = -(-n // dp)
        share += [share[-1] if share else 0] * (per_rank - len(share))  # padding rows: computed, not kept
        was_training = engine.module.training
        engine.eval()
        values = []
        for start in range(0, per_rank, micro_batch_size):
            rows = trim_padding(dataset[share[start:start + micro_batch_size]], self.multiple)
            batch = {k: v.long().to(engine.device) for k, v in rows.items() if k != "pair_index"}
            values.append(sequence_logps(engine, batch, self.packed)[0].view(2, -1).t().double().cpu())
        if was_training:
            engine.train()
        mine = torch.cat(values) if values else torch.zeros(0, 2, dtype=torch.float64)
        table = torch.zeros(n, 2, dtype=torch.float64)
        # every rank's share, by its data-parallel rank (replica peers computed the same rows)
        for dp_rank, part in dist.all_gather_objects((rank, mine)):
            rows = list(range(dp_rank, n, dp))
            table[rows] = part[:len(rows)]
        return table


class WithReference:
    """A tokenized split whose rows also carry `ref_logps` [2] (chosen, rejected): what TrainStream and
    eval_batches read, unchanged otherwise."""

    def __init__(self, dataset, table: torch.Tensor):
        self.dataset, self.table = dataset, table

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx):
        rows = self.dataset[idx]
        return dict(rows, ref_logps=self.table[rows["pair_index"]])

    def __getattr__(self, name):  # order(), note_samples() of a prepared mix
        return getattr(self.dataset, name)
