"""What a person sees: a progress bar, metrics.jsonl, wandb and a loss curve, all from rank 0 only."""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
import uuid
from pathlib import Path

from . import env
from .config import LogConfig
from .dist import DistContext

COMM_WARN = 0.3  # share of the step spent waiting in collectives that is worth a remedy
COMM_WINDOW = 10  # steps it must hold for (median), after the first


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Metrics:
    def __init__(self, run_dir: Path, cfg: LogConfig, ctx: DistContext, start_step: int, total_steps: int,
                 resolved_config: dict, flops_per_token: float = 0.0, peak_flops: float = 0.0):
        self.enabled = ctx.is_main
        self.run_dir, self.cfg = run_dir, cfg
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops  # peak: all ranks together
        self.rates: list[float] = []
        self.resolved_config = resolved_config
        self.comm_fractions: list[float] = []
        self.comm_warned = False
        self.path = run_dir / "metrics.jsonl"
        self.bar = self.wandb = None
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
        if cfg.wandb:
            self._init_wandb(resolved_config)

    def _init_wandb(self, resolved_config: dict) -> None:
        import wandb

        id_file = self.run_dir / "wandb_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])
        mode = "online" if env.wandb_online() else "offline"
        self.wandb = wandb.init(project=self.cfg.wandb_project, name=self.cfg.run_name or self.run_dir.name,
                                id=id_file.read_text().strip(), resume="allow", dir=str(self.run_dir),
                                config=resolved_config, mode=mode)

    def _write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int, label_tokens: int,
             seconds: float, comm: dict | None = None) -> None:
        """tokens: the global batch's input tokens that are not padding (throughput and MFU count those);
        label_tokens: the tokens the loss is taken over; comm: {comm_s, comm_bytes} of rank 0 in this step
        (compression.CommCounter)."""
        if not self.enabled:
            return
        tokens_per_s = tokens / seconds if seconds > 0 else float("nan")
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None
        self.rates.append(tokens_per_s)
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
               "label_tokens": label_tokens, "tokens_per_s": tokens_per_s, "step_s": seconds, "mfu": mfu,
               "time": time.time()}
        if comm is not None:
            row["comm_s"] = comm["comm_s"]
            row["comm_fraction"] = comm["comm_s"] / seconds if seconds > 0 else None
            if self.cfg.comm_bytes:
                row["comm_bytes"] = comm["comm_bytes"]
            self._watch_comm(row["comm_fraction"])
        self._write(row)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss={loss:.4f} lr={lr:.2e} tok/s={tokens_per_s:,.0f}"
                                     + (f" mfu={mfu:.1%}" if mfu is not None else "")
                                     + (f" comm={row['comm_fraction']:.0%}" if row.get("comm_fraction") is not None
                                        else ""), refresh=False)
            self.bar.update(1)

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

    def evaluation(self, step: int, eval_loss: float) -> None:
        if not self.enabled:
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

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if len(self.rates) > 1:  # the first step of a run carries warm-up costs
            median = statistics.median(self.rates[1:])
            mfu = f", MFU {median * self.flops_per_token / self.peak_flops:.1%}" if self.peak_flops else ""
            self.message(f"median {median:,.0f} tokens/s{mfu}")
        self.file.close()
        if self.cfg.plot:
            plot_losses(self.path, self.run_dir / "loss.png")
        if self.wandb is not None:
            self.wandb.finish()


def plot_losses(metrics_path: Path, out: Path) -> None:
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
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
