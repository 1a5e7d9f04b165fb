"""Pipeline stages built from unmodified HF models, against the single-process reference: per-step losses,
the exported model's logits, exact resume. The combinations that cannot work are refused in one line before anything
is built: ZeRO-2/3 with stages (tests/unit/test_pipeline_unit.py; through torchrun, one rank slow to say it:
tests/e2e/test_faults.py), a world the stages do not divide (tests/unit/test_layout.py; through the hostfile
launcher: tests/cluster/test_hostfile.py), a misspelled pipeline key (tests/unit/test_ds_config.py). Each was a
torchrun launch of its own here (51 s).
"""
import json

import pytest
import torch

from tests.e2e.test_vs_reference import STEPS, run_and_compare
from tests.helpers import assert_resume_exact, metrics


def exported_eval_loss(run_dir, rows_used):
    import datasets
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    val = datasets.load_from_disk(json.loads((run_dir / "run_info.json").read_text())["data_cache"])["validation"]
    rows = val.with_format("torch")[:rows_used]["input_ids"].long()
    with torch.no_grad():
        logits = model(rows).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                             rows[:, 1:].reshape(-1)).item(), model


@pytest.fixture(scope="module")
def tied_in_config_only(tmp_path_factory, tiny_llama):
    """Issue 16: a config that ties embeddings over a file that also holds a distinct lm_head.weight (config
    edited after saving; such files exist). transformers loads it untied; the pipeline used the embedding as the
    head (step-1 loss 6.2545 against 6.2981 on one rank)."""
    import shutil

    from safetensors.torch import load_file, save_file
    out = tmp_path_factory.mktemp("models") / "tied-in-config-only"
    shutil.copytree(tiny_llama, out)
    state = load_file(out / "model.safetensors")
    torch.manual_seed(1)
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"]) * 0.02
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    return out


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gpt2", "tied_in_config_only", "tiny_mistral_window"])
def test_two_stages_match_reference_and_export(tmp_path, cache, family, request):
    """tiny_mistral_window: each stage's decoder wrapper builds the sliding-window mask (issue 85; with the plain
    causal mask the wrappers built before and the layout check off: 6.4211 against the reference's 6.4170 at step 1,
    every step off, largest relative gap 2.2e-3; with the check on, that run is refused before anything is built)."""
    model_dir = request.getfixturevalue(family)
    run_dir, ref_model = run_and_compare(tmp_path, cache, model_dir, "pipe2_zero1.json")
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["data_parallel"] == 1 and info["world_size"] == 2
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert len(list(ckpt.glob("layer_*-model_states.pt"))) >= 4   # saved stage by stage
    # eval on the single data-parallel replica: 2 batches of 4 -> validation rows 0..7
    loss, exported = exported_eval_loss(run_dir, 8)
    _, evals = metrics(run_dir)
    assert evals[-1]["step"] == STEPS and loss == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    ids = torch.arange(5, 60).view(1, -1)
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, ref_model.eval()(ids).logits, atol=1e-3, rtol=1e-3)


def test_pipeline_resume_is_exact(tmp_path, cache, tiny_llama):
    assert_resume_exact(tmp_path, cache, tiny_llama, "pipe2_zero1.json")
