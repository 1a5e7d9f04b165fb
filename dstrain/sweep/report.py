"""What a person reads after a sweep: a table of trials, the best one with the command that reproduces it, a plot.

Written to the sweep's output directory (trials.tsv, best.json, sweep.png) each time a worker ends, and printed; also
`python -m dstrain.sweep SWEEP.yaml --report` at any time, from the study's database.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import optuna
from optuna.trial import TrialState

from .spec import Range, Sweep


def _last_step(trial) -> int | None:
    run_dir = trial.user_attrs.get("run_dir")
    if not run_dir or not (Path(run_dir) / "metrics.jsonl").exists():
        return trial.last_step
    steps = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return max(steps, default=None)


def rows(study: optuna.Study) -> list[dict]:
    """One row per trial asked so far: its parameters, metric (the final value, or the last reported one of a
    pruned or running trial), the steps it trained, its state and run directory."""
    out = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.WAITING:
            continue  # a grid point not started yet
        value = trial.value if trial.state == TrialState.COMPLETE else (
            trial.intermediate_values[trial.last_step] if trial.intermediate_values else None)
        out.append({"trial": trial.number, "state": trial.state.name.lower(), "value": value,
                    "steps": _last_step(trial), "params": dict(trial.params),
                    "pruned_at": trial.user_attrs.get("pruned_at"), "run_dir": trial.user_attrs.get("run_dir"),
                    "command": trial.user_attrs.get("command"), "failure": trial.user_attrs.get("failure"),
                    "curve": {str(k): v for k, v in sorted(trial.intermediate_values.items())}})
    return out


def best(study: optuna.Study) -> dict | None:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if not done:
        return None
    trial = study.best_trial
    return {"trial": trial.number, "value": trial.value, "params": trial.params,
            "run_dir": trial.user_attrs.get("run_dir"), "command": trial.user_attrs.get("command")}


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def table(sweep: Sweep, found: list[dict]) -> str:
    keys = list(sweep.space)
    header = ["trial", *keys, sweep.metric, "steps", "state", "run_dir"]
    lines = [[str(r["trial"]), *(_show(r["params"].get(k)) for k in keys), _show(r["value"]), _show(r["steps"]),
              r["state"] + (f" at {r['pruned_at']}" if r["pruned_at"] else ""), r["run_dir"] or "-"] for r in found]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in [header, *lines])


def plot(sweep: Sweep, found: list[dict], out: Path, top: int = 3) -> None:
    """The metric against each parameter (finished trials as dots, pruned ones as crosses at their last value), and
    the metric's curve over steps for every trial, the best `top` drawn bold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(sweep.space)
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(4.2 * (len(keys) + 1), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for state, marker in (("complete", "o"), ("pruned", "x"), ("running", ".")):
            points = [(r["params"][key], r["value"]) for r in found
                      if r["state"] == state and r["value"] is not None and key in r["params"]]
            if points:
                ax.scatter(*zip(*points), marker=marker, label=state)
        space = sweep.space[key]
        if isinstance(space, Range) and space.log:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(sweep.metric)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ranked = sorted((r for r in found if r["state"] == "complete"), key=lambda r: r["value"],
                    reverse=sweep.direction == "maximize")
    bold = {r["trial"] for r in ranked[:top]}
    ax = axes[0][-1]
    for r in found:
        if r["curve"]:
            steps, values = zip(*((int(k), v) for k, v in r["curve"].items()))
            ax.plot(steps, values, "o-" if r["trial"] in bold else "-", linewidth=2 if r["trial"] in bold else 0.8,
                    alpha=1.0 if r["trial"] in bold else 0.4, label=f"trial {r['trial']}" if r["trial"] in bold
                    else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(sweep.metric)
    ax.set_title(f"best {len(bold)} bold", fontsize=9)
    ax.grid(alpha=0.3)
    if bold:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write(sweep: Sweep, study: optuna.Study) -> str:
    """trials.tsv, best.json and sweep.png in the output directory; returns the text to print."""
    root = sweep.run_root
    found = rows(study)
    keys = list(sweep.space)
    with open(root / "trials.tsv", "w") as f:
        f.write("\t".join(["trial", *keys, sweep.metric, "steps", "state", "pruned_at", "run_dir", "command"]) + "\n")
        for r in found:
            f.write("\t".join(map(str, [r["trial"], *(r["params"].get(k) for k in keys), r["value"], r["steps"],
                                        r["state"], r["pruned_at"], r["run_dir"], r["command"]])) + "\n")
    top = best(study)
    (root / "best.json").write_text(json.dumps({"best": top, "trials": found}, indent=2) + "\n")
    plot(sweep, found, root / "sweep.png")
    counts = {state: sum(r["state"] == state for r in found) for state in ("complete", "pruned", "fail", "running")}
    text = [table(sweep, found), "",
            f"{len(found)} of {sweep.trials} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    if top is not None:
        text += [f"best: trial {top['trial']}, {sweep.metric}={top['value']:.6g} "
                 f"({' '.join(f'{k}={_show(v)}' for k, v in top['params'].items())}); run it again with:",
                 f"  {top['command'].replace(str(top['run_dir']), str(root / 'best'))}" if top["command"] else ""]
    text.append(f"table {root / 'trials.tsv'}, plot {root / 'sweep.png'}, everything {root / 'best.json'}")
    return "\n".join(text)
