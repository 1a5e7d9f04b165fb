"""Loading a dataset through Hugging Face `datasets` (a Hub id, files, a directory, a saved dataset) and
carving out the validation split."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import DataConfig
from ..errors import UserError
from ..hub import offline_unless_hub_reachable
from ..paths import local_or_hub

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                 ".text": "text", ".arrow": "arrow"}


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


def row_location(cfg: DataConfig, split: str, rows: int, number: int) -> str:
    """Where the `number`th row (1-based) of a split of `rows` rows lives: 'dataset file F line L' for JSON-lines
    files (datasets skips blank lines and reads a directory's files in sorted order, the split's name starting
    theirs), else "dataset 'X' row N"."""
    path = Path(local_or_hub(cfg.path))
    files = []
    if path.is_file() and path.suffix.lower() == ".jsonl":
        files = [path]
    elif path.is_dir():
        every = sorted(path.glob("*.jsonl"))
        named = [f for f in every if f.name.startswith(split)]
        files = named or ([] if any(f.name.startswith(("train", "valid", "test", "dev")) for f in every) else every)
    seen, found = 0, None
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as handle:
            for line_number, line in enumerate(handle, 1):
                if line.strip():
                    seen += 1
                    if seen == number and found is None:
                        found = f"dataset file {file} line {line_number}"
    if found and seen == rows:  # the files are the split, line for row
        return found
    return f"dataset '{cfg.path}' row {number}" + ("" if split == cfg.train_split else f" of split '{split}'")


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
            offline_unless_hub_reachable(location)  # a missing one fails at once, not after retries
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


VALIDATION_NAMES = ("validation", "valid", "val", "dev")  # the file names `datasets` reads as a validation split


def has_validation(cfg: DataConfig) -> bool:
    """Whether the run will have validation data, decided from the files alone (no dataset is loaded): a carve-out
    (data.val_fraction > 0), or a validation split a local file layout shows. A hub dataset, a saved DatasetDict
    or a prepared corpus may have one: True where the files do not say."""
    if cfg.val_fraction > 0 or cfg.mix:
        return True
    if not cfg.val_split:
        return False
    path = Path(local_or_hub(cfg.path))
    if path.is_file():
        return False
    if not path.is_dir():
        return True  # a hub id: its splits are the hub's
    if (path / "dataset_dict.json").is_file():
        return cfg.val_split in json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
    if (path / "state.json").is_file():
        return False  # one saved Dataset: the train split alone
    from .prepared import is_prepared
    if is_prepared(path):
        return True  # a prepared corpus (data/prepared.py) says so itself
    names = (f.name.lower() for f in path.rglob("*") if f.is_file() and not f.name.startswith("."))
    return any(name.startswith(VALIDATION_NAMES) or name.startswith(cfg.val_split.lower()) for name in names)
