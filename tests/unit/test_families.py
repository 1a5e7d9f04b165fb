"""Issue 85: the layouts that cut sequences (packing, Ulysses / ring) checked per family on a small random copy of the
run's config (dstrain/families.py), in process. Families whose layers carry state across positions are refused in
one line naming the module; attention-only families hold to fp32 rounding, sliding windows included under a split
(the Ulysses sdpa wrapper ignored the window: seen failing with the window dropped)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from dstrain import families
from dstrain.errors import UserError
from dstrain.parallel.layout import Layout


def cells(config) -> dict[str, families.Cell]:
    small = families.small_copy(config)
    model = families.build(small)
    return {name: families.run_check(name, model, small) for name in ("packing", "sequence split")}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "mistral"])
def test_attention_only_families_hold_under_packing_and_a_split(family):
    config = AutoConfig.for_model(family)
    if family == "mistral":
        config.sliding_window = 4096  # a window that the copy cuts to 16 of the probe's 64 positions
    got = cells(config)
    assert all(c.holds for c in got.values()), {k: (c.difference, c.culprit) for k, c in got.items()}


@pytest.mark.parametrize("family,module", [("bamba", "BambaMixer"), ("qwen3_next", "Qwen3NextGatedDeltaNet"),
                                           ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
                                           ("jamba", "JambaMambaMixer"), ("falcon_h1", "FalconH1")])
def test_state_space_families_are_refused_naming_the_layer(family, module):
    """The trial's silent cases: packing 'kept attention within each document' while the state crossed (bamba
    0.37, qwen3_next 0.054, falcon_h1 / jamba ~1e-3), and Ulysses cut their recurrences between ranks."""
    got = cells(AutoConfig.for_model(family))
    for cell in got.values():
        assert not cell.holds, (family, cell)
        assert module in (cell.culprit or ""), (family, cell.culprit)
    line = families.refusal(family, got["packing"])
    assert line.startswith(f"data.packing with {family}: ") and line.endswith("set data.packing=false")
    assert "\n" not in line and module in line


def test_lfm2s_short_convolutions_are_refused():
    config = AutoConfig.for_model("lfm2", full_attn_idxs=[1])  # its released models: convolutions, some attention
    got = cells(config)
    assert not got["packing"].holds and "Lfm2ShortConv" in got["packing"].culprit


def test_a_sliding_window_is_applied_under_the_split(monkeypatch):
    """gemma3_text with a window of 16 over 64 positions: the split's attention (packed_sdpa, what Ulysses calls)
    must cut the window; with the window ignored (the code before issue 85) the check fails on the attention."""
    config = AutoConfig.for_model("gemma3_text")
    assert cells(config)["sequence split"].holds
    from dstrain.components import sequence_parallel
    original = sequence_parallel.document_mask
    monkeypatch.setattr(sequence_parallel, "document_mask", lambda positions, window=None: original(positions))
    cell = cells(config)["sequence split"]
    assert not cell.holds and "Gemma3Attention" in cell.culprit, cell


def test_document_mask_cuts_the_window_as_transformers_does():
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    from dstrain.components.sequence_parallel import document_mask
    n, window = 12, 4
    rule = and_masks(causal_mask_function, sliding_window_overlay(window))
    theirs = torch.tensor([[bool(rule(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(k)))
                            for k in range(n)] for q in range(n)])
    assert torch.equal(document_mask(torch.arange(n)[None], window)[0, 0], theirs)
    assert document_mask(torch.arange(n)[None], n) is None  # a window that covers the row cuts nothing
    packed = document_mask(torch.cat([torch.arange(5), torch.arange(7)])[None], window)[0, 0]
    assert not packed[6, 4] and packed[6, 5] and not packed[11, 7] and packed[11, 8]


# --------------------------------------------------------------------------- a family nobody has seen, at its run
def _token_shift():
    """The layer tests/e2e/test_model_families.py's remote-code model carries: an MLP plus half of the previous
    position's input, a layer that carries state across positions."""
    from tests.e2e.test_model_families import TOKEN_SHIFT
    namespace: dict = {}
    exec(TOKEN_SHIFT, namespace)  # noqa: S102 - the test's own source text
    return namespace["TokenShift"]


def _register():
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    token_shift = _token_shift()

    class ShiftConfig(LlamaConfig):
        model_type = "probe_shift"

    class ShiftForCausalLM(LlamaForCausalLM):
        config_class = ShiftConfig

        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.mlp = token_shift(layer.mlp)

    class PlainConfig(LlamaConfig):
        model_type = "probe_plain"

    class PlainForCausalLM(LlamaForCausalLM):
        config_class = PlainConfig

    for config, model in ((ShiftConfig, ShiftForCausalLM), (PlainConfig, PlainForCausalLM)):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
    return ShiftConfig, PlainConfig


def _setup(config, packing=False, sp=1, check=True, chunk=0, checkpointing=False):
    said = []
    recipe = SimpleNamespace(data=SimpleNamespace(packing=packing), model=SimpleNamespace(check_layouts=check),
                             train=SimpleNamespace(loss_chunk_tokens=chunk, activation_checkpointing=checkpointing))
    layout = Layout(world_size=sp, sequence_parallel=sp)
    return SimpleNamespace(recipe=recipe, layout=layout, model_config=config, log=said.append), said


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTRAIN_CACHE", str(tmp_path / "cache"))  # verdicts kept per test, not in ~/.cache


def test_an_unseen_family_that_carries_state_is_refused_at_its_first_run():
    shift, plain = _register()
    config = shift(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2)
    for packing, sp, starts in ((True, 1, "data.packing with probe_shift: layer 0's mlp (TokenShift)"),
                                (False, 2, "sequence_parallel_size=2 with probe_shift: layer 0's mlp (TokenShift)")):
        setup, _ = _setup(config, packing=packing, sp=sp)
        with pytest.raises(UserError) as e:
            families.check(setup)
        assert str(e.value).startswith(starts) and "\n" not in str(e.value), str(e.value)
    setup, said = _setup(config, packing=True, check=False)
    families.check(setup)  # skipped on request, and said
    assert said == ["layout check skipped (model.check_layouts=false): packing not verified for probe_shift"]
    setup, said = _setup(plain(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2), packing=True, sp=2)
    families.check(setup)  # attention only: trains, and the log says what was checked
    assert len(said) == 1 and said[0].startswith("layout check: probe_plain on a small random copy (4 layers, 64 "
                                                 "wide): packing exact"), said
    assert "sequence split exact" in said[0] and " s; model.check_layouts=false skips it)" in said[0]
    families.check(setup)  # the other ranks, a resume, a relaunch: the verdict kept
    assert "(checked before: " in said[1] and said[1].split(" (")[0] == said[0].split(" (")[0], said
    for _ in range(2):  # a refusal kept is a refusal
        with pytest.raises(UserError, match="data.packing with probe_shift"):
            families.check(_setup(shift(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2), packing=True)[0])


def test_nothing_is_checked_without_a_layout_that_cuts_sequences():
    shift, _ = _register()
    setup, said = _setup(shift(vocab_size=300), packing=False, sp=1)
    families.check(setup)
    assert said == []


def _register_head_and_state_probes():
    """Three families nobody has seen: logits doubled after the head (under no config field the chunked loss knows),
    a layer whose output depends on how often it ran (state kept between calls), and one transformers cannot
    checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    class Counting(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp, self.calls = mlp, 0

        def forward(self, x):
            self.calls += 1
            return self.mlp(x) * (1 + 0.1 * self.calls)

    def family(name, **body):
        config = type(f"{name}Config", (LlamaConfig,), {"model_type": name})
        model = type(f"{name}ForCausalLM", (LlamaForCausalLM,), {"config_class": config, **body})
        AutoConfig.register(name, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
        return config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2)

    def doubled(self, *args, **kwargs):
        out = LlamaForCausalLM.forward(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    def counting(self, config):
        LlamaForCausalLM.__init__(self, config)
        for layer in self.model.layers:
            layer.mlp = Counting(layer.mlp)

    return (family("probe_scaled", forward=doubled), family("probe_counting", __init__=counting),
            family("probe_no_checkpointing", supports_gradient_checkpointing=False))


def test_the_chunked_loss_and_activation_checkpointing_are_checked_on_the_family():
    """train.loss_chunk_tokens takes the loss from the head over the last hidden state: a family that changes its
    logits after the head under a name the chunked loss does not list trained on another loss than the model's,
    exit 0 (the config-field list was the only check). train.activation_checkpointing recomputes each layer: a layer
    with state gave other gradients, and a family transformers cannot checkpoint stopped with its traceback. Each is
    one line now; an attention-only family passes both, said in the log."""
    scaled, counting, no_checkpointing = _register_head_and_state_probes()
    for config, kwargs, line in (
            (scaled, {"chunk": 64}, "train.loss_chunk_tokens with probe_scaled: its logits are not the head applied "
                                    "to the last hidden state (largest logit difference "),
            (counting, {"checkpointing": True}, "train.activation_checkpointing with probe_counting: its recomputed "
                                                "forward differs from the first (largest relative gradient "
                                                "difference "),
            (no_checkpointing, {"checkpointing": True},
             "train.activation_checkpointing with probe_no_checkpointing: probe_no_checkpointingForCausalLM does not "
             "support it in transformers; set train.activation_checkpointing=false")):
        with pytest.raises(UserError) as e:
            families.check(_setup(config, **kwargs)[0])
        assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
    _, plain = _register()
    setup, said = _setup(plain(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2), chunk=64, checkpointing=True)
    families.check(setup)
    assert "chunked loss exact" in said[0] and "activation checkpointing exact" in said[0], said


def test_a_sequence_classification_checkpoint_is_refused(tmp_path):
    """Issue 85: a reward model (Qwen2ForSequenceClassification) loaded as a causal LM, its score head dropped and a
    random lm_head in its place, trained and exported as one. Its config says what head it has."""
    from dstrain.config import ModelConfig
    from dstrain.model import load_config
    config = AutoConfig.for_model("qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                  architectures=["Qwen2ForSequenceClassification"])
    config.save_pretrained(tmp_path / "rm")
    with pytest.raises(UserError) as e:
        load_config(ModelConfig(name_or_path=str(tmp_path / "rm")), 32)
    assert str(e.value).startswith(f"'{tmp_path / 'rm'}' is a Qwen2ForSequenceClassification checkpoint (a "
                                   "SequenceClassification head, e.g. a reward model), not a causal language model")
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path / "lm")
    assert load_config(ModelConfig(name_or_path=str(tmp_path / "lm")), 32)[1].model_type == "qwen2"


WINDOWED = [("mistral", {"sliding_window": 4096}),  # Mistral-7B-v0.1's window, cut to 16 of the probe's 64
            ("qwen2", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}),
            ("qwen3", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1})]


@pytest.mark.parametrize("family,extra", WINDOWED + [("llama", {}), ("gpt2", {})], ids=lambda v: str(v))
def test_pipeline_stages_chained_give_the_models_logits_windows_included(family, extra, monkeypatch):
    """The pipeline's decoder wrappers rebuild each layer's mask: the sliding window where the model's forward
    applies one (Mistral's sliding_window, the sliding layers of a Qwen's layer_types). With the wrapper's plain
    causal mask (the code before): 0.89 (Mistral), 0.30 (Qwen2), 0.52 (Qwen3) off the model's logits."""
    from dstrain.components import pipeline

    config = AutoConfig.for_model(family, **extra)
    small = families.small_copy(config)
    model = families.build(small)
    cell = families.run_check("pipeline", model, small)
    assert cell.holds, (family, cell)
    if (family, extra) in WINDOWED:
        monkeypatch.setattr(pipeline, "sliding", lambda config, index: False)
        assert families.run_check("pipeline", model, small).difference > 0.1


def test_pipeline_stages_of_a_family_without_a_stage_layout_are_refused_before_anything_is_built():
    config = AutoConfig.for_model("gemma3_text")
    small = families.small_copy(config)
    cell = families.run_check("pipeline", families.build(small), small)
    line = families.refusal("gemma3_text", cell)
    assert not cell.holds and line.startswith("pipeline stages with gemma3_text: no stage layout") and "\n" not in line
    recipe = SimpleNamespace(data=SimpleNamespace(packing=False), train=SimpleNamespace(
        loss_chunk_tokens=0, activation_checkpointing=False))
    assert families.layouts_of(recipe, Layout(world_size=2, pipeline_stages=2)) == ["pipeline"]


# --------------------------------------------------------------------------- the matrix of docs/models.md
NAMED = ["qwen3", "gemma3_text", "phi3", "smollm3", "olmo2", "granite", "glm4", "falcon_h1", "jamba", "lfm2",
         "qwen3_next", "granitemoehybrid", "bamba", "llama", "mistral", "qwen2", "gpt_oss", "deepseek_v3"]


def _matrix() -> dict:
    import json

    from tests.helpers import ROOT
    return json.loads((ROOT / "docs/family_matrix.json").read_text())


def _recheck(family: str) -> None:
    want = next(r for r in _matrix()["rows"] if r["family"] == family)
    got = families.verdict(family)
    assert got["built"] == want["built"], (got, want)
    for layout in families.CHECKS if want["built"] else ():
        assert (got[layout]["holds"], got[layout]["culprit"]) == (want[layout]["holds"], want[layout]["culprit"]), \
            (family, layout, got[layout], want[layout])


def test_the_matrix_is_the_installed_transformers_every_family():
    """docs/family_matrix.json (scripts/family_matrix.py --write) lists every causal-LM family of the transformers
    installed, and docs/models.md shows it."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.helpers import ROOT
    matrix = _matrix()
    assert matrix["transformers"] == transformers.__version__, "regenerate: python scripts/family_matrix.py --write"
    assert [r["family"] for r in matrix["rows"]] == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert families.table(matrix["rows"]) in (ROOT / "docs/models.md").read_text()
    rows = {r["family"]: r for r in matrix["rows"]}
    assert all(rows[f]["built"] for f in NAMED)
    for family in ("bamba", "jamba", "falcon_h1", "lfm2", "qwen3_next", "granitemoehybrid"):  # the trial's hybrids
        assert not rows[family]["packing"]["holds"] and not rows[family]["sequence split"]["holds"]


@pytest.mark.parametrize("family", NAMED)
def test_the_named_families_cells_are_what_the_matrix_says(family):
    """The families the trial named (and the most used), rechecked in process against docs/family_matrix.json;
    `make test-family-matrix` rechecks all of them."""
    _recheck(family)


@pytest.mark.skipif(not __import__("os").environ.get("DSTRAIN_TEST_FAMILY_MATRIX"),
                    reason="every family: make test-family-matrix (about 2 minutes)")
def test_every_familys_cells_are_what_the_matrix_says():
    for row in _matrix()["rows"]:
        _recheck(row["family"])


def test_every_refused_cell_of_the_matrix_is_one_line_naming_family_module_and_fix():
    layout = SimpleNamespace(sequence_parallel=2, context_parallel=1)
    refused = [(r["family"], name, r[name]) for r in _matrix()["rows"] if r["built"]
               for name in families.CHECKS if not r[name]["holds"]]
    assert len(refused) > 90
    fixes = {"packing": "set data.packing=false", "sequence split": "without sequence or context parallelism",
             "chunked loss": "set train.loss_chunk_tokens=0",
             "activation checkpointing": "set train.activation_checkpointing=false",
             "pipeline": "use a ds_config without a pipeline section"}
    for family, name, cell in refused:
        line = families.refusal(family, families.Cell(name, cell["difference"] or float("inf"), cell["culprit"]),
                                layout)
        fix = fixes[name]
        assert "\n" not in line and family in line and (cell["culprit"] or "a layer") in line and fix in line, line
