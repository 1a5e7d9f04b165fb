"""Datasets: load through `datasets`, tokenize once (cached), pack or mask, and hand each data-parallel
rank its distinct share of every global batch in a seeded order that is a pure function of the step.

Because batch contents depend only on (seed, step), the data position in a checkpoint is the step
itself: resuming at step k reproduces exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import env
from ..chat_templates import normalize
from ..config import DataConfig
from ..ds_internals import dataset_fingerprint
from ..errors import UserError
from ..layout import Layout
from ..paths import local_or_hub
from .order import EpochOrder

IGNORE_INDEX = -100
STATS = "stats.json"  # counts of a tokenized cache: documents/examples, sequences, truncated, dropped
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                 ".text": "text", ".arrow": "arrow"}


# ----------------------------------------------------------------------------- loading

def _first_bad_json_line(path: Path) -> str | None:
    """For a JSON-lines file (or a directory of them) that datasets could not read: the first line that is not a
    JSON object, as a one-line error with its file and line number (datasets names neither)."""
    files = [path] if path.is_file() else sorted(path.glob("**/*.jsonl")) if path.is_dir() else []
    for file in files:
        if file.suffix.lower() not in (".jsonl", ".json") or (file.suffix.lower() == ".json" and file.stat().st_size
                                                              and file.read_bytes()[:1] in (b"[", b"{")
                                                              and _is_json(file)):
            continue
        with open(file, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    return (f"dataset file {file} line {number} is not valid JSON ({error.msg}, column {error.colno}); "
                            f"fix or remove that line")
                if not isinstance(row, dict):
                    return (f"dataset file {file} line {number} is a JSON {type(row).__name__}, not an object; each "
                            f"line should be one record such as {{\"text\": ...}}")
    return None


def _is_json(file: Path) -> bool:
    try:
        json.loads(file.read_text())
        return True
    except (ValueError, UnicodeDecodeError):
        return False


def load_raw(cfg: DataConfig):
    """A DatasetDict from a hub id, a local file, a local directory, or a dataset saved with save_to_disk."""
    import datasets

    location = local_or_hub(cfg.path)
    path = Path(location)
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"dataset file {path} is empty; point data.path at a file with rows")
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise UserError(f"data.path {path} has an unsupported extension; use one of "
                                f"{', '.join(sorted(FILE_BUILDERS))}")
            loaded = datasets.load_dataset(builder, data_files=str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset(location, cfg.name)
    except UserError:
        raise
    except (FileNotFoundError, ConnectionError, OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        bad = _first_bad_json_line(path)
        if bad:
            raise UserError(bad) from None
        raise UserError(f"cannot load dataset '{cfg.path}': {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        f"; check data.path (a local file/dir, or a hub id reachable from here)") from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({cfg.train_split: loaded})
    if cfg.train_split not in loaded:
        raise UserError(f"dataset '{cfg.path}' has no split '{cfg.train_split}' (splits: {', '.join(loaded)}); "
                        f"set data.train_split")
    return loaded


def split_train_val(raw, cfg: DataConfig, seed: int):
    """(train, val) raw splits: the named validation split when present, else a seeded carve-out."""
    train = raw[cfg.train_split]
    if len(train) == 0:
        raise UserError(f"dataset '{cfg.path}' split '{cfg.train_split}' has no rows")
    if cfg.val_split and cfg.val_split in raw:
        return train, raw[cfg.val_split]
    if cfg.val_fraction == 0:
        return train, None
    if len(train) < 2:
        raise UserError(f"dataset '{cfg.path}' has too few rows to carve out a validation split; "
                        f"set data.val_fraction=0")
    parts = train.train_test_split(test_size=cfg.val_fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


# ----------------------------------------------------------------------------- tokenization

def _require_field(dataset, field_name: str, key: str, path: str) -> None:
    if field_name not in dataset.column_names:
        raise UserError(f"dataset '{path}' has no field '{field_name}' (columns: {', '.join(dataset.column_names)});"
                        f" set {key} to one of them")


def pack_texts(texts: list[str], tokenizer, seq_len: int, separate: bool = False) -> dict[str, list[list[int]]]:
    """Concatenate documents, each followed by EOS, and cut into full seq_len blocks (no padding): input_ids, and
    with `separate` (data.packing) position_ids that restart after each EOS and at each block, so attention never
    crosses a document (the EOS still predicts the next document's first token, as in plain concatenation)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no eos_token; packing needs one to separate documents")
    flat: list[int] = []
    positions: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        flat.extend(ids)
        flat.append(eos)
        positions.extend(range(len(ids) + 1))
    usable = len(flat) // seq_len * seq_len
    out = {"input_ids": [flat[i:i + seq_len] for i in range(0, usable, seq_len)]}
    if separate:  # a document cut by a block boundary starts again at position 0 in the next block
        out["position_ids"] = [_restart_at_zero(positions[i:i + seq_len]) for i in range(0, usable, seq_len)]
    return out


def _restart_at_zero(positions: list[int]) -> list[int]:
    offset = positions[0]
    out = []
    for p in positions:
        if p == 0:
            offset = 0
        out.append(p - offset)
    return out


def pack_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad: int) -> dict[str, list]:
    """SFT examples (ids, labels, each at most seq_len long) into rows of seq_len, first fit in order: each example
    keeps its tokens and labels, its positions restart at 0 and its first label is ignored (it would be predicted
    from the previous example's last token). The tail of a row is padding: its own positions, no labels.
    Deterministic: the same examples in the same order give the same rows."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for ids, labels in examples:
        for r, free in enumerate(room):
            if len(ids) <= free:
                rows[r].append((ids, labels))
                room[r] -= len(ids)
                break
        else:
            rows.append([(ids, labels)])
            room.append(seq_len - len(ids))
    out = {k: [] for k in PACKED_COLUMNS}
    for row, free in zip(rows, room):
        ids, labels, positions = [], [], []
        for piece_ids, piece_labels in row:
            ids += piece_ids
            labels += [IGNORE_INDEX] + piece_labels[1:]
            positions += list(range(len(piece_ids)))
        out["input_ids"].append(ids + [pad] * free)
        out["labels"].append(labels + [IGNORE_INDEX] * free)
        out["attention_mask"].append([1] * len(ids) + [0] * free)
        out["position_ids"].append(positions + list(range(free)))
    return out


def _segments_with_template(messages: list[dict], tokenizer) -> list[tuple[str, bool]]:
    """Split a templated conversation into (text, trainable) pieces: only assistant replies train."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    pieces, previous = [], ""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            prompt = render(messages[:i], True) if i else render([], True)
            full = render(messages[:i + 1], False)
            if not (prompt.startswith(previous) and full.startswith(prompt)):
                raise UserError("the tokenizer's chat template does not render conversations prefix by prefix; "
                                "set data.format=prompt_response or fix the template")
            pieces += [(prompt[len(previous):], False), (full[len(prompt):], True)]
        else:
            full = render(messages[:i + 1], False)
            pieces.append((full[len(previous):], False))
        previous = full
    return pieces


def _sft_tokens(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """A whole conversation's ids and labels (IGNORE_INDEX except on assistant replies), untruncated. The
    tokenizer carries the run's template (dstrain/chat_templates.py)."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template: chat_templates.apply sets one first")
    pieces = _segments_with_template(messages, tokenizer)
    ids, labels = [], []
    for text, trainable in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trainable else [IGNORE_INDEX] * len(piece)
    return ids, labels


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _fit(ids: list[int], labels: list[int], seq_len: int, tokenizer, pad_to: bool = True) -> dict | None:
    """Truncated (the end of the conversation is cut) and padded to seq_len (unless not `pad_to`: packing fills
    the rest); None when no reply token is left."""
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    if not pad_to:
        return {"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)}
    pad = _pad_id(tokenizer)
    n_pad = seq_len - len(ids)
    return {"input_ids": ids + [pad] * n_pad, "labels": labels + [IGNORE_INDEX] * n_pad,
            "attention_mask": [1] * len(ids) + [0] * n_pad}


def sft_example(messages: list[dict], tokenizer, seq_len: int) -> dict | None:
    """input_ids / labels / attention_mask of one conversation, padded to seq_len; labels only on replies.

    None when truncation leaves no reply token to learn from."""
    return _fit(*_sft_tokens(messages, tokenizer), seq_len, tokenizer)


def _to_messages(row: dict, cfg: DataConfig) -> list[dict]:
    if cfg.format == "chat":
        return normalize(row[cfg.messages_field], cfg.role_map)
    return [{"role": "user", "content": str(row[cfg.prompt_field])},
            {"role": "assistant", "content": str(row[cfg.response_field])}]


def check_fields(dataset, cfg: DataConfig) -> None:
    if cfg.format == "text":
        fields = [(cfg.text_field, "data.text_field")]
    elif cfg.format == "chat":
        fields = [(cfg.messages_field, "data.messages_field")]
    else:
        fields = [(cfg.prompt_field, "data.prompt_field"), (cfg.response_field, "data.response_field")]
    for name, key in fields:
        _require_field(dataset, name, key, cfg.path)


SFT_COLUMNS = ("input_ids", "labels", "attention_mask")
PACKED_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids")


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int) -> tuple[Any, dict]:
    """Raw split -> (model-ready split: input_ids [+ labels, attention_mask for SFT], counts for the report).

    SFT examples longer than seq_len are truncated at seq_len (their end is cut); those left without a reply
    token are dropped. Both are counted: a user should know what a seq_len costs."""
    check_fields(dataset, cfg)
    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    if cfg.format == "text":
        def fn(batch):
            return pack_texts(batch[cfg.text_field], tokenizer, seq_len, separate=cfg.packing)
        out = dataset.map(fn, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                          num_proc=num_proc, desc="tokenizing")
        return out, {"documents": len(dataset), "sequences": len(out), "separated": cfg.packing}

    def fn(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {k: [] for k in (*SFT_COLUMNS, "full_length", "has_reply")}
        for row in rows:
            ids, labels = _sft_tokens(_to_messages(row, cfg), tokenizer)
            example = _fit(ids, labels, seq_len, tokenizer, pad_to=not cfg.packing)
            for key in SFT_COLUMNS:  # a dropped example stays as an empty row until it is counted
                out[key].append(example[key] if example else [])
            out["full_length"].append(len(ids) if example else -len(ids))
            out["has_reply"].append(any(label != IGNORE_INDEX for label in labels))  # at any length
        return out
    marked = dataset.map(fn, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                         num_proc=num_proc, desc="tokenizing")
    lengths = np.asarray(marked["full_length"], dtype=np.int64)
    kept = np.flatnonzero(lengths >= 0)
    out = marked.select(kept).remove_columns(["full_length", "has_reply"])
    stats = {"examples": len(dataset), "sequences": len(out), "truncated": int((lengths > seq_len).sum()),
             "dropped": int((lengths < 0).sum()), "no_reply": int(len(dataset) - sum(marked["has_reply"]))}
    if cfg.packing and len(out):
        pad = _pad_id(tokenizer)

        def pack(batch):  # 1000 examples at a time: rows never mix examples far apart in the data's order
            return pack_examples(list(zip(batch["input_ids"], batch["labels"])), seq_len, pad)
        out = out.map(pack, batched=True, batch_size=1000, remove_columns=out.column_names, desc="packing")
        stats |= {"packed_examples": stats["sequences"], "sequences": len(out)}
    if len(out):
        stats["padding"] = 1 - int(np.minimum(lengths[kept], seq_len).sum()) / (len(out) * seq_len)
    return out, stats


def report(stats: dict, seq_len: int) -> str:
    """One line on what tokenization made of the data."""
    if "documents" in stats:
        return (f"{stats['documents']:,} documents packed into {stats['sequences']:,} sequences of {seq_len} "
                f"tokens (the last partial block dropped"
                f"{'; attention kept within each document' if stats.get('separated') else ''})")
    text = f"{stats['examples']:,} examples -> {stats['sequences']:,} sequences of {seq_len} tokens"
    if "packed_examples" in stats:
        text += f" ({stats['packed_examples']:,} examples packed, no attention across them)"
    if "padding" in stats:
        text += f", {stats['padding']:.1%} padding"
    if stats["truncated"] or stats["dropped"]:
        text += (f"; {stats['truncated']:,} longer than seq_len were truncated (their end cut), "
                 f"{stats['dropped']:,} dropped (no reply token within {seq_len}); raise train.seq_len to keep them")
    return text


# ----------------------------------------------------------------------------- cache

def tokenizer_fingerprint(tokenizer) -> str:
    payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template,
                          "eos": tokenizer.eos_token, "bos": tokenizer.bos_token, "pad": tokenizer.pad_token,
                          "class": type(tokenizer).__name__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def cache_key(cfg: DataConfig, seq_len: int, seed: int, tokenizer, raw_fingerprints: list[str]) -> str:
    payload = json.dumps({"data": asdict(cfg) | {"cache_dir": None, "num_proc": None}, "seq_len": seq_len,
                          "seed": seed, "tokenizer": tokenizer_fingerprint(tokenizer), "raw": raw_fingerprints,
                          "version": 2}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    return env.cache_root() / "tokenized"


@dataclass
class Prepared:
    train: Any
    val: Any
    cache_path: Path
    cache_hit: bool
    summary: str = ""  # what tokenization made of the training split (data.report)


LARGE_CORPUS_BYTES = 300 * 2**20  # above this, tokenizing in the job costs more than prepare_data once
LOCK_STALE_S = 120.0  # a cache lock not refreshed for this long belongs to a writer that died


def prepare(cfg: DataConfig, tokenizer, seq_len: int, seed: int, log=lambda text: None) -> Prepared:
    """The run's splits: a prepared corpus (or mix) memory-mapped, or the raw data tokenized into the cache once
    (or reused from it). One rank writes a missing cache; every other rank waits on its file, not on a collective."""
    import datasets

    from . import prepared

    if cfg.mix or prepared.is_prepared(local_or_hub(cfg.path)):
        if cfg.mix and cfg.path != DataConfig.path:
            log(f"data.mix is set: data.path ({cfg.path}) is not read")
        train, val, summary, directory = prepared.load(cfg, tokenizer, seq_len, log)
        return Prepared(train, val, directory, True, summary)
    raw = load_raw(cfg)
    train_raw, val_raw = split_train_val(raw, cfg, seed)
    check_fields(train_raw, cfg)  # on every rank, so a bad field fails everywhere instead of leaving one waiting
    fingerprints = [dataset_fingerprint(d) for d in (train_raw, val_raw) if d is not None]
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    path = root / cache_key(cfg, seq_len, seed, tokenizer, fingerprints)
    hit = (path / "done").exists()
    if not hit:
        with CacheWriter(path) as writer:  # None: another rank (here or on a node sharing this disk) writes it
            if writer is not None:
                _write_cache(writer.tmp, path, cfg, tokenizer, seq_len, train_raw, val_raw)
    stats = json.loads((path / STATS).read_text())
    if not stats["train"]["sequences"]:  # every rank reads the same record and gives the same answer
        train_stats = stats["train"]
        if cfg.format == "text":
            hint = "provide longer or more documents, or lower train.seq_len"
        elif train_stats.get("no_reply", 0) == train_stats["examples"]:  # seq_len would not help
            hint = (f"none of its {train_stats['examples']:,} examples has a reply to learn from (an assistant turn "
                    f"or a response: the loss is taken on those); check data.format={cfg.format} and its fields")
        else:
            hint = (f"all {train_stats['examples']:,} examples are longer than train.seq_len (no reply token "
                    f"fits); raise train.seq_len")
        raise UserError(f"dataset '{cfg.path}' gives no training sequences of length {seq_len}: {hint}")
    loaded = datasets.load_from_disk(str(path))
    train = loaded["train"].with_format("torch")
    val = loaded["validation"].with_format("torch") if "validation" in loaded else None
    return Prepared(train, val, path, hit, report(stats["train"], seq_len))


def _write_cache(tmp: Path, path: Path, cfg: DataConfig, tokenizer, seq_len: int, train_raw, val_raw) -> None:
    """Tokenize both splits into `tmp`, which CacheWriter publishes as `path`."""
    import datasets

    size = train_raw.data.nbytes
    print(f"tokenizing {cfg.path} ({len(train_raw):,} training rows) into {path}; once, reused by later runs",
          file=sys.stderr, flush=True)
    if cfg.format == "text" and size > LARGE_CORPUS_BYTES:
        print(f"note: {cfg.path} is {size / 2**30:.1f} GiB of text: every run and every node without this cache pays "
              f"this tokenization inside the job. Tokenize it once, in parallel, with `python -m "
              f"dstrain.prepare_data --data.path={cfg.path} --output DIR --workers N`, then train with "
              f"data.path=DIR (memory-mapped shards, no start-up cost; docs/data.md)",
              file=sys.stderr, flush=True)
    splits, stats = {}, {}
    for name, split in (("train", train_raw), ("validation", val_raw)):
        if split is not None:
            tokenized, stats[name] = tokenize(split, cfg, tokenizer, seq_len)
            if len(tokenized):  # datasets cannot load back a saved split with no rows (IndexError)
                splits[name] = tokenized
    if splits:
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / STATS).write_text(json.dumps(stats))
    (tmp / "done").write_text("ok\n")


class CacheWriter:
    """Exactly one writer for a cache directory among every process that can see it, through a lock file made
    with O_EXCL: on a node-local disk one rank per node writes; on shared storage one rank of the whole job does.
    The others wait for the published directory by polling the file system, with no collective (and so no
    backend timeout) however long tokenizing takes. The writer refreshes its lock; a lock left unrefreshed for
    LOCK_STALE_S (its writer died) is taken over. Written by hand: `datasets` and filelock offer locks, but not
    the wait-for-publication with a dead-writer takeover this needs."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = path.parent / f"{path.name}.lock"
        self.tmp = path.parent / f".tmp-{path.name}-{socket.gethostname()}-{os.getpid()}"
        self._stop = threading.Event()
        self._owner = False

    def _claim(self) -> bool:
        try:
            fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        os.close(fd)
        return True

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_STALE_S / 6):
            try:
                os.utime(self.lock)
            except OSError:
                return

    def __enter__(self) -> CacheWriter | None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        said = False
        while not (self.path / "done").exists():
            if self._claim():
                if (self.path / "done").exists():  # published between our check and the claim
                    self.lock.unlink(missing_ok=True)
                    return None
                self._owner = True
                threading.Thread(target=self._refresh, daemon=True, name="cache-lock").start()
                shutil.rmtree(self.tmp, ignore_errors=True)
                return self
            try:
                age = time.time() - self.lock.stat().st_mtime
                holder = self.lock.read_text().strip()
            except OSError:  # released or taken over just now
                continue
            if age > LOCK_STALE_S:  # its writer died: one waiter removes it (rename is atomic), all retry
                try:
                    os.rename(self.lock, f"{self.lock}.stale-{os.getpid()}")
                    os.unlink(f"{self.lock}.stale-{os.getpid()}")
                except OSError:
                    pass
                continue
            if not said:
                print(f"waiting for {holder} to tokenize into {self.path}", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)
        return None

    def __exit__(self, kind, error, tb) -> None:
        if not self._owner:
            return
        self._stop.set()
        try:
            if kind is None:
                try:
                    self.tmp.rename(self.path)
                except OSError:  # published by a writer that took over a lock it thought dead
                    shutil.rmtree(self.tmp, ignore_errors=True)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self.lock.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- batching

def _stack(rows: dict) -> dict[str, torch.Tensor]:
    batch = {k: v.long() for k, v in rows.items()}
    if "labels" not in batch:
        batch["labels"] = batch["input_ids"].clone()
    return batch


def shard_sequence(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s 1/size slice of every sequence, for Ulysses sequence parallelism: position_ids (0.. unless
    the row is packed) and labels shifted to the token they are predicted from (shift_labels[t] is the target
    of position t) before cutting, so a slice's last token keeps its target in the next slice. The slices of
    all ranks together hold each label once."""
    input_ids = batch["input_ids"]
    length = input_ids.shape[1]
    if length % size:
        raise UserError(f"a batch of {length} tokens per sequence does not split over sequence_parallel_size={size}; "
                        f"choose train.seq_len divisible by {size}")
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length).expand_as(input_ids)
    labels = out.pop("labels")
    out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    chunk = length // size
    return {k: v[:, rank * chunk:(rank + 1) * chunk].contiguous() for k, v in out.items()}


def _for_layout(batch: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    if layout.sequence_parallel > 1:
        return shard_sequence(batch, layout.sequence_parallel_rank, layout.sequence_parallel)
    return batch


class TrainStream:
    """Global batch `step` holds stream samples [step*G, (step+1)*G); sample k is the dataset's own order when it
    has one (a mix of prepared sources), else element k % n of epoch k // n's permutation keyed by the seed
    (data/order.py), so each epoch is reshuffled and any step can be re-created."""

    def __init__(self, dataset, micro_batch_size: int, grad_accum_steps: int, layout: Layout, seed: int,
                 pin_memory: bool = False):
        self.dataset, self.seed, self.pin_memory = dataset, seed, pin_memory  # pinned: asynchronous copies to GPU
        # ranks of one model replica (pipeline stages, tensor-parallel peers) read the same samples
        self.micro, self.accum = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size = layout.data_parallel_rank, layout.data_parallel
        self.layout = layout
        self.global_batch = layout.global_batch(micro_batch_size, grad_accum_steps)
        self.offset = 0  # samples ahead of step * global_batch (a run resumed with another global batch)
        self.sample_index = dataset.order(seed) if hasattr(dataset, "order") else EpochOrder(len(dataset), [seed])

    def resume(self, step: int, samples: int) -> None:
        """Continue after `samples` stream samples were consumed by `step` steps: none skipped or repeated."""
        self.offset = samples - step * self.global_batch

    def global_batch_indices(self, step: int) -> list[int]:
        start = step * self.global_batch + self.offset
        return [self.sample_index(k) for k in range(start, start + self.global_batch)]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's grad_accum_steps micro-batches of global batch `step`."""
        out = []
        if hasattr(self.dataset, "note_samples"):  # a mix says when a source starts another epoch
            first = step * self.global_batch + self.offset
            self.dataset.note_samples(first, first + self.global_batch)
        for m in range(self.accum):
            start = step * self.global_batch + self.offset + (m * self.dp_size + self.dp_rank) * self.micro
            idx = [self.sample_index(k) for k in range(start, start + self.micro)]
            batch = _for_layout(_stack(self.dataset[idx]), self.layout)
            out.append({k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch)
        return out


def eval_batches(dataset, micro_batch_size: int, layout: Layout,
                 max_batches: int | None = None) -> list[dict[str, torch.Tensor]]:
    """This rank's strided share of the validation split; every rank gets the same number of batches."""
    dp_rank, dp_size = layout.data_parallel_rank, layout.data_parallel
    per_rank = len(dataset) // dp_size
    idx = list(range(dp_rank, per_rank * dp_size, dp_size))
    batches = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    if max_batches is not None:
        batches = batches[:max_batches]
    out = [_stack(dataset[b]) for b in batches]
    if layout.sequence_parallel > 1:  # Ulysses' attention is built for micro_batch_size rows: fill the last batch
        out = [_fill_rows(b, micro_batch_size) for b in out]
    return [_for_layout(b, layout) for b in out]


def _fill_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """The batch with rows added (copies of its first, every label ignored): they add no loss and no count."""
    missing = rows - batch["input_ids"].shape[0]
    if missing <= 0:
        return batch
    out = {k: torch.cat([v, v[:1].expand(missing, -1)]) for k, v in batch.items()}
    out["labels"][-missing:] = IGNORE_INDEX
    if "attention_mask" in out:
        out["attention_mask"][-missing:] = 0
    return out
