"""Issue 54: the data layouts a new user brings (UltraFeedback's pairs, Alpaca) and the first-day mistakes with
data (a malformed row, a column the format does not read, the wrong format, too little data), each as the user met
it. The layouts' tokens are checked against TRL's DPOTrainer and against the chat template rendered by hand."""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest

from dstrain import data
from dstrain.config import DataConfig, ModelConfig, load_recipe
from dstrain.data.formats import preference as fmt
from dstrain.errors import UserError
from dstrain.model import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "data/examples"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="recipes/tiny/model"))


def rows(name: str, n: int | None = None) -> list[dict]:
    lines = (EXAMPLES / name).read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


def write(path: Path, items: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return str(path)


def test_ultrafeedback_pairs_tokenize_as_trls_dpotrainer(tok):
    """A text prompt beside conversations that repeat the user turn (HuggingFaceH4/ultrafeedback_binarized)
    crashed with `dictionary update sequence element #0 has length 1` and exit 1. TRL reads it through its
    maybe_extract_prompt (the prompt taken from the conversations; its DPOTrainer alone fails on this layout too:
    `'list' object has no attribute 'endswith'`), then tokenizes: the same prompt and response ids here."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer
    from trl.data_utils import maybe_extract_prompt
    pairs = rows("preference_ultrafeedback.jsonl", 4)
    extracted = [maybe_extract_prompt({k: r[k] for k in ("prompt", "chosen", "rejected")}) for r in pairs]
    assert all(isinstance(r["prompt"], list) for r in extracted)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")).float()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=tok,
                             args=DPOConfig(output_dir="/tmp/dstrain-trl", report_to=[], use_cpu=True,
                                            max_length=None), train_dataset=Dataset.from_list(extracted))
    for row, theirs in zip(pairs, trainer.train_dataset):
        ours = fmt.pair_tokens(row, DataConfig(format="preference"), tok)
        assert ours == (theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])
        assert fmt.row_problem(row, DataConfig(format="preference")) is None


def test_a_text_prompt_beside_replies_alone_becomes_their_user_turn(tok):
    """Conversational replies without the user turn: the text prompt is the user turn (TRL would drop it)."""
    row = {"prompt": "What is 5 plus 6?", "chosen": [{"role": "assistant", "content": "11."}],
           "rejected": [{"role": "assistant", "content": "6."}]}
    prompt, chosen, _ = fmt.pair_tokens(row, DataConfig(format="preference"), tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
    assert tok.decode(prompt) == tok.decode(tok(rendered, add_special_tokens=False)["input_ids"])
    assert "11." in tok.decode(chosen)


@pytest.mark.parametrize("bad,expected", [
    ({"prompt": "Q?", "chosen": "A.", "rejected": [{"role": "assistant", "content": "B."}]},
     "line 3: 'chosen' is a str and 'rejected' a list of messages; both should be text, or both lists"),
    ({"prompt": "Q?", "chosen": "A.", "rejected": None}, "line 3: 'chosen' is a str and 'rejected' missing (null)"),
    ({"prompt": [{"role": "user", "content": "Q?"}], "chosen": "A.", "rejected": "B."},
     "line 3: 'prompt' is a list of messages but the responses are text"),
    ({"chosen": [{"role": "human", "text": "Q?"}], "rejected": [{"role": "user", "content": "B"}]},
     "line 3: a chat message has no 'content'"),
])
def test_a_malformed_pair_is_one_line_naming_the_file_and_row(tok, tmp_path, bad, expected):
    good = rows("preference.jsonl", 2)
    path = write(tmp_path / "pairs.jsonl", good + [bad] + good)
    with pytest.raises(UserError) as error:
        data.prepare(DataConfig(path=path, format="preference", cache_dir=str(tmp_path / "c")), tok, 48, 0)
    assert f"dataset file {path} {expected}" in str(error.value) and "\n" not in str(error.value)


def test_a_bad_row_in_a_directory_of_files_names_its_file_and_line(tok, tmp_path):
    """datasets reads a directory's files in sorted order and skips blank lines: the row is found in its file."""
    good = rows("chat.jsonl", 5)
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "train-0.jsonl", good)
    (tmp_path / "d" / "train-1.jsonl").write_text(json.dumps(good[0]) + "\n\n" + json.dumps({"messages": None}) + "\n")
    write(tmp_path / "d" / "validation.jsonl", good[:2])
    with pytest.raises(UserError) as error:
        data.prepare(DataConfig(path=str(tmp_path / "d"), format="chat", cache_dir=str(tmp_path / "c")), tok, 64, 0)
    assert str(error.value).startswith(f"dataset file {tmp_path / 'd' / 'train-1.jsonl'} line 3: a chat example is "
                                       f"NoneType"), error.value
    bad_val = good[:1] + [{"messages": [{"role": "user"}]}]
    write(tmp_path / "d" / "train-1.jsonl", good)
    write(tmp_path / "d" / "validation.jsonl", bad_val)
    with pytest.raises(UserError, match=f"dataset file {tmp_path / 'd' / 'validation.jsonl'} line 2: a chat message"):
        data.prepare(DataConfig(path=str(tmp_path / "d"), format="chat", cache_dir=str(tmp_path / "c")), tok, 64, 0)


def test_malformed_rows_of_the_other_formats(tok, tmp_path):
    for cfg, items, expected in (
            (DataConfig(format="chat"), [{"messages": [{"role": "user", "content": "Q"}]}, {"messages": "Q"}],
             "line 2: a chat example is str, not a list of messages"),
            (DataConfig(format="prompt_response"), [{"prompt": "Q", "response": "A"}, {"prompt": "Q", "response": None}],
             "line 2: 'response' is missing (null), not text"),
            (DataConfig(format="alpaca"), [{"instruction": "Q", "output": "A", "input": 3}],
             "line 1: 'input' is a int, not text"),
            (DataConfig(), [{"text": "a"}, {"text": ["a"]}], "line 2: 'text' is a list, not text")):
        path = write(tmp_path / f"{cfg.format}.jsonl", items * 3 if cfg.format == "alpaca" else items)
        cfg = DataConfig(**{**cfg.__dict__, "path": path, "cache_dir": str(tmp_path / "c"), "val_fraction": 0.0})
        with pytest.raises(UserError) as error:
            data.prepare(cfg, tok, 32, 0)
        assert f"dataset file {path} {expected}" in str(error.value)


def test_alpaca_joins_instruction_and_input_into_the_user_turn(tok, tmp_path):
    """Alpaca used to need data.prompt_field=instruction, which then trained without `input` and said nothing."""
    items = rows("alpaca.jsonl", 4)
    assert items[0]["input"] == "" and items[1]["input"]
    path = write(tmp_path / "alpaca.jsonl", items)
    prepared = data.prepare(DataConfig(path=path, format="alpaca", val_fraction=0.0, cache_dir=str(tmp_path / "c")),
                            tok, 64, 0)
    for item, example in zip(items, prepared.train):
        user = item["instruction"] + ("\n" + item["input"] if item["input"] else "")
        text = tok.apply_chat_template([{"role": "user", "content": user},
                                        {"role": "assistant", "content": item["output"]}], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert example["input_ids"][:len(ids)].tolist() == ids
        reply = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        n_prompt = len(tok(reply, add_special_tokens=False)["input_ids"])
        assert (example["labels"][:n_prompt] == -100).all() and (example["labels"][n_prompt:len(ids)] >= 0).all()
    assert "not read" not in prepared.summary
    # following the old hint: the instruction alone trains, and the data line says `input` was not read
    old_way = data.prepare(DataConfig(path=path, format="prompt_response", prompt_field="instruction",
                                      response_field="output", val_fraction=0.0, cache_dir=str(tmp_path / "c")),
                           tok, 64, 0)
    assert "column input not read by data.format=prompt_response" in old_way.summary


@pytest.mark.parametrize("recipe,file,expected", [
    ("tiny/chat_sft", "prompt_response.jsonl", "it looks like prompt_response data: set --data.format=prompt_response"),
    ("tiny/dpo", "chat.jsonl", "it looks like chat data: set --data.format=chat"),
    ("tiny/sft", "alpaca.jsonl", "it looks like alpaca data: set --data.format=alpaca"),
    ("tiny/pretrain", "sharegpt.jsonl", "set --data.format=chat --data.messages_field=conversations"),
    ("tiny/chat_sft", "sharegpt.jsonl", "has no field 'messages' (columns: conversations); set "
                                        "--data.messages_field=conversations"),
    ("tiny/pretrain", "preference_ultrafeedback.jsonl", "it looks like preference data"),
])
def test_a_missing_column_names_the_format_the_data_has(recipe, file, expected, tok):
    """A chat recipe on prompt/response data asked for data.messages_field (following it gave a second error); a
    DPO recipe on chat data asked for data.chosen_field."""
    cfg = load_recipe(recipe, {"data": {"path": str(EXAMPLES / file)}}).data
    raw = data.load_raw(cfg)
    with pytest.raises(UserError) as error:
        data.check_fields(raw["train"], cfg)
    assert expected in str(error.value)


@pytest.mark.parametrize("recipe,file,said", [
    ("tiny/chat_sft", "prompt_completion.jsonl", "columns prompt, completion are the prompt-completion layout: read "
                                                 "as data.format=prompt_response --data.response_field=completion"),
    ("tiny/chat_sft", "prompt_completion_conversational.jsonl", "the conversational prompt-completion layout"),
    ("tiny/sft", "chat.jsonl", "columns messages are the conversational layout: read as data.format=chat"),
])
def test_trls_sft_layouts_train_as_their_columns_say(recipe, file, said, tok, tmp_path):
    """TRL's SFT layouts found from their columns as TRL finds them (issue 84): an SFT recipe given another SFT
    layout stopped with a hint before; it now reads the columns as that layout, says so in the log, and tokenizes
    exactly as the recipe naming that layout does."""
    cfg = load_recipe(recipe, {"data": {"path": str(EXAMPLES / file), "val_fraction": 0.0,
                                        "cache_dir": str(tmp_path / "c")}}).data
    logged = []
    found = data.prepare(cfg, tok, 128, 0, logged.append)
    assert any(said in line for line in logged), logged
    fmt = "chat" if file == "chat.jsonl" else "prompt_response"
    named = data.prepare(DataConfig(**{**cfg.__dict__, "format": fmt,
                                       "response_field": "response" if fmt == "chat" else "completion"}),
                         tok, 128, 0)
    for column in ("input_ids", "labels"):
        assert [list(map(int, r)) for r in found.train[column]] == [list(map(int, r)) for r in named.train[column]]


def test_a_dedented_key_names_its_section():
    with pytest.raises(UserError, match=r"'max_steps' at the top level \(it belongs in the train section: "
                                        r"train.max_steps; indent it under `train:`\)"):
        load_recipe(None, {"max_steps": 3})


def test_too_little_data_is_refused_and_epochs_counted():
    with pytest.raises(UserError, match="the global batch of 16 sequences .* is larger than the training split's 12"):
        data.amount.check(12, 16, "8 x 1 x 2")
    data.amount.check(16, 16, "8 x 1 x 2")
    assert data.amount.describe(40, 16, 200) == "40 steps x 16 sequences = 3.20 epochs of 200"
    assert "give no sequences of 128 tokens" in data.amount.eval_note(3, 0, 0, 2, 128)
    assert "fewer than the 2 data-parallel ranks" in data.amount.eval_note(3, 1, 0, 2, 128)
    assert data.amount.eval_note(None, 0, 0, 2, 128) is None and data.amount.eval_note(30, 20, 3, 2, 128) is None


def test_a_row_the_chat_template_refuses_is_a_data_error(tok, tmp_path):
    """Rows that pass the checks but make the tokenizer or template raise inside `datasets.map` were a traceback and
    exit 1: the failing row is found (bisected) and named, exit 2."""
    import copy as copying
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}"
                        "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    items = rows("chat.jsonl", 40)
    items[22]["messages"][0]["content"] = "boom"
    path = write(tmp_path / "chat.jsonl", items)
    strict = copying.deepcopy(tok)
    strict.chat_template = template.read_text()
    with pytest.raises(UserError) as error:
        data.prepare(DataConfig(path=path, format="chat", cache_dir=str(tmp_path / "c")), strict, 64, 0)
    assert str(error.value) == (f"dataset file {path} line 23 cannot be tokenized (TemplateError: no boom here); fix "
                                f"or remove that row")


def test_prompts_to_learn_from_rewards(tok, tmp_path):
    """Issue 56: data.format=prompt keeps every column for the reward functions (none is "not read"), tokenizes a
    text prompt as it is and a conversation with the chat template's generation prompt, and names a bad row."""
    items = [{"prompt": "Now Sam has", "answer": "five"},
             {"prompt": [{"role": "user", "content": "What is 2 plus 2?"}], "answer": "four"}]
    path = write(tmp_path / "p.jsonl", items)
    cfg = DataConfig(format="prompt", path=path, cache_dir=str(tmp_path / "c"), val_fraction=0.0)
    prepared = data.prepare(cfg, tok, 32, 0)
    train = prepared.train
    assert train[0]["prompt_ids"].tolist() == tok("Now Sam has", add_special_tokens=False)["input_ids"]
    rendered = tok.apply_chat_template(items[1]["prompt"], tokenize=False, add_generation_prompt=True)
    assert train[1]["prompt_ids"].tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
    assert rendered.endswith("<|assistant|>") and train[1]["answer"] == "four"
    assert "2 prompts" in prepared.summary and "not read" not in prepared.summary
    bad = write(tmp_path / "bad.jsonl", [items[0], {"prompt": "", "answer": "x"}])
    with pytest.raises(UserError, match=f"dataset file {bad} line 2: 'prompt' is empty; a prompt is text"):
        data.prepare(DataConfig(**{**cfg.__dict__, "path": bad}), tok, 32, 0)
