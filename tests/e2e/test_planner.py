"""train.py --plan on 2 real CPU ranks: measurements, ranked predictions, trials run as train.py jobs, a best.json that
train.py accepts; the predicted bytes per step against the byte counter of the trial runs (an independent count at
the torch.distributed calls); --simulate and bad input."""
from __future__ import annotations

import json
import statistics

import pytest

from tests.helpers import launch

# the plan's tests measure compute and links and check the prediction's scale: run alone (`serial`); --simulate
# and the refusals measure nothing: the parallel part, on warm processes (one interpreter, as `python train.py`)
serial = pytest.mark.serial

COMMON = ["--recipe", "recipes/tiny/pretrain.yaml", "--train.precision=fp32", "--log.wandb=false"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    cache = tmp_path_factory.mktemp("cache")
    proc = launch([*COMMON, "--output_dir", str(out), "--plan", "--trial", "2", "--plan_max_mb", "4"], cache,
                  timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "plan", proc.stderr


@serial
def test_plan_measures_links_and_compute(planned):
    plan_dir, said = planned
    meas = json.loads((plan_dir / "plan.json").read_text())["measurements"]
    assert meas["world_size"] == 2 and set(meas["links"]) == {"node", "world"}
    for ops in meas["links"].values():
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            sizes = [b for b, t in ops[op]["points"] if t > 0]
            assert sizes == [1 << 20, 4 << 20], ops[op]  # 1 MB and 4 MB (--plan_max_mb 4), each timed
    compute = meas["compute"]
    assert all(t > 0 for t in compute["layer"].values()) and compute["adam_elements_per_s"] > 0
    assert set(compute["compression"]) == {"powersgd", "sign", "topk", "sign_per_rank"}
    assert set(compute["engine_overhead"]) == {"1", "2", "3"}  # per ZeRO stage the candidates use
    assert "collectives (nccl-tests convention" in said and "plan: best" in said


@serial
def test_trials_are_real_runs_and_bytes_match_the_model(planned):
    plan_dir, said = planned
    plan = json.loads((plan_dir / "plan.json").read_text())
    trials = json.loads((plan_dir / "trials.json").read_text())
    assert len(trials) == 2 and all(t["measured_step_s"] for t in trials), trials
    for i, t in enumerate(trials, 1):
        pred = next(p for p in plan["predictions"] if (p["name"], p["micro_batch_size"],
                                                       p["activation_checkpointing"]) ==
                    (t["name"], t["micro_batch_size"], t["activation_checkpointing"]))
        rows = [json.loads(line) for line in (plan_dir / f"trial-{i}" / "run" / "metrics.jsonl").read_text()
                .splitlines() if '"step_s"' in line]
        counted = statistics.median(r["comm_bytes"] for r in rows if r["step"] > 2)
        # ZeRO-0/1/2 and compression: the model's collectives are DeepSpeed's, byte for byte; ZeRO-3 gathers some
        # small parameters more than once (within a few per cent)
        assert pred["comm_bytes"] == pytest.approx(counted, rel=0.06 if "zero3" in t["name"] else 1e-4), t["name"]
        assert all(0 <= r["comm_fraction"] <= 1 and r["comm_s"] >= 0 for r in rows)
        # the CPU step-time prediction is checked to 25% by bench/planner.py; here only that it is the right scale
        assert 0.4 < pred["step_s"] / t["measured_step_s"] < 2.5, (pred["step_s"], t)
    # issue 29: predicted and measured order were never compared; where the model is sure (1.5x apart), they agree
    predicted = {(p["name"], p["micro_batch_size"], p["activation_checkpointing"]): p["step_s"]
                 for p in plan["predictions"]}
    first, second = (predicted[(t["name"], t["micro_batch_size"], t["activation_checkpointing"])] for t in trials)
    if max(first, second) > 1.5 * min(first, second):
        assert (first < second) == (trials[0]["measured_step_s"] < trials[1]["measured_step_s"]), (first, second,
                                                                                                   trials)
    fastest = min(trials, key=lambda t: t["measured_step_s"])
    best = plan["best"]
    assert (best["name"], best["micro_batch_size"]) == (fastest["name"], fastest["micro_batch_size"])
    assert not (plan_dir / "trial-1" / "run" / "checkpoints").exists()  # trials keep no checkpoints


@serial
def test_best_json_is_accepted_by_train_py(planned):
    plan_dir, _ = planned
    command = (plan_dir / "best.txt").read_text().split()
    # issue 54 item 5: the command dropped --num_gpus (one rank on a CPU machine) and the plan's own overrides
    assert command[:4] == ["deepspeed", "--num_gpus", "2", "train.py"] and str(plan_dir / "best.json") in command
    assert "--train.precision=fp32" in command and command[command.index("--output_dir") + 1] == str(plan_dir.parent)
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.parallel import ds_config as dsc
    overrides = [a for a in command if a.startswith("--train.")]
    recipe = load_recipe("tiny/pretrain.yaml", parse_overrides(["--train.precision=fp32", *overrides]))
    resolved = dsc.resolve(dsc.load(plan_dir / "best.json"), recipe, 2, dsc.DeviceCaps("cpu"), 128)
    assert resolved["train_batch_size"] == 16  # the recipe's global batch, kept


def test_simulate_and_bad_input(tmp_path):
    def run(*args):
        return launch([*COMMON, "--plan", *args], tmp_path, launcher="warm-python", check=False, timeout=120)
    sim = run("--simulate", "--device", "a100-80gb", "--interconnect", "ib-hdr", "--max_gpus", "16")
    assert sim.returncode == 0, sim.stderr[-2000:]
    lines = [line.split() for line in sim.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(line[0]) for line in lines] == [1, 2, 4, 8, 16]
    bad = run("--simulate", "--device", "a100", "--interconnect", "ib-hdr")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("error: --simulate needs --device")
    zero = run("--trial", "0")
    assert zero.returncode != 0 and "--trial 0" in zero.stderr
