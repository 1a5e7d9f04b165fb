"""Datasets: load through `datasets`, tokenize once (cached), pack or mask, and hand each data-parallel rank its
distinct share of every global batch in a seeded order that is a pure function of the step.

Because batch contents depend only on (seed, step), the data position in a checkpoint is the step itself:
resuming at step k reproduces exactly the batches an uninterrupted run would have seen.

  load.py      a dataset through `datasets` (Hub id, files, directory, saved dataset); the validation split
  formats/     one module per data.format (text, prompt_response, alpaca, chat, preference) behind one
               interface; report()
  amount.py    epochs, a global batch larger than the data, a validation split with nothing to evaluate
  cache.py     prepare(): tokenized once into the cache by one writer, reused; or a prepared corpus / mix
  prepared.py  corpora written by `python -m dstrain.data.prepare_corpus`, memory-mapped; weighted mixes
  order.py     the epoch order (numpy's permutation, or a lazy keyed one for big corpora)
  stream.py    TrainStream (this rank's micro-batches of step k), eval_batches, sequence-parallel slices
  inspect.py   `python -m dstrain.data.inspect`: the first rows tokenized as a run does, trained tokens marked
This package's names below are what the rest of dstrain uses.
"""
from __future__ import annotations

from . import amount
from .cache import Prepared, cache_key, default_cache_dir, prepare
from .formats import check_fields, report, tokenize, tokenizer_fingerprint
from .formats.sft import IGNORE_INDEX, pack_examples, sft_example
from .formats.text import pack_texts
from .load import load_raw, split_train_val
from .stream import TrainStream, eval_batches, shard_sequence

__all__ = ["IGNORE_INDEX", "amount", "Prepared", "TrainStream", "cache_key", "check_fields", "default_cache_dir",
           "eval_batches", "load_raw", "pack_examples", "pack_texts", "prepare", "report", "shard_sequence",
           "sft_example", "split_train_val", "tokenize", "tokenizer_fingerprint"]
