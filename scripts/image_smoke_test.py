"""Check a finished run of the default recipe (the Docker image's test stage runs it):
every step ran, the evaluation loss fell by half or more, and the exported model loads.

    python scripts/image_smoke_test.py RUN_DIR
"""
import json
import sys
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM


def main(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    max_steps = yaml.safe_load((run_dir / "recipe.yaml").read_text())["train"]["max_steps"]
    steps = [r["step"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert steps and steps[-1] == max_steps, f"the run stopped at step {steps[-1:]} of {max_steps}"
    assert len(evals) >= 2 and evals[-1] < 0.5 * evals[0], f"evaluation loss did not fall: {evals}"
    AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    print(f"image smoke test: {max_steps} steps, eval loss {evals[0]:.2f} -> {evals[-1]:.2f}, export loads")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
