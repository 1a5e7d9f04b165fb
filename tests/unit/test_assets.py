"""Shipped generated files are exactly what their scripts produce (so they can be trusted and rebuilt)."""
import hashlib
import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_assets_regenerate_identically(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_assets.py"), "--data_dir", str(tmp_path / "data"),
                    "--model_dir", str(tmp_path / "model"), "--moe_dir", str(tmp_path / "moe"), "--vlm_dir",
                    str(tmp_path / "vlm")], check=True, capture_output=True)
    examples = [f"examples/{p.name}" for p in sorted((ROOT / "data/examples").iterdir())]
    for rel in ("tiny/train.jsonl", "tiny/val.jsonl", "tiny_sft/train.jsonl", "tiny_chat/train.jsonl", "tiny_dpo/train.jsonl",
                "tiny_grpo/train.jsonl",
                *examples):
        assert digest(tmp_path / "data" / rel) == digest(ROOT / "data" / rel), rel
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert digest(tmp_path / "model" / name) == digest(ROOT / "recipes/tiny/model" / name), name
    # the tiny vision-language recipe's rows, images and processor files
    images = sorted(p.name for p in (ROOT / "data/tiny_vlm/images").iterdir())
    assert images == sorted(p.name for p in (tmp_path / "data/tiny_vlm/images").iterdir()) and len(images) == 800
    for rel in ("tiny_vlm/train.jsonl", *(f"tiny_vlm/images/{name}" for name in images[::97])):
        assert digest(tmp_path / "data" / rel) == digest(ROOT / "data" / rel), rel
    for name in ("tokenizer.json", "chat_template.jinja", "processor_config.json"):
        assert digest(tmp_path / "vlm" / name) == digest(ROOT / "recipes/tiny/vlm_model" / name), name
    # the tiny MoE recipe's model config (transformers writes its own version into it)
    made, shipped = (json.loads((d / "config.json").read_text())
                     for d in (tmp_path / "moe", ROOT / "recipes/tiny/moe_model"))
    assert {k: v for k, v in made.items() if k != "transformers_version"} == \
        {k: v for k, v in shipped.items() if k != "transformers_version"}
    made, shipped = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "vlm", ROOT / "recipes/tiny/vlm_model"))
    made["text_config"].pop("transformers_version", None), shipped["text_config"].pop("transformers_version", None)
    assert {k: v for k, v in made.items() if k != "transformers_version"} == \
        {k: v for k, v in shipped.items() if k != "transformers_version"}


def test_ds_configs_match_their_generator():
    make_ds_configs = SimpleNamespace(**runpy.run_path(str(ROOT / "scripts/make_ds_configs.py")))
    shipped = {p.name for p in (ROOT / "ds_configs").glob("*.json")}
    generated = make_ds_configs.configs()
    assert set(generated) == shipped  # every shipped JSON comes from the generator
    for name, cfg in generated.items():
        assert (ROOT / "ds_configs" / name).read_text() == make_ds_configs.render(cfg), name
