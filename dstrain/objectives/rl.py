"""Learning from rewards: GRPO and its kin (`data.format: prompt`, the `rl` section), in TRL's conventions.

A sample of the stream is a prompt. Before a step's forward passes, `prepare` (the seam's hook, called by
steps.train_step) turns this rank's prompts into rl.num_generations completions each, sampled from the current
weights (rollout.py: completion c of the prompt at place p of global batch s is drawn with a generator seeded by
(train.seed, s, p, c), so neither the rank count nor the batch's neighbours change it), scores them with the reward
functions (rewards.py), and gives each completion its advantage within its prompt's group (rl_math.py; a group
never spans ranks). The micro-batches it returns hold prompt + completion sequences; loss_sum is the clipped
surrogate on the completion tokens, normalised by the seam over the whole global batch: by completions for
`grpo` and `dr_grpo`, by completion tokens for `dapo` and `bnpo`. rl.algorithm=rloo: RLOO's leave-one-out
advantages and its loss on whole-sequence ratios, by completions. The log-probs are those of the sampling
distribution (logits / rl.temperature), as TRL's. What samples is rl.rollout_engine (rollout.py: the built-in
seeded sampler, or an engine of the user's such as vLLM).

rl.num_iterations = mu > 1: a rollout batch is made at the first of every mu steps (from the stream's batch
(step - 1) // mu: train.py reads `steps_per_batch`) with the sampling policy's log-probs, and the next mu - 1 steps
train on the same completions against them (the ratio moves away from 1 and is clipped). Checkpoints and stops
land at a rollout batch's end (train.py), so a resumed run starts a new one: nothing of it is saved.
"""
from __future__ import annotations

import math
import time

import torch

from .. import moe
from ..config import RLSection
from ..errors import UserError
from . import rewards as reward_fns
from . import rl_math, rollout

# The figures RL.metrics logs, each with when it does (the sweep's check of a metric name reads this; a test keeps
# it equal to what metrics() returns).
EVAL_KEYS = {"reward": lambda cfg: bool(cfg.reward_funcs), "reward_std": lambda cfg: bool(cfg.reward_funcs),
             "completions/mean_length": lambda cfg: True, "completions/clipped_ratio": lambda cfg: True,
             "clip_ratio/low_mean": lambda cfg: bool(cfg.reward_funcs),
             "clip_ratio/high_mean": lambda cfg: bool(cfg.reward_funcs), "entropy": lambda cfg: True,
             "kl": lambda cfg: cfg.beta != 0.0, "distill_loss": lambda cfg: bool(cfg.teacher),
             "rewards/*/mean": lambda cfg: bool(cfg.reward_funcs), "rewards/*/std": lambda cfg: bool(cfg.reward_funcs)}


class RL:
    name = "rl"
    perplexity = False

    def __init__(self, cfg: RLSection):
        self.cfg = cfg
        self.steps_per_batch = cfg.num_iterations  # the seam: optimizer steps that share one batch of the stream
        self.cycle: list[dict] | None = None  # the rollout batch later steps of it train on again
        by_tokens = (cfg.algorithm == "grpo" and cfg.loss_type in ("dapo", "bnpo")) or not cfg.reward_funcs
        self.primary = "completion_tokens" if by_tokens else "completions"
        self.sampling = rollout.Sampling(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k)
        self.temperature = cfg.temperature if cfg.temperature > 0 else 1.0  # greedy sampling: the plain logits

    def validate(self, setup) -> None:
        recipe, layout = setup.recipe, setup.layout
        splits = [name for name, on in (("pipeline stages", layout.is_pipeline),
                                        ("tensor parallelism", layout.tensor_parallel > 1),
                                        ("Ulysses sequence parallelism", layout.sequence_parallel > 1),
                                        ("ring attention (context_parallel_size)", layout.context_parallel > 1)) if on]
        if splits:  # named as the user set it (issue 69: a ring config was told of the other three only)
            raise UserError(f"data.format=prompt (learning from rewards) runs on ZeRO configs only so far, and "
                            f"{recipe.ds_config} sets {' and '.join(splits)}; use zero2.json or zero3.json")
        mu, every = self.cfg.num_iterations, recipe.checkpoint.every
        for name, value in (("train.max_steps", recipe.train.max_steps),
                            ("train.exit_at_step", recipe.train.exit_at_step),
                            ("checkpoint.every", every if every != "auto" else None)):
            if mu > 1 and value and value % mu:
                raise UserError(f"{name}={value} is not a multiple of rl.num_iterations={mu}: a run stops and saves "
                                f"only at the end of a rollout batch; make it a multiple")
        room = recipe.train.seq_len - self.cfg.max_completion_length
        if room < 1:
            raise UserError(f"train.seq_len={recipe.train.seq_len} leaves no room for a prompt beside "
                            f"rl.max_completion_length={self.cfg.max_completion_length}; raise train.seq_len")
        moe.without_router_loss(setup, "data.format=prompt (learning from rewards)")
        self.prompt_room, self.seed, self.micro = room, recipe.train.seed, recipe.train.micro_batch_size
        self.setup, self.reference, self.adapters_off = setup, None, self.cfg.beta != 0 and recipe.lora.enabled
        self.prompt_field = recipe.data.prompt_field
        if "format_regex" in self.cfg.reward_funcs and not self.cfg.format_pattern:
            raise UserError("the format_regex reward needs rl.format_pattern (a regular expression)")
        cache = self.cfg.overlong_cache or max(1, self.cfg.max_completion_length // 4)
        params = {"format_regex": {"pattern": self.cfg.format_pattern},
                  "overlong_penalty": {"max_completion_length": self.cfg.max_completion_length, "cache": cache}}
        self.rewards = [reward_fns.load(spec, **params.get(spec, {})) for spec in self.cfg.reward_funcs]
        from ..model import load_tokenizer
        self.tokenizer = load_tokenizer(recipe.model)
        self.eos = self.tokenizer.eos_token_id
        if self.eos is None:
            raise UserError("the tokenizer has no eos_token: a completion could not end; set one on the model")
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        if self.cfg.teacher:
            self._check_teacher(setup)
        self.teacher = None  # built in before_training
        self.engine_name = self.cfg.rollout_engine
        if self.engine_name == "sampler":
            self.engine = None  # made in prepare: its keep_going needs the engine's device
        else:
            factory = reward_fns.load_named(self.engine_name, "rollout engine", "name `sampler` (built in) or ")
            try:
                self.engine = factory(tokenizer=self.tokenizer, sampling=self.sampling, eos_token_id=self.eos,
                                      pad_token_id=self.pad)
            except Exception as e:  # noqa: BLE001 -- the user's engine: one line, not our traceback
                raise UserError(f"rollout engine {self.engine_name}: could not be made ({type(e).__name__}: {e})"
                                ) from None

    def _check_teacher(self, setup) -> None:
        """The teacher's next-token distributions must be over the student's vocabulary: the same size (and, where
        the teacher has a tokenizer of its own, the same tokens)."""
        from pathlib import Path

        from ..model import has_weights, load_config, load_tokenizer
        from ..paths import local_or_hub
        teacher = self._teacher_config(setup)
        location = local_or_hub(teacher.name_or_path)
        if Path(location).is_dir() and not has_weights(location):
            raise UserError(f"rl.teacher {self.cfg.teacher} has a config but no weights: a teacher must be a trained "
                            f"model")
        try:
            config = load_config(teacher, setup.recipe.train.seq_len)[1]
        except UserError as error:  # its hint names the key the teacher came from, not the student's
            raise UserError(str(error).replace("model.name_or_path / model.tokenizer", "rl.teacher")) from None
        ours = max(len(self.tokenizer), setup.model_config.vocab_size)
        if max(config.vocab_size, len(self.tokenizer)) != ours:
            raise UserError(f"rl.teacher {self.cfg.teacher} has a vocabulary of {config.vocab_size}, the student "
                            f"{ours}: distillation compares their next-token distributions; use a teacher with the "
                            f"student's tokenizer")
        try:
            theirs = load_tokenizer(teacher)
        except UserError:
            return  # a teacher without a tokenizer of its own: the sizes agree
        if theirs.get_vocab() != self.tokenizer.get_vocab():
            raise UserError(f"rl.teacher {self.cfg.teacher} has a different tokenizer from the student's (same size, "
                            f"other tokens): distillation needs the same one")

    def _teacher_config(self, setup):
        from ..config import ModelConfig
        return ModelConfig(name_or_path=self.cfg.teacher, from_scratch="false",
                           trust_remote_code=setup.recipe.model.trust_remote_code)

    # ------------------------------------------------------------------ the rollout
    def prepare(self, engine, micro_batches: list[dict], layout, step: int) -> list[dict]:
        """This rank's prompts -> micro-batches of completions with their advantages (see the module docstring)."""
        from ..parallel.dist import all_reduce_sum
        mu = self.cfg.num_iterations
        if step > 0 and mu > 1 and (step - 1) % mu:  # a later step of the rollout batch: its completions again
            return [dict(b, rollout_s=torch.tensor(0.0)) for b in self.cycle]
        G = self.cfg.num_generations
        ids, columns, keys = [], {}, []
        for m, batch in enumerate(micro_batches):
            # the columns as the reward functions take them: numbers the torch format made tensors, back to lists
            batch = {k: v.tolist() if isinstance(v, torch.Tensor) and k != "prompt_ids" else v
                     for k, v in batch.items()}
            for i in range(len(batch["prompt_ids"])):
                place = (m * layout.data_parallel + layout.data_parallel_rank) * self.micro + i
                for c in range(G):
                    keys.append((self.seed, step, place, c))
                    ids.append([int(t) for t in batch["prompt_ids"][i][-self.prompt_room:]])
                    for name, values in batch.items():
                        if name not in ("prompt_ids", "prompt_index"):
                            columns.setdefault(name, []).append(values[i])
        prompts = columns.pop(self.prompt_field)
        if self.engine is None:
            keep_going = None
            if torch.distributed.is_initialized() and int(
                    (self.setup.ds_cfg.get("zero_optimization") or {}).get("stage", 0)) == 3:
                # ZeRO-3 gathers parameters in every forward: ranks run as many (one small all-reduce per token)
                def keep_going(active: bool) -> bool:
                    return all_reduce_sum([float(active)], engine.device)[0] > 0
            self.engine = rollout.Sampler(self.sampling, self.eos, self.pad, keep_going)
        began = time.perf_counter()
        completion_ids = self._check(self.engine(engine.module, ids, keys), len(ids))
        rollout_s = time.perf_counter() - began
        # TRL's rule: a completion that does not end with EOS was cut at max_completion_length
        truncated = [not c or c[-1] not in (self.eos, self.pad) for c in completion_ids]
        out = rollout.Rollouts(completion_ids, truncated)
        texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        if self.rewards:
            per_func, total = self._score(engine, prompts, completions, out.completion_ids, columns)
        else:  # distillation alone: the teacher scores the tokens, no reward and no advantage
            per_func, total = torch.zeros(len(ids), 0), torch.zeros(len(ids))
        made, start = [], 0
        for batch in micro_batches:
            n = len(batch["prompt_ids"]) * G
            made.append(self._tensors(ids[start:start + n], out.completion_ids[start:start + n],
                                      out.truncated[start:start + n], total[start:start + n],
                                      per_func[start:start + n]))
            start += n
        penalised = total
        if self.cfg.beta != 0.0:
            for batch in made:
                batch["ref_logps"] = self._reference_logps(engine, batch)
        later_steps = step > 0 and mu > 1
        if later_steps or (self.cfg.beta != 0.0 and self.cfg.algorithm == "rloo"):
            for batch in made:  # the sampling policy's log-probs: the ratio's denominator, RLOO's KL
                with torch.no_grad():
                    batch["old_logps"] = self._logps(engine, {k: v.to(engine.device)
                                                              for k, v in batch.items()})[0].cpu()
        if self.cfg.beta != 0.0 and self.cfg.algorithm == "rloo":
            for batch in made:  # RLOO: the KL, summed over each sequence, is a penalty on its reward (first-order:
                batch["kl"] = (batch["old_logps"] - batch["ref_logps"]) * batch["completion_mask"]  # TRL's)
            penalised = total - self.cfg.beta * torch.cat([b["kl"].sum(-1) for b in made])
        if not later_steps:  # with one update per rollout the ratio is 1: the step's own log-probs, detached
            for batch in made:
                batch.pop("old_logps", None)
        if self.cfg.algorithm == "rloo":
            advantages = rl_math.rloo_advantages(penalised, G, self.cfg.normalize_advantages)
        else:
            spread = None
            if self.cfg.scale_rewards == "batch":  # the global batch's std: sums over the data-parallel ranks
                from ..parallel.dist import all_reduce_sum
                spread = rl_math.batch_std(penalised, lambda v: all_reduce_sum(v, engine.device,
                                                                               layout.data_parallel_group))
            advantages = rl_math.advantages(penalised, G, self.cfg.scale_rewards, spread)
        for batch, part in zip(made, advantages.split([b["input_ids"].shape[0] for b in made])):
            batch["advantages"] = part.float()
        for i, batch in enumerate(made):  # this rank's sampling time, counted once (its first micro-batch)
            batch["rollout_s"], batch["ranks"] = torch.tensor(rollout_s if i == 0 else 0.0), torch.tensor(float(i == 0))
        every = self.cfg.log_completions_every
        if step > 0 and every and step % every == 0 and self.setup.ctx.is_main:
            self._log_completions(step, prompts, completions, per_func, total, advantages)
        if later_steps:
            self.cycle = made
        return made

    def _score(self, engine, prompts, completions, completion_ids, columns):
        """The reward functions on this rank's completions; a function failing on any rank (one line naming it and
        the completion, rewards.py) stops every rank with that line, together, so the run ends as on any bad input
        (exit 2) and the save in flight, the last good state, is finished first (train.py)."""
        from ..parallel.dist import all_gather_objects, all_reduce_sum
        try:
            scored, problem = reward_fns.score(self.rewards, self.cfg.reward_weights, prompts, completions,
                                               completion_ids, columns), None
        except UserError as error:
            scored, problem = None, str(error)
        if torch.distributed.is_initialized() and all_reduce_sum([float(problem is not None)], engine.device)[0]:
            problem = next(p for p in all_gather_objects(problem) if p is not None)
        if problem is not None:
            error = UserError(problem)
            error.every_rank = True
            raise error
        return scored

    def _log_completions(self, step: int, prompts, completions, per_func, total, advantages) -> None:
        """Rank 0's prompts and completions of this step, with their rewards and advantages: a line each in
        completions.jsonl (TRL's log_completions table), and a table in wandb when it is on."""
        import json
        names = [r.name for r in self.rewards]

        def text(x):
            return x if isinstance(x, str) else json.dumps(x)
        rows = [{"step": step, "prompt": text(p), "completion": text(c),
                 "reward": None if math.isnan(float(r)) else float(r), "advantage": float(a),
                 "rewards": {n: None if math.isnan(float(v)) else float(v) for n, v in zip(names, f.tolist())}}
                for p, c, r, a, f in zip(prompts, completions, total, advantages, per_func)]
        with open(self.setup.run_dir / "completions.jsonl", "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is not None:
            table = wandb.Table(columns=["step", "prompt", "completion", "reward", "advantage", *names])
            for row in rows:
                table.add_data(row["step"], row["prompt"], row["completion"], row["reward"], row["advantage"],
                               *[row["rewards"][n] for n in names])
            wandb.log({"completions": table}, step=step)

    @torch.no_grad()
    def _reference_logps(self, engine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's per-token log-probs of a micro-batch's completions (on the host): the frozen copy of
        the starting weights, or with LoRA the policy with its adapters switched off (no second model)."""
        on_device = {k: v.to(engine.device) for k, v in batch.items()}
        if self.adapters_off:
            with getattr(engine, "module", engine).disable_adapter():
                return self._logps(engine, on_device)[0].cpu()
        if self.reference is None:
            raise RuntimeError("the reference model is built in before_training")
        return self._logps(self.reference, on_device)[0].cpu()

    def _logps(self, model, batch: dict[str, torch.Tensor], entropy: bool = False, logits_too: bool = False):
        """(per-token log-probs of the completions under `model` at logits / temperature, their entropies or
        None[, the raw logits that predict the completion's tokens]): what the loss, the reference, RLOO's old
        policy and the teacher all compute the same way."""
        ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
        width_c = mask.shape[1]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False,
                       **rollout.keep_last(model, width_c + 1)).logits  # the head on the completion's positions
        raw = logits[:, -width_c - 1:-1].float()  # the logits that predict the completion's tokens
        every = torch.log_softmax(raw / self.temperature, dim=-1)  # the sampling distribution's, as TRL's
        logps = every.gather(-1, ids[:, -width_c:].unsqueeze(-1)).squeeze(-1)
        out = logps, (-(every.exp() * every).sum(-1).detach() if entropy else None)
        return (*out, raw) if logits_too else out

    def _check(self, completions, rows: int) -> list[list[int]]:
        """An engine's answer, checked: one list of token ids per prompt, none longer than allowed."""
        limit = self.cfg.max_completion_length
        if not isinstance(completions, (list, tuple)) or len(completions) != rows:
            got = len(completions) if isinstance(completions, (list, tuple)) else type(completions).__name__
            raise UserError(f"rollout engine {self.engine_name} returned {got} completions for {rows} prompts; it "
                            f"must return one list of token ids per prompt")
        out = []
        for i, c in enumerate(completions):
            c = [int(t) for t in (c.tolist() if hasattr(c, "tolist") else c)]
            if len(c) > limit:
                raise UserError(f"rollout engine {self.engine_name} returned {len(c)} tokens for prompt row {i}; "
                                f"rl.max_completion_length is {limit}: stop it there")
            out.append(c)
        return out

    def _tensors(self, prompts: list[list[int]], completions: list[list[int]], truncated: list[bool],
                 total: torch.Tensor, per_func: torch.Tensor) -> dict[str, torch.Tensor]:
        """Left-padded prompts and right-padded completions in one row each; completion_mask marks what trains."""
        width_p, width_c = max(len(p) for p in prompts), max(max(len(c) for c in completions), 1)
        rows = len(prompts)
        ids = torch.full((rows, width_p + width_c), self.pad, dtype=torch.long)
        attention = torch.zeros(rows, width_p + width_c, dtype=torch.long)
        completion_mask = torch.zeros(rows, width_c)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            ids[r, width_p - len(p):width_p] = torch.tensor(p, dtype=torch.long)
            ids[r, width_p:width_p + len(c)] = torch.tensor(c, dtype=torch.long)
            attention[r, width_p - len(p):width_p + len(c)] = 1
            if not (truncated[r] and self.cfg.mask_truncated_completions):
                completion_mask[r, :len(c)] = 1
        return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion_mask,
                "rewards": total.float(), "rewards_per_func": per_func.float(),
                "completion_length": torch.tensor([float(len(c)) for c in completions]),
                "truncated": torch.tensor([float(t) for t in truncated])}

    # ------------------------------------------------------------------ counts and the loss
    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        tokens = int(batch["completion_mask"].sum())  # label_tokens: what the log counts as trained on
        return {"completions": int(batch["input_ids"].shape[0]), "completion_tokens": tokens, "label_tokens": tokens}

    def real_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def host_batch(self, batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
        return batch

    def loss_sum(self, model, batch: dict[str, torch.Tensor], totals: dict[str, float]):
        mask, cfg = batch["completion_mask"], self.cfg
        logps, entropy, logits = self._logps(model, batch, entropy=True, logits_too=True)
        summed, sums = torch.zeros((), device=logps.device), {}
        if self.rewards and cfg.algorithm == "rloo":
            summed, _, sums = rl_math.sequence_policy_loss(logps, batch.get("old_logps"), batch["advantages"], mask,
                                                           cfg.epsilon, cfg.epsilon_high)
        elif self.rewards:
            summed, _, sums = rl_math.policy_loss(logps, batch.get("old_logps"), batch["advantages"], mask,
                                                  cfg.loss_type, cfg.epsilon, cfg.epsilon_high, cfg.beta,
                                                  batch.get("ref_logps"),
                                                  cfg.max_completion_length, cfg.use_bias_correction_kl)
        distill = torch.zeros((), device=logps.device)
        if self.teacher is not None:
            distill = self._distill_sum(batch, logits, mask)
            # the seam divides by totals[primary]: the distillation loss is a mean over completion tokens
            summed = summed + cfg.distill_weight * distill * (totals[self.primary] / totals["completion_tokens"])
        rewards, per_func = batch["rewards"], batch["rewards_per_func"]
        scored = ~torch.isnan(rewards)
        zero = torch.zeros((), device=logps.device)
        stats = [torch.nansum(rewards), torch.nansum(rewards ** 2), scored.float().sum(),
                 batch["completion_length"].sum(), batch["truncated"].sum(), sums.get("clip_low", zero),
                 sums.get("clip_high", zero), sums.get("tokens", zero), (entropy * mask).sum(), mask.sum(),
                 sums["kl"] if "kl" in sums else batch["kl"].sum() if "kl" in batch else zero, distill.detach(),
                 batch["rollout_s"], batch["ranks"]]
        stats += [torch.nansum(per_func, dim=0), torch.nansum(per_func ** 2, dim=0),
                  (~torch.isnan(per_func)).float().sum(dim=0)]
        head = torch.stack([x.reshape(()).float().to(logps.device) for x in stats[:14]])
        return summed, torch.cat([head] + [x.float().to(head.device) for x in stats[14:]])

    def _distill_sum(self, batch, student_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The generalized JSD between the student's and the teacher's next-token distributions, summed over
        completion tokens: DeepSpeed's own generalized_jsd_loss (deepspeed.runtime.rollout; beta 1 is the
        reverse KL(student || teacher), TRL GKD's convention), both at logits / rl.temperature."""
        from deepspeed.runtime.rollout import generalized_jsd_loss  # exported by the package: public
        with torch.no_grad():
            teacher_logits = self._logps(self.teacher, batch, logits_too=True)[2]
        return generalized_jsd_loss(student_logits, teacher_logits, mask.bool(), beta=self.cfg.distill_beta,
                                    temperature=self.temperature).loss_sum

    def metrics(self, stats: list[float], totals: dict[str, float]) -> dict[str, float]:
        """TRL's names: reward (mean over scored completions), reward_std, rewards/<function>/mean and /std, the mean
        completion length, the share cut at max_completion_length, the share of tokens (RLOO: sequences) clipped each
        way, the mean entropy of the sampling distribution over completion tokens."""
        total, squares, scored, length, truncated, low, high, clippable, entropy, tokens, kl, distill, rollout_s, \
            ranks = stats[:14]
        funcs = len(self.rewards)
        sums, squared, counts = (stats[14 + i * funcs:14 + (i + 1) * funcs] for i in range(3))
        completions = max(totals["completions"], 1.0)
        mean = total / scored if scored else math.nan
        variance = (squares - scored * mean ** 2) / (scored - 1) if scored > 1 else math.nan
        out = {"reward": mean, "reward_std": math.sqrt(max(variance, 0.0)) if scored > 1 else math.nan,
               "completions/mean_length": length / completions, "completions/clipped_ratio": truncated / completions,
               "clip_ratio/low_mean": low / max(clippable, 1.0), "clip_ratio/high_mean": high / max(clippable, 1.0),
               "entropy": entropy / max(tokens, 1.0)}
        if ranks and rollout_s > 0:  # a step that sampled (not a later one of a rollout batch): seconds per rank
            out["rollout_s"] = rollout_s / ranks  # (their mean), and the completion tokens all ranks made per second
            out["rollout_tokens_per_s"] = length / out["rollout_s"]
        if self.cfg.beta != 0.0:  # GRPO: the k3 estimate per token; RLOO: log pi_old - log pi_ref per token
            out["kl"] = kl / max(tokens, 1.0)
        if self.cfg.teacher:  # the generalized JSD to the teacher per completion token (distill_beta 1: reverse KL)
            out["distill_loss"] = distill / max(tokens, 1.0)
        if not self.rewards:  # distillation alone: no reward to report
            for key in ("reward", "reward_std", "clip_ratio/low_mean", "clip_ratio/high_mean"):
                out.pop(key)
        for reward, s, q, c in zip(self.rewards, sums, squared, counts):
            out[f"rewards/{reward.name}/mean"] = s / c if c else math.nan
            out[f"rewards/{reward.name}/std"] = math.sqrt(max((q - s * s / c) / (c - 1), 0.0)) if c > 1 else math.nan
        return out

    @staticmethod
    def sequences_per_sample(recipe) -> int:
        return recipe.rl.num_generations  # each prompt becomes rl.num_generations prompt + completion rows

    @staticmethod
    def evaluation_keys(recipe) -> list[str]:
        return ["eval_loss"] + [f"eval_{key}" for key, wanted in EVAL_KEYS.items() if wanted(recipe.rl)]

    def before_training(self, engine, datasets: list, setup, data_cache, weights: str) -> list:
        """rl.beta > 0 without LoRA: the reference, a frozen copy of the starting weights; rl.teacher: the teacher
        (both frozen.py)."""
        if self.cfg.beta != 0.0 and not self.adapters_off:
            from dataclasses import replace

            from . import frozen
            recipe = self.setup.recipe
            source = recipe.model if self.setup.init_from is None else replace(  # --init_from's weights
                recipe.model, name_or_path=str(self.setup.run_dir / "init_weights"), from_scratch="false")
            self.reference, self._reference_hf_config = frozen.build(source, recipe.train, self.setup.ds_cfg,
                                                                     self.tokenizer)
        if self.cfg.teacher:
            from . import frozen
            self.teacher, self._teacher_hf_config = frozen.build(self._teacher_config(self.setup),
                                                                 self.setup.recipe.train, self.setup.ds_cfg,
                                                                 self.tokenizer)
        return datasets
