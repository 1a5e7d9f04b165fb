"""Tokenize a text corpus once, offline and in parallel, into memory-mapped token shards that any number of ranks
read directly (train with data.path=OUTPUT, or several with data.mix).

    python -m dstrain.data.prepare_corpus --recipe recipes/llama-3.1-8b/pretrain.yaml --output /data/fw --workers 16
    python -m dstrain.data.prepare_corpus --data.path=corpus.jsonl --model.name_or_path=recipes/tiny/model --output DIR
    sbatch --array=0-31 launch/slurm_prepare_data.sbatch   # 32 array tasks, each its share of the shards

The recipe's data and model sections (and the same --data.* / --model.* overrides as train.py) say what to read
and with which tokenizer. The corpus is cut into shards of --shard_documents documents in its own order (the
validation split carved out exactly as training would); each shard is Megatron's indexed format (.bin: the
tokens, each document followed by EOS; .idx: document lengths and offsets), written by one worker under a
temporary name and published by rename with a small .json record. So:
  - a killed run keeps every finished shard and redoes the rest when run again with the same arguments;
  - output is byte-identical for the same input and tokenizer, whatever --workers or array tasks did it;
  - SLURM array tasks (SLURM_ARRAY_TASK_ID / _COUNT, or --task I/N) each write shards i with i % N == I; the
    task that finds every shard written writes manifest.json (tokenizer and its hash, sources, shards, counts).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

from .. import cli, data, env
from ..config import load_recipe, parse_overrides
from ..errors import UserError
from ..parallel import ds_internals
from ..paths import local_or_hub
from ..run import faults
from . import prepared

_JOB: dict = {}  # what forked workers inherit: the splits, tokenizer and output directory


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     epilog="Recipe keys as in train.py: --data.path=corpus.jsonl "
                                            "--data.text_field=content --model.tokenizer=...")
    parser.add_argument("--recipe", default=None, help="YAML in recipes/ or a path (its data and model sections)")
    parser.add_argument("--output", required=True, help="directory for the shards and manifest.json")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes on this machine (default 1)")
    parser.add_argument("--shard_documents", type=int, default=100_000,
                        help="documents per shard (default 100000); part of what the output is: keep it on reruns")
    parser.add_argument("--task", default=None, metavar="I/N",
                        help="write only shards i with i %% N == I (default: from SLURM_ARRAY_TASK_ID and "
                             "SLURM_ARRAY_TASK_COUNT when set, else every shard)")
    args, rest = parser.parse_known_args(argv)
    return args, parse_overrides(rest)


def task_of(arg: str | None) -> tuple[int, int]:
    if arg is None:
        return env.array_task() or (0, 1)
    index, sep, count = arg.partition("/")
    if not (sep and index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise UserError(f"--task {arg} must be I/N with 0 <= I < N, e.g. --task 0/4")
    return int(index), int(count)


def source_files(path: str) -> list[dict]:
    """Name and size of each local file the corpus comes from (nothing for a hub id: its fingerprint says it)."""
    location = Path(local_or_hub(path))
    if location.is_file():
        return [{"name": location.name, "bytes": location.stat().st_size}]
    if location.is_dir():
        return [{"name": str(f.relative_to(location)), "bytes": f.stat().st_size}
                for f in sorted(location.rglob("*"))
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(location).parts)]
    return []


def shard_plan(splits: dict, per_shard: int) -> list[tuple[str, str, int, int]]:
    """(split, shard name, first document, end) for every shard, in the corpus's order."""
    out = []
    for split, rows in splits.items():
        for i, start in enumerate(range(0, len(rows), per_shard)):
            out.append((split, f"{split}-{i:05d}", start, min(start + per_shard, len(rows))))
    return out


def _sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def write_shard(job: tuple[str, str, int, int]) -> dict:
    """Tokenize documents [start, end) of a split into <name>.bin/.idx, published by rename, then <name>.json."""
    split, name, start, end = job
    rows, tokenizer, output = _JOB["splits"][split], _JOB["tokenizer"], _JOB["output"]
    field, dtype, eos = _JOB["text_field"], _JOB["dtype"], tokenizer.eos_token_id
    partial = {suffix: output / f"{name}.{suffix}.partial" for suffix in ("bin", "idx", "json")}
    builder = prepared.megatron_datasets()[0].IndexedDatasetBuilder(str(partial["bin"]), dtype=dtype)
    tokens = 0
    for first in range(start, end, 1000):
        texts = rows[first:min(first + 1000, end)][field]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.append(eos)  # as the in-job path packs text: each document ends with EOS
            builder.add_document(ids, [len(ids)])
            tokens += len(ids)
    builder.finalize(str(partial["idx"]))
    faults.point("prepare:shard", 0, int(name.rsplit("-", 1)[1]))  # tests: a kill between the data and its record
    final = {suffix: output / f"{name}.{suffix}" for suffix in ("bin", "idx")}
    for suffix in ("bin", "idx"):
        os.replace(partial[suffix], final[suffix])
    record = {"name": name, "split": split, "documents": end - start, "tokens": tokens,
              "bytes": final["bin"].stat().st_size + final["idx"].stat().st_size,
              "sha256": _sha256(final["bin"], final["idx"])}
    partial["json"].write_text(json.dumps(record, sort_keys=True) + "\n")
    os.replace(partial["json"], output / f"{name}.json")
    return record


def check_output(output: Path, plan: dict) -> None:
    """The output is new, or holds shards of this very plan (a rerun); anything else is left untouched."""
    if (output / prepared.PLAN).is_file():
        existing = json.loads((output / prepared.PLAN).read_text())
        if existing != plan:
            changed = sorted(k for k in set(existing) | set(plan) if existing.get(k) != plan.get(k))
            raise UserError(f"{output} holds shards prepared from other inputs ({', '.join(changed)} differ); "
                            f"choose a new --output, or delete {output} to redo it")
    elif output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output} is not empty and was not written by prepare_data; choose a new directory")


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # array tasks may race to write the same content: the rename keeps one whole


def run(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    recipe = load_recipe(args.recipe, overrides)
    cfg, output = recipe.data, Path(args.output).expanduser()
    if cfg.mix:
        raise UserError("prepare_data reads one corpus: set data.path (data.mix combines prepared directories "
                        "when training)")
    if cfg.format != "text":
        raise UserError(f"prepare_data writes text corpora for pretraining; data.format={cfg.format} (SFT) is "
                        f"tokenized in the job: train on it directly")
    if prepared.is_prepared(local_or_hub(cfg.path)):
        raise UserError(f"data.path {cfg.path} is already a prepared directory; train on it with data.path")
    if args.workers < 1 or args.shard_documents < 1:
        raise UserError("--workers and --shard_documents must be positive integers")
    task, tasks = task_of(args.task)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker: --workers says how many

    from .. import model as models

    tokenizer = models.load_tokenizer(recipe.model)
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos_token; documents are separated by it: set model.tokenizer to one "
                        "that has one")
    raw = data.load_raw(cfg)
    train_raw, val_raw = data.split_train_val(raw, cfg, recipe.train.seed)
    data.check_fields(train_raw, cfg)
    splits = {"train": train_raw} | ({"validation": val_raw} if val_raw is not None and len(val_raw) else {})
    dtype = prepared.megatron_datasets()[0].DType.optimal_dtype(len(tokenizer))
    shards = shard_plan(splits, args.shard_documents)
    plan = {
        "format": prepared.FORMAT,
        "tokenizer": {"name": recipe.model.tokenizer or recipe.model.name_or_path, "class": type(tokenizer).__name__,
                      "hash": data.tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id},
        "dtype": dtype.__name__,
        "source": {"path": cfg.path, "name": cfg.name, "text_field": cfg.text_field, "files": source_files(cfg.path),
                   "fingerprints": [ds_internals.dataset_fingerprint(s) for s in splits.values()],
                   "train_split": cfg.train_split,
                   "validation": (f"split {cfg.val_split}" if cfg.val_split and cfg.val_split in raw else
                                  f"{cfg.val_fraction} of {cfg.train_split} (seed {recipe.train.seed})"
                                  if cfg.val_fraction else None)},
        "shard_documents": args.shard_documents,
        "shard_count": len(shards),
    }
    check_output(output, plan)
    output.mkdir(parents=True, exist_ok=True)
    if not (output / prepared.PLAN).is_file():
        _write_json(output / prepared.PLAN, plan)

    mine = [s for i, s in enumerate(shards) if i % tasks == task]
    todo = [s for s in mine if not (output / f"{s[1]}.json").is_file()]
    documents = sum(end - start for _, _, start, end in todo)
    print(f"prepare_data: {len(shards)} shards of up to {args.shard_documents:,} documents"
          f"{f' (task {task}/{tasks}: {len(mine)})' if tasks > 1 else ''}; {len(mine) - len(todo)} already written, "
          f"{len(todo)} to write ({documents:,} documents) with {args.workers} worker(s) into {output}",
          file=sys.stderr, flush=True)
    _JOB.update(splits=splits, tokenizer=tokenizer, output=output, text_field=cfg.text_field, dtype=dtype)
    started = time.perf_counter()
    records = _write_all(todo, args.workers, documents)
    elapsed = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in records)
    written = sum(r["bytes"] for r in records)
    if records:
        print(f"wrote {len(records)} shards: {documents:,} documents, {tokens:,} tokens, {written / 2**20:,.1f} MiB "
              f"({written / max(tokens, 1):.2f} bytes/token) in {elapsed:.1f} s: {tokens / elapsed:,.0f} tokens/s",
              file=sys.stderr, flush=True)
    return finish(output, plan, shards)


def _write_all(todo: list, workers: int, documents: int) -> list[dict]:
    from tqdm import tqdm

    records = []
    with tqdm(total=documents, unit="doc", unit_scale=True, desc="tokenizing", mininterval=2, file=sys.stderr) as bar:
        if workers == 1:
            for job in todo:
                records.append(write_shard(job))
                bar.update(job[3] - job[2])
            return records
        try:  # forked workers inherit _JOB; a worker that dies (killed, out of memory) breaks the pool, not hangs it
            with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
                for record in pool.map(write_shard, todo):
                    records.append(record)
                    bar.update(record["documents"])
        except BrokenProcessPool:
            raise UserError("a prepare_data worker died (killed or out of memory); finished shards are kept: run the "
                            "same command again to write the rest (fewer --workers if memory ran out)") from None
    return records


def finish(output: Path, plan: dict, shards: list) -> int:
    """Write manifest.json once every shard (of every task) is written; say what is missing otherwise."""
    missing = [name for _, name, _, _ in shards if not (output / f"{name}.json").is_file()]
    if missing:
        print(f"{len(shards) - len(missing)} of {len(shards)} shards written; the task that writes the last one "
              f"writes {prepared.MANIFEST} (run this command again for shards no task wrote: {missing[0]}, ...)",
              file=sys.stderr)
        return 0
    splits: dict = {}
    for split, name, _, _ in shards:
        record = json.loads((output / f"{name}.json").read_text())
        entry = splits.setdefault(split, {"documents": 0, "tokens": 0, "bytes": 0, "shards": []})
        for key in ("documents", "tokens", "bytes"):
            entry[key] += record[key]
        entry["shards"].append({k: record[k] for k in ("name", "documents", "tokens", "bytes", "sha256")})
    _write_json(output / prepared.MANIFEST, plan | {"splits": splits})
    train = splits["train"]
    print(f"{output}: {train['documents']:,} documents, {train['tokens']:,} tokens in {len(train['shards'])} training "
          f"shards ({train['bytes'] / 2**20:,.1f} MiB)"
          + (f"; validation {splits['validation']['tokens']:,} tokens" if "validation" in splits else "")
          + f". Train with --data.path={output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> None:
    cli.exit_with(lambda: run(argv))


if __name__ == "__main__":
    main()
