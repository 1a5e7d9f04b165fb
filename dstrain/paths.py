"""Where the repository is, and how a name in a recipe becomes a local path or stays a Hub id. Imported by
config.py and chat_templates.py alike (it imports nothing of ours, so neither imports the other)."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def local_or_hub(name: str) -> str:
    """A path that exists as given or relative to the repo root (recipes use repo-relative paths), else
    the name unchanged (a Hugging Face Hub id)."""
    for candidate in (Path(name).expanduser(), REPO_ROOT / name):
        if candidate.exists():
            return str(candidate)
    return name


def weights_fingerprint(name: str) -> str:
    """What identifies a model's weights without reading them: each weight file's name, size and modification time
    for a local directory; the name for a Hub id (its revision is what the Hub cache holds)."""
    path = Path(local_or_hub(name))
    if not path.is_dir():
        return name
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") or p.name == "config.json")
    return f"{path.resolve()}|" + "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)

