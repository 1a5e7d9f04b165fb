"""Issue 85's probe at a run's start, through train.py: a family nobody has seen (a model with remote code, its
classes in the model's folder) is checked on a small random copy of its own config before it packs. One whose layers
carry state across positions is refused in one line naming its module; an attention-only one trains, and says what
was checked."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_errors import QUICK, fails
from tests.helpers import ROOT, launch

CONFIGURATION = '''from transformers import LlamaConfig


class ShiftConfig(LlamaConfig):
    model_type = "shift_probe"

    def __init__(self, shift=True, **kwargs):
        self.shift = shift
        super().__init__(**kwargs)
'''
# the layer as source text: the remote-code model's own file here, exec'd by tests/unit/test_families.py
TOKEN_SHIFT = '''import torch


class TokenShift(torch.nn.Module):
    """The MLP plus half of the previous position's input: a layer that carries state across positions."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) + 0.5 * torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
'''
MODELING = TOKEN_SHIFT + '''
from transformers import LlamaForCausalLM

from .configuration_shift import ShiftConfig


class ShiftForCausalLM(LlamaForCausalLM):
    config_class = ShiftConfig

    def __init__(self, config):
        super().__init__(config)
        if config.shift:
            for layer in self.model.layers:
                layer.mlp = TokenShift(layer.mlp)
'''
PACKED = ["--data.path=data/tiny_sft", "--data.format=prompt_response", "--data.packing=true",
          "--model.trust_remote_code=true"]


def remote_model(folder: Path, shift: bool) -> Path:
    """The tiny Llama's config (2 layers) as a remote-code family of its own, no weights (trained from scratch)."""
    config = json.loads((ROOT / "recipes/tiny/model/config.json").read_text())
    config.update(model_type="shift_probe", architectures=["ShiftForCausalLM"], shift=shift, num_hidden_layers=2,
                  auto_map={"AutoConfig": "configuration_shift.ShiftConfig",
                            "AutoModelForCausalLM": "modeling_shift.ShiftForCausalLM"})
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_shift.py").write_text(CONFIGURATION)
    (folder / "modeling_shift.py").write_text(MODELING)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes/tiny/model" / name, folder / name)
    return folder


@pytest.mark.parametrize("shift", [True, False])
def test_a_family_with_remote_code_is_checked_at_its_first_run(tmp_path, cache, shift):
    model = remote_model(tmp_path / ("shift" if shift else "plain"), shift)
    args = [f"--model.name_or_path={model}", *PACKED]
    if shift:
        line = fails(args, cache, tmp_path, "data.packing with shift_probe: layer 0's mlp (TokenShift) moves "
                                            "information between packed documents")
        assert line.endswith("set data.packing=false")
        return
    proc = launch(QUICK + args + ["--output_dir", str(tmp_path / "run")], cache, launcher="warm-python")
    assert "layout check: shift_probe on a small random copy (2 layers, 64 wide): packing exact" in proc.stderr, \
        proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"
    # its export carries the family's code (model_config/ had only the configuration's module before issue 85)
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", trust_remote_code=True)
    assert type(exported).__name__ == "ShiftForCausalLM" and exported.config.shift is False
