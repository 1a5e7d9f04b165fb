"""Tool calling end to end (issue 84): the tiny agent recipe (docs/data.md's tool-calling example) trains on 2 ranks
and exports; the export carries the template, and `apply_chat_template(messages, tools=..., add_generation_prompt=
True)` on it renders exactly the prompt each trained reply followed in the run's sequences; DPO pairs and GRPO prompts
holding tool calls, tool replies and schemas train through the same rendering."""
from __future__ import annotations

import json
import math

import datasets
from transformers import AutoTokenizer

from dstrain.chat_templates import normalize
from tests.helpers import ROOT, launch, metrics

QUICK = ["--log.wandb=false", "--log.progress_bar=false", "--log.plot=false", "--eval.every=0",
         "--checkpoint.every=0", "--data.chat_template=chatml", "--data.val_fraction=0"]
ROWS = [json.loads(line) for line in (ROOT / "data/examples/chat_tools.jsonl").read_text().splitlines()]


def test_tool_calls_train_on_two_ranks_and_the_export_renders_the_trained_prompts(tmp_path, cache):
    run = tmp_path / "run"
    proc = launch(["--recipe", "tiny/agent_sft", "--train.max_steps=3", "--train.micro_batch_size=2", "--output_dir",
                   str(run), *QUICK], cache)  # the tiny agent recipe: docs/data.md's tool-calling example
    losses, _ = metrics(run)
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("data: "))
    assert " tokens trained (" in line and "not read" not in line, line
    exported = AutoTokenizer.from_pretrained(run / "hf")
    cached = datasets.load_from_disk(json.loads((run / "run_info.json").read_text())["data_cache"])["train"]
    by_text = {exported.apply_chat_template(normalize(r["messages"], {}), tools=r["tools"], tokenize=False): r
               for r in ROWS}
    checked = 0
    for example in cached.select(range(12)):
        ids, labels = example["input_ids"], example["labels"]
        n = sum(example["attention_mask"])
        row = by_text[exported.decode(ids[:n])]  # each sequence is a row rendered whole by the exported template
        starts = [i for i in range(n) if labels[i] != -100 and (i == 0 or labels[i - 1] == -100)]
        turns = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        assert len(starts) == len(turns)
        for start, turn in zip(starts, turns):  # what the model saw before each reply is the inference prompt
            prompt = exported.apply_chat_template(normalize(row["messages"][:turn], {}), tools=row["tools"],
                                                  tokenize=False, add_generation_prompt=True)
            assert exported.decode(ids[:start]) == prompt
            checked += 1
    assert checked >= 12


def _tool_history(row: dict) -> list[dict]:
    return row["messages"][:-1]  # the question, the call and the tool's reply


def test_dpo_pairs_and_grpo_prompts_with_tools_train(tmp_path, cache, tiny_llama):
    tooled = [r for r in ROWS if r["tools"]][:24]
    pairs = [{"prompt": _tool_history(r), "chosen": [r["messages"][-1]],
              "rejected": [{"role": "assistant", "content": "I do not know."}], "tools": r["tools"]} for r in tooled]
    prompts = [{"prompt": _tool_history(r), "tools": r["tools"], "answer": r["messages"][-2]["content"]}
               for r in tooled]
    for name, rows in (("pairs", pairs), ("prompts", prompts)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"--model.name_or_path={tiny_llama}", "--train.max_steps=2", "--train.micro_batch_size=2",
              "--train.seq_len=384", *QUICK]
    dpo = tmp_path / "dpo"
    launch(["--recipe", "tiny/dpo", f"--data.path={tmp_path / 'pairs.jsonl'}", "--output_dir", str(dpo), *common],
           cache, launcher="warm-python")
    grpo = tmp_path / "grpo"
    launch(["--recipe", "tiny/grpo", f"--data.path={tmp_path / 'prompts.jsonl'}", "--rl.reward_funcs=exact_answer",
            "--rl.num_generations=2", "--rl.max_completion_length=4", "--output_dir", str(grpo), *common], cache,
           launcher="warm-python")
    for run in (dpo, grpo):
        losses, _ = metrics(run)
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), run
