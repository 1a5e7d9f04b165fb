"""The arithmetic of reinforcement learning from rewards (GRPO and its kin, RLOO), in TRL's conventions.

What objectives/rl.py calls, each checked against TRL 1.16's GRPOTrainer on the same inputs
(tests/unit/test_rl_math.py). Written here rather than imported because TRL computes them inside its trainer's
methods, tied to its accelerator and its batch layout; the formulas are TRL's (and the papers').

  advantages(rewards, G, scale)     GRPO: reward minus its group's mean, over the group's (or the batch's) std
  rloo_advantages(rewards, G)       RLOO: reward minus the mean of the group's other G-1 rewards
  sequence_policy_loss(...)         RLOO's loss: the clipped surrogate of whole-sequence ratios, mean over sequences
  policy_loss(...)                  the clipped surrogate with an optional KL to a reference, per token, and
                                    the sum and divisor the objective seam normalises by (see its docstring)
"""
from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel's correction) ignoring NaNs; NaN where fewer than 2 values count."""
    dims = () if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dims else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dims) if dims else (~torch.isnan(x)).sum()
    variance = (torch.nansum((x - mean) ** 2, dim=dims) if dims else torch.nansum((x - mean) ** 2)) / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt()


def advantages(rewards: torch.Tensor, generations: int, scale: str = "group",
               batch_std: float | None = None) -> torch.Tensor:
    """GRPO's advantages for rewards laid out group by group (G consecutive completions of one prompt).

    A NaN reward (every reward function returned None for that completion) is left out of its group's mean and
    std and gets advantage 0. `scale`: "group" divides by the group's std, "batch" by the whole batch's (Dr. GRPO's
    critique of per-group scaling; `batch_std`: the global batch's, when `rewards` is one rank's share of it),
    "none" does not divide."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {', '.join(SCALES)}")
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
    centred = rewards - mean
    if scale == "group":
        std = _nanstd(grouped, dim=1).repeat_interleave(generations) if generations > 1 else torch.zeros_like(rewards)
        centred = centred / (std + STD_EPS)
    elif scale == "batch":
        std = torch.tensor(batch_std) if batch_std is not None else \
            _nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
        centred = centred / (std + STD_EPS)
    return torch.nan_to_num(centred, nan=0.0)


def rloo_advantages(rewards: torch.Tensor, generations: int, normalize: bool = False) -> torch.Tensor:
    """RLOO's leave-one-out baseline: each completion's reward minus the mean of its scorable siblings' rewards
    (NaN rewards left out; a completion with no scorable sibling, or unscorable itself, gets 0); `normalize`:
    then centred and scaled over the batch (TRL's normalize_advantages). RLOO's KL, a per-sequence penalty on the
    reward, is subtracted from `rewards` before this by the caller."""
    if generations < 2:
        raise ValueError("RLOO needs at least 2 generations per prompt")
    grouped = rewards.view(-1, generations)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    out = rewards - baseline.reshape(-1)
    if normalize:
        out = (out - torch.nanmean(out)) / (_nanstd(out) + STD_EPS)
    return torch.nan_to_num(out, nan=0.0)


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
                loss_type: str = "dapo", epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
                ref_logps: torch.Tensor | None = None, max_completion_length: int | None = None,
                bias_correction_kl: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate (PPO's, as GRPO uses it) of completion tokens, plus beta x the k3 estimate of the KL
    to the reference.

    logps, old_logps, ref_logps: (B, T) per-token log-probabilities of the completions under the policy being
    trained, the policy that sampled them (None: the same weights, so the ratio is 1 and only its gradient
    counts) and the reference; advantages (B,); mask (B, T) 1 on completion tokens.
    Returns (loss_sum, divisor, sums): the loss of these sequences is loss_sum / divisor, and over a global batch
    the seam sums both over micro-batches and ranks first, which gives TRL's loss for
      grpo     the mean over sequences of each one's mean token loss    (divisor: sequences)
      dr_grpo  the token losses' sum / (sequences x max_completion_length) (divisor: sequences)
      dapo     the token losses' sum / completion tokens                 (divisor: tokens)
      bnpo     as dapo, but TRL divides per micro-batch: equal to it when there is one micro-batch per rank
    bias_correction_kl (TRL's use_bias_correction_kl, on by default in 1.16): the KL term times the ratio, so its
    gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2); the value is unchanged at ratio 1, the gradient
    is not. `sums`: the masked sums of the per-token KL and of the clipped-token indicators (low, high), for the
    metrics."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    sums: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probabilities")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:
            kl = kl * ratio  # and so logged, as TRL logs it
        per_token = per_token + beta * kl
        sums["kl"] = (kl.detach() * mask).sum()
    sums["clip_low"] = (((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype) * mask).sum().detach()
    sums["clip_high"] = (((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype) * mask).sum().detach()
    sums["tokens"] = mask.sum().detach()
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), torch.tensor(float(logps.shape[0])), sums
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("dr_grpo divides by max_completion_length: give it")
        return masked.sum() / max_completion_length, torch.tensor(float(logps.shape[0])), sums
    return masked.sum(), mask.sum().clamp(min=1.0), sums


def sequence_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                         mask: torch.Tensor, epsilon_low: float = 0.2, epsilon_high: float = 0.2
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's loss (TRL's RLOOTrainer): each sequence's ratio is exp of its summed token log-prob difference,
    clipped as PPO clips it; the loss is the mean over sequences (returned as (sum, sequences, sums) as
    policy_loss does). old_logps: per-token, (B, T), or None for the same weights (ratio 1)."""
    mask = mask.to(logps.dtype)
    seq = (logps * mask).sum(-1)
    old = seq.detach() if old_logps is None else (old_logps * mask).sum(-1)
    ratio = torch.exp(seq - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)
    sums = {"clip_low": ((ratio < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype).sum().detach(),
            "clip_high": ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype).sum().detach(),
            "tokens": torch.tensor(float(logps.shape[0]))}  # RLOO clips sequences: its clip ratios count them
    return per_sequence.sum(), torch.tensor(float(logps.shape[0])), sums


def batch_std(rewards: torch.Tensor, reduce=None) -> float:
    """The sample std of the non-NaN rewards over the global batch, from one rank's share: `reduce` sums
    [count, sum, sum of squares] over the ranks (None: this share is the batch). 0 with fewer than 2 values, as
    TRL's (which gathers every reward first)."""
    kept = rewards[~torch.isnan(rewards)].double()
    count, total, squares = (reduce or (lambda v: v))([float(kept.numel()), float(kept.sum()),
                                                        float((kept ** 2).sum())])
    if count < 2:
        return 0.0
    mean = total / count
    return max((squares - count * mean * mean) / (count - 1), 0.0) ** 0.5
