"""Issue 54: the data page's commands, one per layout a user brings (docs/data.md "Bring your own data"), run as
written on 2 CPU ranks with a few quick settings added; layouts that hold the same data must give the same losses
step for step (UltraFeedback's against TRL's conversational layout, ShareGPT's against OpenAI messages, .txt against
jsonl); and the data mistakes of a first day through the real launcher: a malformed row, too little data, nothing
to evaluate."""
from __future__ import annotations

import json
import re

import pytest

from tests.helpers import ROOT, doc_commands, launch, metrics, train_argv

QUICK = ["--train.max_steps=3", "--train.warmup_steps=1", "--train.micro_batch_size=2", "--train.seq_len=48",
         "--eval.max_batches=1", "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false",
         "--checkpoint.every=0", "--checkpoint.export_hf=false"]
COMMANDS = {re.search(r"data/examples/(\S+)", c).group(1): train_argv(c)
            for _, c in doc_commands([ROOT / "docs/data.md"]) if "data/examples/" in c and "train.py" in c}
SAME_DATA = [("preference_ultrafeedback.jsonl", "preference_conversational.jsonl"), ("sharegpt.jsonl", "chat.jsonl"),
             ("text.txt", "text.jsonl"), ("prompt_completion.jsonl", "prompt_response.jsonl"),
             ("prompt_completion_conversational.jsonl", "prompt_response.jsonl")]


def test_the_page_has_a_command_for_every_sample_file():
    assert sorted(COMMANDS) == sorted(p.name for p in (ROOT / "data/examples").iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache, tiny_llama):
    """Every command of the page, once: {file: (run dir, stderr)}. The DPO recipe's reference is `make train`'s
    export; here a fixed random model stands in for it. One rank each (`python train.py`, the README's third
    launcher): what these check is how each layout is read, which no second rank changes, and 13 launches of one
    process cost half the CPU of two-rank ones (the launchers themselves: test_vs_reference's test_other_launchers,
    the data mistakes below)."""
    out = {}
    for name, argv in COMMANDS.items():
        run = tmp_path_factory.mktemp("layouts") / name.split(".")[0]
        extra = [f"--model.name_or_path={tiny_llama}"] if "tiny/dpo" in argv or "tiny/grpo" in argv else []
        quick = [q for q in QUICK if not (q.startswith("--train.seq_len") and "--train.seq_len" in " ".join(argv))]
        proc = launch([*argv, *quick, *extra, "--output_dir", str(run)], cache, launcher="warm-python")
        out[name] = (run, proc.stderr)
    return out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_layout_trains_and_says_what_it_read(runs, name):
    run, said = runs[name]
    losses, _ = metrics(run)
    # learning from rewards: the loss is about 0 on-policy (ratio 1, advantages centred per group), of either sign
    assert len(losses) == 3 and all((abs(loss) < 20) if name == "prompt.jsonl" else (0 < loss < 20)
                                    for loss in losses), said[-3000:]
    line = next(line for line in said.splitlines() if line.startswith("data: "))
    unused = {"preference_ultrafeedback.jsonl": "columns prompt_id, score_chosen, score_rejected not read"}
    assert (unused[name] in line) if name in unused else ("not read" not in line), line
    info = json.loads((run / "run_info.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    epochs = 3 * 2 * 1 / info["train_sequences"]  # steps x micro batch x ranks over the training split
    assert summary["epochs"] == pytest.approx(epochs, abs=1e-3)
    assert f"3 steps x 2 sequences = {epochs:.2f} epochs of {info['train_sequences']}" in line
    assert f"{epochs:.2f} epochs of {info['train_sequences']} training sequences" in said


@pytest.mark.parametrize("layout,same", SAME_DATA)
def test_two_layouts_of_the_same_data_train_alike(runs, layout, same):
    """UltraFeedback's text prompt beside whole conversations is read as TRL's maybe_extract_prompt reads it: the
    prompt is the user turn, exactly the conversational layout's pairs (it crashed before, exit 1)."""
    assert metrics(runs[layout][0])[0] == pytest.approx(metrics(runs[same][0])[0], rel=1e-6)


def _one_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_data_mistakes_through_the_launcher(tmp_path, cache, tiny_llama):
    """A malformed pair was a 40-line traceback and exit 1 (which launch/ retries 3 times); a global batch larger
    than the data repeated samples silently; a validation split that packs to nothing ended with `eval loss -`."""
    rows = [json.loads(line) for line in (ROOT / "data/examples/preference.jsonl").read_text().splitlines()]
    rows[6]["chosen"] = [{"role": "assistant", "content": rows[6]["chosen"]}]
    bad = tmp_path / "pairs.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _one_error(launch([*COMMANDS["preference.jsonl"], *QUICK, f"--data.path={bad}",
                              f"--model.name_or_path={tiny_llama}", "--output_dir", str(tmp_path / "a")],
                             cache, launcher="deepspeed", check=False))
    assert f"dataset file {bad} line 7: 'chosen' is a list of messages and 'rejected' a str" in line
    line = _one_error(launch([*COMMANDS["prompt_response.jsonl"], *QUICK, "--train.micro_batch_size=32",
                              "--output_dir", str(tmp_path / "b")], cache, launcher="deepspeed", check=False))
    assert "the global batch of 64 sequences (train.micro_batch_size 32 x grad_accum_steps 1 x 2 data-parallel " \
           "ranks) is larger than the training split's 60" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    proc = launch([*COMMANDS["text.jsonl"], *QUICK, "--train.seq_len=256", "--output_dir", str(tmp_path / "c")],
                  cache)
    assert "note: the validation split's 4 rows give no sequences of 256 tokens, so nothing is evaluated" \
           in proc.stderr, proc.stderr[-3000:]
