"""What a person sees: a progress bar, metrics.jsonl, wandb and a loss curve, all from rank 0 only."""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
import uuid
from pathlib import Path

import psutil

from . import env
from .config import LogConfig
from .parallel.dist import DistContext

COMM_WARN = 0.3  # share of the step spent waiting in collectives that is worth a remedy
COMM_WINDOW = 10  # steps it must hold for (median), after the first


_OPEN_BARS: list = []  # this process's progress bars while they are up (one, rank 0's)


def end_bar_line() -> None:
    """End the progress bar's line, so what is printed next (an error line) starts on a line of its own: tqdm leaves
    the cursor after the bar, and a line printed then is glued to it. The bar is not drawn again."""
    while _OPEN_BARS:
        bar = _OPEN_BARS.pop()
        bar.disable = True  # no redraw from a later update, close or the interpreter's exit
        print(file=sys.stderr, flush=True)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Metrics:
    def __init__(self, run_dir: Path, cfg: LogConfig, ctx: DistContext, start_step: int, total_steps: int,
                 resolved_config: dict, flops_per_token: float = 0.0, peak_flops: float = 0.0,
                 on_peak_too_low=None):
        self.enabled = ctx.is_main
        self.run_dir, self.cfg = run_dir, cfg
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops  # peak: all ranks together
        self.on_peak_too_low = on_peak_too_low  # called with the FLOP/s (all ranks) a step reached above the peak
        self.rates: list[float] = []
        self.resolved_config = resolved_config
        self.comm_fractions: list[float] = []
        self.comm_warned = False
        self.path = run_dir / "metrics.jsonl"
        self.bar = self.wandb = self.tensorboard = None
        self.started = psutil.Process().create_time()  # wall time counts from the launch of this rank
        self.start_step = start_step
        if not self.enabled:
            return
        # A resumed run continues the log from its checkpoint: rows past it came from the lost attempt.
        kept = [row for row in read_metrics(self.path) if row["step"] <= start_step]
        self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.file = open(self.path, "a", buffering=1)
        if cfg.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0)
            _OPEN_BARS.append(self.bar)
        if cfg.wandb:
            self._sink("wandb", self._init_wandb, resolved_config)
        if cfg.tensorboard:
            self._sink("tensorboard", self._init_tensorboard)

    def _init_wandb(self, resolved_config: dict) -> None:
        import wandb

        id_file = self.run_dir / "wandb_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])
        mode = "online" if env.wandb_online() else "offline"
        self.wandb = wandb.init(project=self.cfg.wandb_project, name=self.cfg.run_name or self.run_dir.name,
                                id=id_file.read_text().strip(), resume="allow", group=self.cfg.wandb_group,
                                dir=str(self.run_dir), config=resolved_config, mode=mode,
                                settings=wandb.Settings(quiet=True))

    def _init_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=self.start_step + 1)

    def _tensorboard_row(self, row: dict) -> None:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tensorboard.add_scalar(key if key.startswith(("eval_", "perplexity")) else f"train/{key}",
                                            value, row["step"])

    def _sink(self, name: str, call, *args) -> None:
        """Call a metrics sink (wandb, TensorBoard); one that fails is dropped with a warning, never taking the
        run or its next checkpoint with it. Seen: Ctrl-C makes DeepSpeed's launch.py terminate each rank's
        process tree, wandb's service process included, and the next wandb.log raised ConnectionResetError."""
        try:
            call(*args)
        except Exception as error:  # noqa: BLE001 - any failure of a logger is the logger's, not the run's
            setattr(self, name, None)
            self.message(f"warning: {name} failed ({type(error).__name__}: {str(error)[:200]}); it is off for the "
                         f"rest of this run, metrics.jsonl has every row")

    def _write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self._sink("wandb", self.wandb.log, {k: v for k, v in row.items() if k != "step"}, row["step"])
        if self.tensorboard is not None:
            self._sink("tensorboard", self._tensorboard_row, row)

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int, label_tokens: int,
             seconds: float, comm: dict | None = None, extra: dict | None = None) -> None:
        """tokens: the global batch's input tokens that are not padding (throughput and MFU count those);
        label_tokens: the tokens the loss is taken over; comm: {comm_s, comm_bytes} of rank 0 in this step
        (comm_counter.CommCounter); extra: the objective's own figures (preference training's rewards/...)."""
        if not self.enabled:
            return
        tokens_per_s = tokens / seconds if seconds > 0 else float("nan")
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None
        if mfu is not None and mfu > 1.0:  # impossible: the peak was measured low; never print it
            self._peak_too_low(tokens_per_s * self.flops_per_token)
            mfu = None
        self.rates.append(tokens_per_s)
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
               "label_tokens": label_tokens, "tokens_per_s": tokens_per_s, "step_s": seconds, "mfu": mfu,
               "time": time.time()} | (extra or {})
        if row.get("rollout_s") is not None:  # learning from rewards: the share of the step spent sampling
            row["rollout_share"] = row["rollout_s"] / seconds if seconds > 0 else None
        if comm is not None:
            row["comm_s"] = comm["comm_s"]
            row["comm_fraction"] = comm["comm_s"] / seconds if seconds > 0 else None
            if self.cfg.comm_bytes:
                row["comm_bytes"] = comm["comm_bytes"]
                if comm.get("comm_bytes_all_to_all"):  # expert parallelism's and Ulysses' share of them
                    row["comm_bytes_all_to_all"] = comm["comm_bytes_all_to_all"]
            self._watch_comm(row["comm_fraction"])
        self._write(row)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss={loss:.4f} lr={lr:.2e} tok/s={tokens_per_s:,.0f}"
                                     + (f" acc={extra['rewards/accuracies']:.0%}" if extra and
                                        "rewards/accuracies" in extra else "")
                                     + (f" reward={row['reward']:.3f}" if row.get("reward") is not None else "")
                                     + (f" kl={row['distill_loss']:.4f}" if row.get("distill_loss") is not None
                                        else "")
                                     + (f" rollout={row['rollout_share']:.0%}" if row.get("rollout_share") is not None
                                        else "")
                                     + (f" route_cv={row['expert_load_cv']:.2f}" if row.get("expert_load_cv")
                                        is not None else "")
                                     + (f" mfu={mfu:.1%}" if mfu is not None else "")
                                     + (f" comm={row['comm_fraction']:.0%}" if row.get("comm_fraction") is not None
                                        else "")
                                     + (f" skipped={row['skipped_steps']}" if row.get("skipped_steps") else "")
                                     + (f" spikes={row['spikes']}" if row.get("spikes") else ""), refresh=False)
            self.bar.update(1)

    def _peak_too_low(self, achieved: float) -> None:
        """A step beat the peak: from here on no MFU (in the log, the bar or the summary), and the cached peak
        is raised to what was achieved so the next run on this machine starts from a truer figure."""
        if self.on_peak_too_low is not None:
            self.on_peak_too_low(achieved)
        self.message(f"warning: a step reached {achieved / 1e12:.3g} TFLOP/s, above the measured peak of "
                     f"{self.peak_flops / 1e12:.3g} TFLOP/s (all ranks; measured on a busy machine?); MFU is not "
                     f"shown for this run, and the next run on this machine uses the higher figure")
        self.peak_flops = 0.0

    def _watch_comm(self, fraction: float | None) -> None:
        """Say once when communication keeps taking more than COMM_WARN of the steps, with the cheapest remedy."""
        if fraction is None or self.comm_warned:
            return
        self.comm_fractions.append(fraction)
        recent = self.comm_fractions[1:][-COMM_WINDOW:]  # the first step carries warm-up costs
        if len(recent) == COMM_WINDOW and statistics.median(recent) > COMM_WARN:
            from .planner.cost import remedy
            self.comm_warned = True
            self.message(f"communication takes {statistics.median(recent):.0%} of each step (median of the last "
                         f"{COMM_WINDOW}: time waited in collectives, metrics.jsonl comm_fraction); "
                         f"{remedy(self.resolved_config.get('ds') or {}, self.resolved_config.get('recipe') or {})}")

    def evaluation(self, step: int, eval_loss: float, extra: dict | None = None) -> None:
        """extra: the objective's own figures, logged with the `eval_` prefix; an objective with figures of its own
        (preference training) has no perplexity."""
        if not self.enabled:
            return
        if extra:
            row = {"step": step, "eval_loss": eval_loss} | {f"eval_{k}": v for k, v in extra.items()}
            self._write(row)
            shown = " ".join(f"{k}={v:.4f}" for k, v in row.items() if k in ("eval_rewards/accuracies",
                                                                              "eval_rewards/margins"))
            self.message(f"step {step}: eval_loss={eval_loss:.4f} {shown}".rstrip())
            return
        perplexity = math.exp(eval_loss) if eval_loss < 50 else float("inf")
        self._write({"step": step, "eval_loss": eval_loss, "perplexity": perplexity})
        self.message(f"step {step}: eval_loss={eval_loss:.4f} perplexity={perplexity:.2f}")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, outcome: dict | None = None) -> None:
        """Flush the sinks; with `outcome` (what train.py knows of the end: why it stopped, the checkpoint, the
        export), end on a short summary, also written as summary.json."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            if self.bar in _OPEN_BARS:
                _OPEN_BARS.remove(self.bar)
        self.file.close()
        if self.cfg.plot:
            recipe = self.resolved_config.get("recipe") or {}
            loss = (recipe.get("preference") or {}).get("loss") if (recipe.get("data") or {}).get("format") == \
                "preference" else None
            plot_losses(self.path, self.run_dir / "loss.png", loss_label(loss))
        if self.wandb is not None:
            self._sink("wandb", self.wandb.finish)
        if self.tensorboard is not None:
            self._sink("tensorboard", self.tensorboard.close)
        if outcome is not None:
            summary = self.summary(outcome)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.message(format_summary(summary))

    def summary(self, outcome: dict) -> dict:
        """The run in a few figures: steps, losses, tokens, time, throughput, where its outputs are."""
        rows = read_metrics(self.path)
        train = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "eval_loss" in r]
        this_session = [r for r in train if r["step"] > self.start_step]
        rates = [r["tokens_per_s"] for r in this_session[1:]]  # the first step of a session carries warm-up
        median = statistics.median(rates) if rates else None
        mfu = median * self.flops_per_token / self.peak_flops if median and self.peak_flops else None
        rollouts = {}
        sampled = [r for r in this_session[1:] if r.get("rollout_tokens_per_s") is not None]
        if sampled:  # learning from rewards: how fast the rollouts went, and their share of the step time
            rollouts = {"median_rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in sampled),
                        "rollout_share": statistics.median(r["rollout_share"] for r in sampled)}
        return {"steps": train[-1]["step"] if train else self.start_step, "started_at_step": self.start_step,
                "headline": headline(train, evals),
                "final_loss": train[-1]["loss"] if train else None,
                "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
                "eval_step": evals[-1]["step"] if evals else None,
                "tokens": sum(r["tokens"] for r in train),
                "tokens_this_session": sum(r["tokens"] for r in this_session),
                "wall_s": round(time.time() - self.started, 1), "median_tokens_per_s": median, "mfu": mfu,
                "run_dir": str(self.run_dir), "metrics": str(self.path), **rollouts, **outcome}


# What each objective is judged by, as the progress bar shows it: its key in metrics.jsonl and the name a person reads.
# Learning from rewards logs `reward`, distillation `distill_loss` (the KL/JSD to the teacher), preference training
# `rewards/accuracies`; next-token training has only its loss.
HEADLINES = (("reward", "reward", ".3f"), ("distill_loss", "distillation KL", ".4f"),
             ("rewards/accuracies", "reward accuracy", ".0%"))


def headline(train: list[dict], evals: list[dict]) -> dict | None:
    """The objective's own figure over the run: its first and last step's values and the last evaluation's."""
    for key, name, spec in HEADLINES:
        rows = [r for r in train if r.get(key) is not None]
        if rows:
            done = [r for r in evals if r.get(f"eval_{key}") is not None]
            return {"key": key, "name": name, "format": spec, "first": rows[0][key], "first_step": rows[0]["step"],
                    "last": rows[-1][key], "last_step": rows[-1]["step"],
                    "eval": done[-1][f"eval_{key}"] if done else None, "eval_step": done[-1]["step"] if done else None}
    return None


def format_summary(summary: dict) -> str:
    """The last screen of a run: a few lines a person reads, from summary.json's fields."""
    def num(value, spec):
        return format(value, spec) if value is not None else "-"

    lines = [f"run {summary['status']}: step {summary['steps']}"
             + (f" of {summary['max_steps']}" if summary.get("max_steps") else "")]
    top = summary.get("headline")
    if top:  # the objective's own figure first (issue 69: a GRPO run's summary showed `loss 0.0000` and no reward)
        spec = top["format"]
        lines.append(f"  {top['name']} {top['first']:{spec}} (step {top['first_step']}) -> {top['last']:{spec}} "
                     f"(step {top['last_step']})" + (f", eval {top['eval']:{spec}} (step {top['eval_step']})"
                                                     if top.get("eval") is not None else ""))
    lines += [f"  loss {num(summary['final_loss'], '.4f')}  eval loss {num(summary['final_eval_loss'], '.4f')}"
             + (f" (step {summary['eval_step']})" if summary.get("eval_step") is not None else ""),
             f"  {summary['tokens_this_session']:,} tokens in {summary['wall_s']:,.0f} s, median "
             f"{num(summary['median_tokens_per_s'], ',.0f')} tokens/s"
             + (f", MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else "")]
    if summary.get("median_rollout_tokens_per_s") is not None:
        lines.append(f"  rollouts    median {summary['median_rollout_tokens_per_s']:,.0f} completion tokens/s, "
                     f"{summary['rollout_share']:.0%} of the step time")
    if summary.get("epochs") is not None:
        lines.append(f"  data        {summary['epochs']:,.2f} epochs of {summary['train_sequences']:,} training "
                     f"sequences")
    checks = summary.get("health") or {}
    if checks.get("skipped_steps") or checks.get("spikes"):  # run/health.py: what went wrong without a sound
        told = [f"{n} {why}" for why, n in (checks.get("skipped_steps") or {}).items()]
        spikes = [f"{n} {what}" for what, n in (checks.get("spikes") or {}).items()]
        lines.append("  health      " + "; ".join(
            ([f"steps skipped: {', '.join(told)}"] if told else []) + ([f"spikes: {', '.join(spikes)}"] if spikes
                                                                       else [])
            + ([f"first non-finite module: {checks['first_nonfinite_module']}"]
               if checks.get("first_nonfinite_module") else [])))
    if summary.get("checkpoint"):
        lines.append(f"  checkpoint  {summary['checkpoint']}")
    if summary.get("export"):
        lines.append(f"  model       {summary['export']}  (Hugging Face format)")
    if summary.get("next"):
        lines.append(f"  next        {summary['next']}")
    lines.append(f"  summary     {Path(summary['run_dir']) / 'summary.json'}")
    return "\n".join(lines)


def loss_label(preference_loss: str | None) -> str:
    """The loss axis: next-token cross-entropy is nats per token; a preference loss is a mean over pairs."""
    if preference_loss is None:
        return "loss (nats/token)"
    return f"{preference_loss.upper()} loss (mean over pairs)"


def plot_losses(metrics_path: Path, out: Path, ylabel: str = "loss (nats/token)") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
