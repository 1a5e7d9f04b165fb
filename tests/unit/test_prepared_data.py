"""prepare_data (tokenize once into Megatron's indexed shards), reading them as training blocks, mixing corpora by
weight, the sample order of big corpora, and the one-writer tokenization cache."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dstrain import data
from dstrain.config import DataConfig, ModelConfig
from dstrain.data import prepare_corpus as prepare_data
from dstrain.data import prepared
from dstrain.data.order import LAZY_ABOVE, EpochOrder, FeistelPermutation
from dstrain.errors import UserError
from dstrain.model import load_tokenizer
from dstrain.parallel import ds_internals
from dstrain.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """900 documents of the shipped corpus plus 40 held out: at most 1000 per split, so the in-job path (which packs
    each 1000-document batch on its own) cuts the same blocks as prepared data."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = (ROOT / "data" / "tiny" / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:900]) + "\n")
    (folder / "validation.jsonl").write_text("\n".join(lines[900:940]) + "\n")
    return folder


def _prepare(corpus: Path, output: Path, *extra: str) -> None:
    prepare_data.run([f"--data.path={corpus}", f"--output={output}", "--shard_documents=100", *extra])


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "ref"
    _prepare(corpus, out, "--workers=2")
    return out


def test_output_is_byte_identical_whatever_did_it(reference, corpus, tmp_path):
    manifest = json.loads((reference / prepared.MANIFEST).read_text())
    assert manifest["splits"]["train"]["documents"] == 900 and len(manifest["splits"]["train"]["shards"]) == 9
    assert manifest["splits"]["validation"]["documents"] == 40
    assert manifest["tokenizer"]["hash"] and manifest["dtype"] == "uint16"
    assert [f["name"] for f in manifest["source"]["files"]] == ["train.jsonl", "validation.jsonl"]
    # one worker in-process, and two SLURM array tasks one after the other: the same bytes as two workers
    _prepare(corpus, tmp_path / "one", "--workers=1")
    assert _digests(tmp_path / "one") == _digests(reference)
    env = {"SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "1"}
    old = {k: os.environ.get(k) for k in (*env, "SLURM_ARRAY_TASK_ID")}
    try:
        os.environ.update(env, SLURM_ARRAY_TASK_ID="2")
        _prepare(corpus, tmp_path / "tasks")
        assert not (tmp_path / "tasks" / prepared.MANIFEST).exists()  # task 1 of 2 wrote only its shards
        assert sorted(p.stem for p in (tmp_path / "tasks").glob("train-*.json")) == [f"train-{i:05d}" for i in (1, 3, 5, 7)]
        os.environ["SLURM_ARRAY_TASK_ID"] = "1"
        _prepare(corpus, tmp_path / "tasks")
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert _digests(tmp_path / "tasks") == _digests(reference)


def test_killed_run_keeps_finished_shards_and_completes_identically(reference, corpus, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dstrain.data.prepare_corpus", f"--data.path={corpus}", f"--output={out}",
           "--shard_documents=100"]
    # SIGKILL after shard 3's tokens are on disk but before its record: shards 0-2 are finished, 3 is not
    died = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, DSTRAIN_FAULT="prepare:shard:kill:step=3"),
                          capture_output=True, text=True)
    assert died.returncode == -9, died.stderr[-2000:]
    assert sorted(p.stem for p in out.glob("*.json")) == ["plan", "train-00000", "train-00001", "train-00002"]
    with pytest.raises(UserError, match="not finished .3 of 10 shards written.; run the same"):
        data.prepare(DataConfig(path=str(out)), None, 64, 0)
    kept = {p: p.stat().st_mtime_ns for p in out.glob("train-0000[012].*")}
    again = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, DSTRAIN_FAULT=""), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "3 already written, 7 to write" in again.stderr
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())  # finished shards were not redone
    assert _digests(out) == _digests(reference)


def test_the_old_command_name_still_prepares_the_same_corpus(reference, corpus, tmp_path):
    """`python -m dstrain.prepare_data`, the corpus command of earlier releases and of people's SLURM scripts, was
    gone without a word once it moved to dstrain/data/prepare_corpus.py (issue 83): it is an alias again, with a
    one-line note, writing the same bytes as the new command."""
    out = tmp_path / "old-name"
    proc = subprocess.run([sys.executable, "-m", "dstrain.prepare_data", f"--data.path={corpus}", f"--output={out}",
                           "--shard_documents=100"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.startswith("note: `python -m dstrain.prepare_data` is now `python -m dstrain.data."
                                  "prepare_corpus` (same arguments); the old name keeps working\n")
    assert _digests(out) == _digests(reference)


def test_rerun_with_other_inputs_or_a_foreign_directory_is_refused(reference, corpus, tmp_path):
    before = _digests(reference)
    with pytest.raises(UserError, match="prepared from other inputs .shard_count, shard_documents differ."):
        prepare_data.run([f"--data.path={corpus}", f"--output={reference}", "--shard_documents=50"])
    assert _digests(reference) == before
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty and was not written by prepare_data"):
        _prepare(corpus, tmp_path)
    with pytest.raises(UserError, match="already a prepared directory"):
        prepare_data.run([f"--data.path={reference}", f"--output={tmp_path / 'x'}"])
    with pytest.raises(UserError, match="data.format=chat .SFT. is tokenized in the job"):
        prepare_data.run(["--data.path=data/tiny_chat", "--data.format=chat", f"--output={tmp_path / 'y'}"])


@pytest.mark.parametrize("packing", [False, True])
def test_blocks_are_the_in_job_paths_sequences(reference, corpus, tok, packing, tmp_path):
    """The same text gives the same training rows either way: tokens, and with packing the per-document
    position_ids that keep attention within documents."""
    in_job = data.prepare(DataConfig(path=str(corpus), packing=packing, cache_dir=str(tmp_path)), tok, 64, 0)
    ready = data.prepare(DataConfig(path=str(reference), packing=packing), tok, 64, 0)
    assert "memory-mapped, nothing tokenized" in ready.summary
    for got, want in ((ready.train, in_job.train), (ready.val, in_job.val)):
        assert len(got) == len(want) > 0
        rows = list(range(len(want)))
        a, b = got[rows], want[rows]
        assert set(a) == ({"input_ids", "position_ids"} if packing else {"input_ids"})
        for key in a:
            assert torch.equal(a[key], b[key].long()), key
    if packing:  # a document start inside a block restarts its positions
        assert (ready.train[0]["position_ids"][1:] == 0).any()


def test_prepared_data_checks(reference, tok, tmp_path):
    with pytest.raises(UserError, match="set data.format=text"):
        data.prepare(DataConfig(path=str(reference), format="chat"), tok, 64, 0)
    with pytest.raises(UserError, match="fewer than one sequence of 100000"):
        data.prepare(DataConfig(path=str(reference)), tok, 100_000, 0)
    other = tmp_path / "other"
    other.mkdir()
    for f in reference.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((other / prepared.MANIFEST).read_text())
    manifest["tokenizer"]["hash"] = "0" * 64
    (other / prepared.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="tokenized with recipes/tiny/model .another vocabulary"):
        data.prepare(DataConfig(path=str(other)), tok, 64, 0)
    with pytest.raises(UserError, match="is not a directory written by prepare_data"):
        data.prepare(DataConfig(mix=[{"path": str(reference), "weight": 1}, {"path": "data/tiny", "weight": 1}]),
                     tok, 64, 0)
    with pytest.raises(UserError, match="must be .path: <prepared directory>, weight: <positive number>"):
        DataConfig(mix=[{"path": str(reference), "weight": 0}])


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx):
        return {"input_ids": torch.tensor(idx).view(-1, 1)}


def test_mix_keeps_weights_at_every_prefix_and_repeats_an_exhausted_source():
    said = []
    mix = prepared.Mix([_Sized(5000), _Sized(40)], ["big", "small"], [7, 3], said.append)  # weights normalised
    order = mix.order(seed=1)
    picks = np.array([order(k) for k in range(20_000)])
    source = (picks >= 5000).astype(int)
    for n in (100, 1000, 5000, 20_000):
        assert abs(source[:n].mean() - 0.3) <= 0.01 * 0.3 + 1 / n, n
    small = picks[source == 1] - 5000
    assert sorted(small[:40]) == list(range(40)) and sorted(small[40:80]) == list(range(40))
    assert small[:40].tolist() != small[40:80].tolist()  # each epoch of a source in its own order
    assert [mix.drawn(1, k) for k in (0, 1000, 20_000)] == [0, int(source[:1000].sum()), int(source.sum())]
    mix.note_samples(0, 100)  # 30 of the small source's 40: nothing to say yet
    assert not said
    mix.note_samples(100, 200)
    assert len(said) == 1 and "small was read to its end (40 sequences)" in said[0]
    assert order(123_457) == prepared.Mix([_Sized(5000), _Sized(40)], ["big", "small"], [7, 3], said.append).order(
        seed=1)(123_457)  # a pure function of (seed, k): nothing carried between calls


def test_mix_order_is_the_same_on_any_data_parallel_size():
    mix = prepared.Mix([_Sized(300), _Sized(70)], ["a", "b"], [0.7, 0.3], lambda s: None)
    one = data.TrainStream(mix, 4, 4, Layout(1), seed=3)
    two = [data.TrainStream(mix, 4, 2, Layout(2, rank=r), seed=3) for r in range(2)]
    for step in (0, 5, 17):
        want = sorted(int(x) for b in one.micro_batches(step) for x in b["input_ids"].flatten())
        got = sorted(int(x) for s in two for b in s.micro_batches(step) for x in b["input_ids"].flatten())
        assert got == want == sorted(mix[one.global_batch_indices(step)]["input_ids"].flatten().tolist())
        assert len(want) == 16


def test_sample_order_past_numpy_size_is_a_lazy_permutation():
    for n in (1, 2, 3, 1000, 4097):
        perm = FeistelPermutation(n, [5, 0])
        assert sorted(perm(i) for i in range(n)) == list(range(n))
    assert [FeistelPermutation(4097, [5, 0])(i) for i in range(8)] != [FeistelPermutation(4097, [5, 1])(i)
                                                                       for i in range(8)]
    small = EpochOrder(50, [9])
    assert [small(k) for k in range(50, 100)] == np.random.default_rng([9, 1]).permutation(50).tolist()
    big = EpochOrder(LAZY_ABOVE + 1, [9])
    assert isinstance(big.epoch_permutation(0), FeistelPermutation)
    firsts = [big(k) for k in range(1000)]
    assert len(set(firsts)) == 1000 and max(firsts) > LAZY_ABOVE // 2
    # issue 29: every epoch its own order, keyed by the epoch (a key that ignored it repeated epoch 0 forever)
    n = LAZY_ABOVE + 1
    second = [big(k) for k in range(n, n + 1000)]
    assert second == [FeistelPermutation(n, [9, 1])(i) for i in range(1000)]
    assert len(set(second)) == 1000 and len(set(second) & set(firsts)) < 10
    assert [big(k) for k in range(2 * n, 2 * n + 10)] == [FeistelPermutation(n, [9, 2])(i) for i in range(10)]


def test_one_writer_tokenizes_a_missing_cache_while_the_others_wait(corpus, tok, tmp_path, monkeypatch):
    calls = []
    real = data.tokenize

    def counted(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)
    monkeypatch.setattr(data.cache, "tokenize", counted)
    cfg = DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"))
    results = [None] * 3

    def one(i):
        results[i] = data.prepare(cfg, tok, 64, 0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(calls)) == 1  # train and validation tokenized by one writer, once
    assert len({str(r.cache_path) for r in results}) == 1 and all(len(r.train) == len(results[0].train) for r in results)
    assert not list((tmp_path / "cache").glob("*.lock")) and not list((tmp_path / "cache").glob(".tmp-*"))


def test_a_dead_writers_lock_is_taken_over(corpus, tok, tmp_path, monkeypatch):
    cfg = DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"))
    raw = data.load_raw(cfg)
    train_raw, val_raw = data.split_train_val(raw, cfg, 0)
    key = data.cache_key(cfg, 64, 0, tok, [ds_internals.dataset_fingerprint(d) for d in (train_raw, val_raw)])
    lock = tmp_path / "cache" / f"{key}.lock"
    lock.parent.mkdir()
    lock.write_text("node7 pid 1234\n")
    os.utime(lock, (0, 0))  # not refreshed for decades: its writer is gone
    got = data.prepare(cfg, tok, 64, 0)
    assert len(got.train) > 0 and not lock.exists()


def test_in_job_tokenization_of_a_large_corpus_points_at_prepare_data(corpus, tok, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data.cache, "LARGE_CORPUS_BYTES", 1000)  # the shipped sample stands in for hundreds of MB
    data.prepare(DataConfig(path=str(corpus), cache_dir=str(tmp_path)), tok, 64, 0)
    err = capsys.readouterr().err
    assert "GiB of text: every run and every node without this cache pays" in err
    assert f"python -m dstrain.data.prepare_corpus --data.path={corpus} --output DIR" in err
    data.prepare(DataConfig(path=str(corpus), cache_dir=str(tmp_path)), tok, 64, 0)  # a cache hit says nothing
    assert "prepare_data" not in capsys.readouterr().err
