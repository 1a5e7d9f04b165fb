"""The tokenized-data cache: a run's splits tokenized once (one writer per cache entry, the other ranks and
nodes wait on its file) and reused by later runs; or a prepared corpus (or mix) memory-mapped instead."""
from __future__ import annotations

import functools
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

from .. import env
from ..config import DataConfig
from ..errors import UserError
from ..parallel.ds_internals import dataset_fingerprint
from ..paths import local_or_hub
from ..vision import processor_of
from .formats import check_fields, check_rows, failing_row, images, layout_of, report, tokenize, tokenizer_fingerprint
from .load import load_raw, row_location, split_train_val

STATS = "stats.json"  # counts of a tokenized cache: documents/examples, sequences, truncated, dropped


def cache_key(cfg: DataConfig, seq_len: int, seed: int, tokenizer, raw_fingerprints: list[str]) -> str:
    payload = json.dumps({"data": asdict(cfg) | {"cache_dir": None, "num_proc": None}, "seq_len": seq_len,
                          "seed": seed, "tokenizer": tokenizer_fingerprint(tokenizer), "raw": raw_fingerprints,
                          "version": 4}, sort_keys=True, default=str)
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
    val_rows: int | None = None  # raw rows of the validation split (None: there is none), for data.amount


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
    cfg = layout_of(train_raw, cfg, log)  # TRL's SFT layouts read as their columns say
    check_fields(train_raw, cfg)  # on every rank, so a bad field fails everywhere instead of leaving one waiting
    if processor_of(tokenizer) is None:  # images in the rows of a text model: one line, not trained without them
        images.refuse_for_text_model(train_raw, cfg)
    fingerprints = [dataset_fingerprint(d) for d in (train_raw, val_raw) if d is not None]
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    path = root / cache_key(cfg, seq_len, seed, tokenizer, fingerprints)
    hit = (path / "done").exists()
    if not hit:
        with CacheWriter(path) as writer:  # None: another rank (here or on a node sharing this disk) writes it
            if writer is not None:
                splits = {name: split for name, split in raw.items() if name in (cfg.train_split, cfg.val_split)}
                locate = {name: functools.partial(row_location, cfg, name, len(split))  # before the carve-out
                          for name, split in splits.items()}
                for name, split in splits.items():
                    check_rows(split, cfg, locate[name])
                try:
                    _write_cache(writer.tmp, path, cfg, tokenizer, seq_len, train_raw, val_raw)
                except UserError:
                    raise
                except Exception:  # a row the checks let through but the tokenizer or chat template refuses
                    for name, split in splits.items():
                        found = failing_row(split, cfg, tokenizer, seq_len, locate[name])
                        if found:
                            raise found from None
                    raise
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
    return Prepared(train, val, path, hit, report(stats["train"], seq_len),
                    stats["validation"]["examples" if "examples" in stats["validation"] else "documents"]
                    if "validation" in stats else None)


def _write_cache(tmp: Path, path: Path, cfg: DataConfig, tokenizer, seq_len: int, train_raw, val_raw) -> None:
    """Tokenize both splits into `tmp`, which CacheWriter publishes as `path`."""
    import datasets

    size = train_raw.data.nbytes
    print(f"tokenizing {cfg.path} ({len(train_raw):,} training rows) into {path}; once, reused by later runs",
          file=sys.stderr, flush=True)
    if cfg.format == "text" and size > LARGE_CORPUS_BYTES:
        print(f"note: {cfg.path} is {size / 2**30:.1f} GiB of text: every run and every node without this cache pays "
              f"this tokenization inside the job. Tokenize it once, in parallel, with `python -m "
              f"dstrain.data.prepare_corpus --data.path={cfg.path} --output DIR --workers N`, then train with "
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
