"""Reading a corpus that `python -m dstrain.data.prepare_corpus` tokenized once: memory-mapped token shards (Megatron's
indexed .bin/.idx format), seen as seq_len-token blocks of the concatenated document stream, and weighted
mixes of several such corpora.

Nothing here reads the corpus at start: opening a prepared directory maps its shards and reads its manifest, so
start-up time and host memory per rank do not grow with the corpus (pages are read when a batch needs them).
A sample is a block of the stream (documents, each followed by EOS, cut into seq_len blocks, as the in-job
path packs text); with data.packing, position_ids restart at each document (the index's document starts).
"""
from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..config import DataConfig
from ..errors import UserError
from ..paths import local_or_hub
from .formats import tokenizer_fingerprint
from .order import EpochOrder

MANIFEST = "manifest.json"  # written last: a directory without it is not (yet) a prepared corpus
PLAN = "plan.json"  # written first: what the shards are made from, so a rerun can tell they are its own
FORMAT = "dstrain-prepared/1"
OPEN_SHARDS = 256


def megatron_datasets():
    """Megatron's indexed-dataset module and its C++ helpers (imported on first use: megatron.core's package import
    pulls its model-parallel layers too, ~2 s, and warns that Transformer Engine and Apex are absent, which its
    dataset code does not use)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # also a DeprecationWarning about its inference package
        from megatron.core.datasets import helpers_cpp, indexed_dataset
    return indexed_dataset, helpers_cpp


def is_prepared(path: str | Path) -> bool:
    directory = Path(path).expanduser()
    return directory.is_dir() and ((directory / MANIFEST).is_file() or (directory / PLAN).is_file())


def read_manifest(directory: Path) -> dict:
    if not (directory / MANIFEST).is_file():
        plan = json.loads((directory / PLAN).read_text())
        done = sum(1 for _ in directory.glob("*.json")) - 1
        raise UserError(f"{directory} is not finished ({done} of {plan['shard_count']} shards written); run the "
                        f"same `python -m dstrain.data.prepare_corpus ... --output {directory}` again to complete it")
    manifest = json.loads((directory / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise UserError(f"{directory}/{MANIFEST} is format {manifest.get('format')!r}, this version reads {FORMAT!r}; "
                        f"prepare the corpus again with this version's prepare_data")
    return manifest


class TokenBlocks:
    """One split of a prepared directory as len(self) blocks of seq_len tokens; `self[i]` or `self[[i, j]]` gives
    input_ids (and position_ids restarting at each document when `separate`), like a tokenized `datasets` split."""

    def __init__(self, directory: Path, shards: list[dict], seq_len: int, separate: bool):
        self.directory, self.seq_len, self.separate = directory, seq_len, separate
        self.names = [s["name"] for s in shards]
        # Shards are opened (memory-mapped: one open file each) when a batch first needs them, and at most
        # OPEN_SHARDS at a time: a corpus of 100,000 shards neither slows start-up nor exhausts file handles.
        self._open = functools.lru_cache(maxsize=OPEN_SHARDS)(self._open_shard)
        self.tokens_per_shard = np.array([s["tokens"] for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.tokens_per_shard)])
        self.tokens = int(self.starts[-1])

    def __len__(self) -> int:
        return self.tokens // self.seq_len

    def _open_shard(self, s: int):
        return megatron_datasets()[0].IndexedDataset(str(self.directory / self.names[s]))

    def _pieces(self, start: int, count: int):
        """(shard, first token in it, tokens) covering stream tokens [start, start + count)."""
        while count > 0:
            s = int(np.searchsorted(self.starts, start, side="right")) - 1
            offset = start - int(self.starts[s])
            take = min(count, int(self.tokens_per_shard[s]) - offset)
            yield s, offset, take
            start, count = start + take, count - take

    def _block(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        ids, restarts = [], []
        at = 0
        for s, offset, take in self._pieces(i * self.seq_len, self.seq_len):
            shard = self._open(s)
            size = shard.index.dtype_size
            ids.append(shard.bin_reader.read(shard.index.dtype, take, offset * size))
            if self.separate:  # documents starting inside this piece (each document is one indexed sequence)
                pointers = shard.index.sequence_pointers
                lo = np.searchsorted(pointers, offset * size, side="left")
                hi = np.searchsorted(pointers, (offset + take) * size, side="left")
                restarts.append(at + np.asarray(pointers[lo:hi]) // size - offset)
            at += take
        tokens = np.concatenate(ids).astype(np.int64)
        if not self.separate:
            return tokens, None
        marks = np.zeros(self.seq_len, dtype=bool)
        marks[0] = True  # a document cut by the block's start starts again at position 0
        marks[np.concatenate(restarts).astype(np.int64)] = True
        t = np.arange(self.seq_len)
        return tokens, t - np.maximum.accumulate(np.where(marks, t, 0))

    def __getitem__(self, idx):
        single = np.isscalar(idx)
        rows = [self._block(int(i)) for i in ([idx] if single else idx)]
        out = {"input_ids": torch.from_numpy(np.stack([r[0] for r in rows]))}
        if self.separate:
            out["position_ids"] = torch.from_numpy(np.stack([r[1] for r in rows]))
        return {k: v[0] for k, v in out.items()} if single else out


class Concat:
    """Several sources as one index space: source s holds indices [offsets[s], offsets[s+1])."""

    def __init__(self, sources: list, names: list[str]):
        self.sources, self.names = sources, names
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, idx):
        single = np.isscalar(idx)
        idx = np.asarray([idx] if single else idx, dtype=np.int64)
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        parts = []  # (rows of the request, what source s returned for them)
        for s in np.unique(which):
            rows = np.flatnonzero(which == s)
            parts.append((torch.from_numpy(rows), self.sources[s][(idx[rows] - self.offsets[s]).tolist()]))
        out = {}
        for key, first in parts[0][1].items():
            out[key] = torch.empty((len(idx), *first.shape[1:]), dtype=first.dtype)
            for rows, got in parts:
                out[key][rows] = got[key]
        return {k: v[0] for k, v in out.items()} if single else out


class Mix(Concat):
    """Sources read by weight over the whole run: of the first k global samples, source s supplies
    round(w_s * k) within a sample or two, at every k (Megatron's greedy blending index, which keeps each
    prefix closest to the weights, built once for a block of BLOCK samples and repeated). A source read to
    its end starts another epoch in a new order (logged); none is ever exhausted early."""

    BLOCK = 1 << 16

    def __init__(self, sources: list, names: list[str], weights: list[float], log: Callable[[str], None]):
        _, helpers_cpp = megatron_datasets()
        super().__init__(sources, names)
        self.weights = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.log = log
        source_of = np.zeros(self.BLOCK, dtype=np.int16)
        rank_in_source = np.zeros(self.BLOCK, dtype=np.int64)
        helpers_cpp.build_blending_indices(source_of, rank_in_source, self.weights, len(sources), self.BLOCK, False)
        self.source_of, self.rank_in_source = source_of, rank_in_source
        self.per_block = np.bincount(source_of, minlength=len(sources)).astype(np.int64)
        # cumulative[s][p]: samples of source s among the block's first p
        self.cumulative = np.zeros((len(sources), self.BLOCK + 1), dtype=np.int32)
        for s in range(len(sources)):
            self.cumulative[s, 1:] = np.cumsum(source_of == s)

    def drawn(self, s: int, k: int) -> int:
        """Samples of source s among the first k of the global order."""
        block, position = divmod(k, self.BLOCK)
        return block * int(self.per_block[s]) + int(self.cumulative[s, position])

    def order(self, seed: int) -> Callable[[int], int]:
        orders = [EpochOrder(len(source), [seed, 1 + s]) for s, source in enumerate(self.sources)]

        def sample_index(k: int) -> int:
            block, position = divmod(k, self.BLOCK)
            s = int(self.source_of[position])
            nth = block * int(self.per_block[s]) + int(self.rank_in_source[position])
            return int(self.offsets[s]) + orders[s](nth)
        return sample_index

    def note_samples(self, first: int, end: int) -> None:
        """Log each source that starts another epoch within global samples [first, end)."""
        for s, source in enumerate(self.sources):
            before, after = self.drawn(s, first), self.drawn(s, end)
            if before // len(source) != after // len(source):
                self.log(f"data.mix: {self.names[s]} was read to its end ({len(source):,} sequences); it repeats "
                         f"from global sample ~{first:,} (epoch {after // len(source) + 1} of it, a new order)")


def check_entry(directory: Path, manifest: dict, cfg: DataConfig, tokenizer) -> None:
    if cfg.format != "text":
        raise UserError(f"{directory} is a prepared text corpus; set data.format=text (SFT data is tokenized in the "
                        f"job)")
    made_with = manifest["tokenizer"]
    if made_with["hash"] != tokenizer_fingerprint(tokenizer):
        raise UserError(f"{directory} was tokenized with {made_with['name']} (another vocabulary than this run's "
                        f"tokenizer); prepare it again with this model's tokenizer or set model.tokenizer")


def sources_of(cfg: DataConfig) -> list[tuple[Path, float]]:
    """(directory, weight) of each prepared source: data.mix, else data.path."""
    entries = cfg.mix or [{"path": cfg.path, "weight": 1.0}]
    out = []
    for entry in entries:
        directory = Path(local_or_hub(entry["path"])).expanduser()
        if not is_prepared(directory):
            raise UserError(f"data.mix entry {entry['path']} is not a directory written by prepare_data; run `python "
                            f"-m dstrain.data.prepare_corpus --data.path=<corpus> --output {entry['path']}` first")
        out.append((directory, float(entry["weight"])))
    return out


def load(cfg: DataConfig, tokenizer, seq_len: int, log: Callable[[str], None]):
    """(train, validation or None, summary line, first directory) from data.path or data.mix prepared directories."""
    sources = sources_of(cfg)
    train, val, names, lines = [], [], [], []
    for directory, weight in sources:
        manifest = read_manifest(directory)
        check_entry(directory, manifest, cfg, tokenizer)
        splits = manifest["splits"]
        blocks = TokenBlocks(directory, splits["train"]["shards"], seq_len, cfg.packing)
        if not len(blocks):
            raise UserError(f"{directory} holds {blocks.tokens:,} training tokens, fewer than one sequence of "
                            f"{seq_len}; lower train.seq_len or prepare more text")
        train.append(blocks)
        names.append(str(directory))
        if "validation" in splits:
            held_out = TokenBlocks(directory, splits["validation"]["shards"], seq_len, cfg.packing)
            if len(held_out):
                val.append(held_out)
        lines.append(f"{directory} ({blocks.tokens:,} tokens in {len(blocks.names)} shards -> {len(blocks):,} "
                     f"sequences of {seq_len}{f', weight {weight:g}' if cfg.mix else ''})")
    if cfg.mix:
        dataset = Mix(train, names, [w for _, w in sources], log)
    else:
        dataset = train[0]
    validation = (val[0] if len(val) == 1 else Concat(val, names)) if val else None
    summary = ("memory-mapped, nothing tokenized: " + "; ".join(lines)
               + ("; attention kept within each document" if cfg.packing else ""))
    return dataset, validation, summary, sources[0][0]
