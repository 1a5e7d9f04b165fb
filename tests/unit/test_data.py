"""Packing, SFT masking, the resumable per-rank sampler, validation sharding, the tokenization cache."""
import json

import numpy as np
import pytest
import torch

from dstrain import data
from dstrain.config import DataConfig, ModelConfig
from dstrain.errors import UserError
from dstrain.model import load_tokenizer
from dstrain.parallel.layout import Layout


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="recipes/tiny/model"))


def test_packing_has_no_padding_and_separates_documents_with_eos(tok):
    docs = ["It was a sunny day.", "Mira had two keys.", "Tom ran to the hill."] * 20
    blocks = data.pack_texts(docs, tok, seq_len=16)["input_ids"]
    flat = [t for b in blocks for t in b]
    expected = []
    for d in docs:
        expected += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert all(len(b) == 16 for b in blocks)
    assert flat == expected[:len(flat)]               # nothing dropped or padded inside
    assert len(expected) - len(flat) < 16             # only the tail that cannot fill a block
    assert tok.pad_token_id not in flat


def test_separated_documents_restart_their_positions_after_each_eos(tok):
    docs = ["It was a sunny day.", "Mira had two keys.", "Tom ran to the hill."] * 4
    packed = data.pack_texts(docs, tok, seq_len=16, separate=True)
    assert packed["input_ids"] == data.pack_texts(docs, tok, seq_len=16)["input_ids"]  # the same tokens
    for ids, positions in zip(packed["input_ids"], packed["position_ids"]):
        assert positions[0] == 0  # every block starts a document (a cut one starts again)
        for t in range(1, 16):
            assert positions[t] == (0 if ids[t - 1] == tok.eos_token_id else positions[t - 1] + 1)


def test_pack_examples_keeps_every_example_whole_and_masks_its_first_label():
    examples = [([1, 2, 3, 4], [-100, -100, 3, 4]), ([5, 6, 7], [-100, 6, 7]), ([8, 9, 10, 11, 12], [-100] * 3 + [11, 12]),
                ([13, 14], [-100, 14])]
    out = data.pack_examples(examples, seq_len=8, pad=0)
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13, 14, 0]]  # first fit, in order
    assert out["position_ids"] == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 1, 0]]
    assert out["labels"] == [[-100, -100, 3, 4, -100, 6, 7, -100], [-100, -100, -100, 11, 12, -100, 14, -100]]
    assert out["attention_mask"] == [[1] * 7 + [0], [1] * 7 + [0]]


def test_sequence_slices_hold_every_label_once_with_its_position():
    batch = {"input_ids": torch.arange(16).reshape(2, 8), "labels": torch.arange(100, 116).reshape(2, 8),
             "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    batch["labels"][0, 5] = data.IGNORE_INDEX
    slices = [data.shard_sequence(batch, r, 2) for r in range(2)]
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(torch.cat([s[key] for s in slices], 1), batch[key])
    assert torch.equal(torch.cat([s["position_ids"] for s in slices], 1), torch.arange(8).expand(2, 8))
    targets = torch.cat([s["shift_labels"] for s in slices], 1)  # position t's target is token t + 1's label
    assert torch.equal(targets[:, :-1], batch["labels"][:, 1:]) and (targets[:, -1] == data.IGNORE_INDEX).all()
    assert "labels" not in slices[0]
    with pytest.raises(UserError, match="does not split over sequence_parallel_size=3"):
        data.shard_sequence(batch, 0, 3)


def test_short_eval_batches_are_filled_with_rows_that_count_nothing():
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "labels": torch.ones(3, 4, dtype=torch.long),
             "attention_mask": torch.ones(3, 4, dtype=torch.long)}
    filled = data.stream._fill_rows(batch, 4)
    assert filled["input_ids"].shape == (4, 4)
    assert (filled["labels"][3] == data.IGNORE_INDEX).all() and filled["attention_mask"][3].sum() == 0
    assert torch.equal(filled["labels"][:3], batch["labels"])


def _trained_text(example, tok):
    ids = [i for i, label in zip(example["input_ids"], example["labels"]) if label != data.IGNORE_INDEX]
    return tok.decode(ids)


def test_prompt_response_trains_only_on_the_response_with_template(tok):
    ex = data.sft_example([{"role": "user", "content": "What is 2 plus 3?"},
                           {"role": "assistant", "content": "2 plus 3 is 5."}], tok, seq_len=48)
    assert len(ex["input_ids"]) == 48
    assert _trained_text(ex, tok) == "2 plus 3 is 5.</s>"      # reply + EOS, nothing of the prompt
    text = tok.decode(ex["input_ids"][:sum(ex["attention_mask"])])
    assert text.startswith("<|user|>What is 2 plus 3?</s><|assistant|>")
    n = sum(ex["attention_mask"])
    assert ex["labels"][n:] == [data.IGNORE_INDEX] * (48 - n)   # padding never trains


def test_multi_turn_chat_trains_every_assistant_turn(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    ex = data.sft_example(msgs, tok, seq_len=64)
    assert _trained_text(ex, tok) == "Hello</s>one two</s>"


def test_without_chat_template_plain_format_is_said_and_set_on_the_tokenizer(tok):
    from dstrain import chat_templates
    tok2 = load_tokenizer(ModelConfig(name_or_path="recipes/tiny/model"))
    tok2.chat_template = None
    said = []
    assert chat_templates.apply(None, tok2, said.append).startswith("plain")
    assert len(said) == 1 and "has no chat template" in said[0] and "data.chat_template" in said[0]
    ex = data.sft_example([{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}], tok2, 32)
    assert _trained_text(ex, tok2) == "A.</s>"
    assert tok2.decode(ex["input_ids"][:sum(ex["attention_mask"])]).startswith("<s>user: Q?\nassistant: ")


@pytest.mark.parametrize("name,prompt_text,reply_text", [
    ("chatml", "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n", "A.<|im_end|>\n"),
    ("llama3", "<s><|start_header_id|>user<|end_header_id|>\n\nQ?<|eot_id|><|start_header_id|>assistant"
               "<|end_header_id|>\n\n", "A.<|eot_id|>"),
])
def test_named_templates_train_only_the_reply(name, prompt_text, reply_text):
    """The rendered text is checked against the format written out here, not against the template itself."""
    from dstrain import chat_templates
    tok2 = load_tokenizer(ModelConfig(name_or_path="recipes/tiny/model"))
    assert chat_templates.apply(name, tok2, print) == name
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert tok2.apply_chat_template(messages, tokenize=False) == prompt_text + reply_text
    ex = data.sft_example(messages, tok2, 256)  # the tiny vocabulary spells the markers out
    trained = [i for i, label in zip(ex["input_ids"], ex["labels"]) if label != data.IGNORE_INDEX]
    assert trained == tok2(reply_text, add_special_tokens=False)["input_ids"]


def test_template_file_sharegpt_roles_and_bad_choices(tmp_path):
    from dstrain import chat_templates
    from dstrain.chat_templates import normalize
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok2 = load_tokenizer(ModelConfig(name_or_path="recipes/tiny/model"))
    chat_templates.apply(str(path), tok2, print)
    sharegpt = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q?"},
                {"from": "gpt", "value": "A."}]
    assert normalize(sharegpt, {}) == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert tok2.apply_chat_template(normalize(sharegpt, {}), tokenize=False) == \
        "[system] Be brief.\n[user] Q?\n[assistant] A.\n"
    with pytest.raises(UserError, match=r"chat role 'bot' is not one of .*--data.role_map.bot=user"):
        normalize([{"from": "bot", "value": "x"}], {})
    assert normalize([{"from": "bot", "value": "x"}], {"bot": "assistant"})[0]["role"] == "assistant"
    with pytest.raises(UserError, match=r"data.chat_template='chatm' is neither .*did you mean 'chatml'"):
        DataConfig(chat_template="chatm")


def test_truncated_away_reply_is_dropped(tok):
    long_prompt = "word " * 100
    assert data.sft_example([{"role": "user", "content": long_prompt},
                             {"role": "assistant", "content": "x"}], tok, seq_len=16) is None


def _stream(n, micro, accum, dp, seed=0):
    class Indexable:
        def __len__(self):
            return n

        def __getitem__(self, idx):
            return {"input_ids": torch.tensor(idx).view(-1, 1)}
    return [data.TrainStream(Indexable(), micro, accum, Layout(dp, rank=r), seed) for r in range(dp)]


def test_ranks_split_each_global_batch_into_distinct_samples():
    streams = _stream(n=50, micro=3, accum=2, dp=2)
    for step in range(12):  # crosses several epochs (global batch 12, 50 samples)
        seen = [int(x) for s in streams for mb in s.micro_batches(step) for x in mb["input_ids"].flatten()]
        assert sorted(seen) == sorted(streams[0].global_batch_indices(step))
        assert len(seen) == 12
    # every epoch visits every sample exactly once
    first_epoch = [streams[0].sample_index(k) for k in range(50)]
    assert sorted(first_epoch) == list(range(50))
    second_epoch = [streams[0].sample_index(k) for k in range(50, 100)]
    assert sorted(second_epoch) == list(range(50)) and second_epoch != first_epoch


def test_batches_are_a_pure_function_of_seed_and_step():
    a = _stream(40, 4, 1, 2, seed=7)[1]
    b = _stream(40, 4, 1, 2, seed=7)[1]
    for step in (9, 0, 3):  # any order: nothing carried between calls but the step
        assert torch.equal(a.micro_batches(step)[0]["input_ids"], b.micro_batches(step)[0]["input_ids"])
    c = _stream(40, 4, 1, 2, seed=8)[1]
    assert not torch.equal(a.micro_batches(0)[0]["input_ids"], c.micro_batches(0)[0]["input_ids"])
    # the contract a reference loop can rebuild without dstrain: epoch permutation from (seed, epoch)
    perm = np.random.default_rng([7, 0]).permutation(40)
    assert a.global_batch_indices(0) == perm[:8].tolist()


def test_eval_batches_equal_count_per_rank_and_disjoint():
    ds = {"input_ids": torch.arange(23).view(-1, 1)}

    class Indexable:
        def __len__(self):
            return 23

        def __getitem__(self, idx):
            return {"input_ids": ds["input_ids"][idx]}
    shards = [data.eval_batches(Indexable(), 4, Layout(2, rank=r)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 3
    ids = [set(int(x) for b in s for x in b["input_ids"].flatten()) for s in shards]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 22


def test_prepare_caches_tokenization_and_validates(tok, tmp_path):
    (tmp_path / "d").mkdir()
    rows = [{"body": f"Mira had {i} keys. Tom ran to the hill."} for i in range(200)]
    (tmp_path / "d" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(tmp_path / "d" / "train.jsonl"), text_field="body", val_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    first = data.prepare(cfg, tok, 32, 0)
    second = data.prepare(cfg, tok, 32, 0)
    assert not first.cache_hit and second.cache_hit and first.cache_path == second.cache_path
    assert len(first.train) > 0 and len(first.val) > 0
    assert torch.equal(first.train[:]["input_ids"], second.train[:]["input_ids"])
    other = data.prepare(DataConfig(**{**cfg.__dict__, "val_fraction": 0.2}), tok, 32, 0)
    assert other.cache_path != first.cache_path       # a different split is a different cache entry
    with pytest.raises(UserError, match=r"has no field 'text' \(columns: body\); set data.text_field"):
        data.prepare(DataConfig(path=cfg.path, cache_dir=cfg.cache_dir), tok, 32, 0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="is empty; point data.path at a file with rows"):
        data.prepare(DataConfig(path=str(tmp_path / "empty.jsonl")), tok, 32, 0)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "txt", "saved", "dir"])
def test_every_local_format_loads(tmp_path, fmt):
    import datasets
    rows = [{"text": f"Mira had {i} keys."} for i in range(30)]
    ds = datasets.Dataset.from_list(rows)
    if fmt in ("jsonl", "json"):
        path = tmp_path / f"d.{fmt}"
        ds.to_json(path)
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(path, index=False)
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(path)
    elif fmt == "txt":
        path = tmp_path / "d.txt"
        path.write_text("".join(r["text"] + "\n" for r in rows))
    elif fmt == "saved":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "validation": ds.select(range(5))}).save_to_disk(path)
    else:
        path = tmp_path / "dir"
        path.mkdir()
        ds.to_json(path / "train.jsonl")
        ds.select(range(5)).to_json(path / "validation.jsonl")
    raw = data.load_raw(DataConfig(path=str(path)))
    assert raw["train"]["text"] == [r["text"] for r in rows]
    train, val = data.split_train_val(raw, DataConfig(path=str(path), val_fraction=0.1), seed=0)
    if fmt in ("saved", "dir"):
        assert len(train) == 30 and len(val) == 5          # the given validation split
    else:
        assert len(train) == 27 and len(val) == 3          # carved out with the seed
        again = data.split_train_val(raw, DataConfig(path=str(path), val_fraction=0.1), seed=0)[1]
        assert val["text"] == again["text"]


def test_unsupported_extension_and_missing_split(tmp_path):
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(UserError, match="unsupported extension"):
        data.load_raw(DataConfig(path=str(tmp_path / "d.xml")))
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(UserError, match="has no split 'training'"):
        data.load_raw(DataConfig(path=str(tmp_path / "d.jsonl"), train_split="training"))


def test_overlong_sft_examples_are_counted_truncated_or_dropped(tok, tmp_path):
    """Issue 16: examples longer than seq_len were silently cut or lost. Counted against lengths computed here
    with the tokenizer alone (not with the code under test)."""
    short = {"prompt": "Q?", "response": "A."}
    long_reply = {"prompt": "Q?", "response": " ".join(["Mira had two keys."] * 20)}  # reply starts in time
    long_prompt = {"prompt": " ".join(["Tom ran to the hill."] * 20), "response": "A."}  # reply never fits
    rows = [short] * 5 + [long_reply] * 3 + [long_prompt] * 2
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seq_len = 32
    for row in (short, long_reply, long_prompt):  # the premise, measured independently
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                        {"role": "assistant", "content": row["response"]}], tokenize=False)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        assert (n <= seq_len) == (row is short), (row, n)
    cfg = DataConfig(path=str(path), format="prompt_response", val_fraction=0.0, cache_dir=str(tmp_path / "c"))
    prepared = data.prepare(cfg, tok, seq_len, 0)
    assert len(prepared.train) == 8
    assert "10 examples -> 8 sequences" in prepared.summary
    assert "3 longer than seq_len were truncated" in prepared.summary and "2 dropped" in prepared.summary
    again = data.prepare(cfg, tok, seq_len, 0)  # a cache hit reports the same
    assert again.cache_hit and again.summary == prepared.summary


def test_data_that_tokenizes_to_nothing_is_one_clear_error(tok, tmp_path):
    """Issue 16: a 3-line text file at seq_len 128 (or chat data all longer than seq_len) crashed with an
    IndexError inside datasets.load_from_disk."""
    path = tmp_path / "three.txt"
    path.write_text("It was a sunny day.\nMira had two keys.\nTom ran.\n")
    cfg = DataConfig(path=str(path), val_fraction=0.0, cache_dir=str(tmp_path / "c"))
    for _ in range(2):  # and again from the cache
        with pytest.raises(UserError, match="gives no training sequences of length 128: provide longer"):
            data.prepare(cfg, tok, 128, 0)
