"""The preflight's per-rank estimate against the measured peak of real 2-rank runs, and its refusal."""
import json

import pytest

from tests.helpers import ROOT, launch

# Measured / estimated (23.5M params, fp32, micro 4 x 128 tokens, glibc mmap threshold fixed as the
# Makefile sets it): ZeRO-0 0.92, ZeRO-1 0.87, ZeRO-2 0.94, ZeRO-3 1.24 (2026-11). On warm ranks (tests/warm.py: the
# threshold set by mallopt in the fork) 2026-12-07: ZeRO-0 0.93, ZeRO-1 0.78, ZeRO-2 0.85, ZeRO-3 1.12, LoRA 1.12,
# DiLoCo 0.93; the same day under torchrun ZeRO-1 0.82, LoRA 1.09 (a fork's peak is within 5% of a fresh process's). ZeRO-3 holds ~90 MiB more than the
# modelled terms (not yet attributed), too close to 25% for a stable test, so it has a looser bound.
# LoRA (r=16, all-linear, micro 8 so that the run is more than ZeRO-3's unattributed ~90 MiB): a frozen fp32
# base, adapters with full states.
# Measured 1.23 under ZeRO-3 (1.12 under ZeRO-2, not kept in the suite: the same terms, less partitioned).
# DiLoCo (2 replicas of one rank, ZeRO-2): the outer state (shared weights + momentum, 8 bytes a parameter) and the
# sync's fp32 pseudo-gradient (a replica of one rank holds the whole model's slices: both are the whole model's). Its end-of-run save is synchronous here: a background save's host copy of the whole
# unpartitioned state (564 MiB with DiLoCo's, more than the training's transients) is no part of the estimate and
# put the measured peak at 1.31x; with it synchronous, the DiLoCo terms are what is checked.
BOUND = {"zero0.json": 0.25, "zero1.json": 0.25, "zero2.json": 0.25, "zero3.json": 0.35, "zero3.json+lora": 0.35,
         "zero2.json+diloco": 0.25}
EXTRA = {"lora": ["--lora.r=16", "--train.micro_batch_size=8"],
         "diloco": ["--diloco.every=3", "--diloco.replicas=2", "--eval.every=3", "--checkpoint.every=3",
                    "--checkpoint.background=false", "--train.micro_batch_size=4"],
         "": ["--train.micro_batch_size=4"]}


# freed tensors leave RSS at once (glibc otherwise keeps multi-MB blocks in its heap): peaks are live memory
MEASURED = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@pytest.mark.parametrize("ds_config", list(BOUND))
def test_estimate_matches_measured_peak(tmp_path, cache, medium_llama, ds_config):
    run = tmp_path / "run"
    ds_config, _, feature = ds_config.partition("+")
    lora = feature == "lora"
    launch(["--ds_config", ds_config, "--output_dir", str(run), f"--model.name_or_path={medium_llama}",
            "--train.max_steps=3", "--log.wandb=false", "--log.progress_bar=false", "--eval.max_batches=1",
            "--checkpoint.export_hf=false", *EXTRA[feature]], cache, **MEASURED)
    m = json.loads((run / "memory.json").read_text())
    ratio = m["peak_above_baseline_bytes"] / m["estimated_device_bytes"]
    print(f"{ds_config}{' ' + feature if feature else ''}: measured {m['peak_above_baseline_bytes'] / 2**20:.0f} MiB, estimated "
          f"{m['estimated_device_bytes'] / 2**20:.0f} MiB, ratio {ratio:.2f}")
    # model states dominate, not interpreter noise (LoRA: the frozen base's weights)
    assert m["estimated_device_bytes"] > (80 if lora else 300) * 2**20
    assert abs(ratio - 1) <= BOUND[ds_config]


@pytest.mark.serial  # in the parallel part, beside another worker's jobs, one run measured 124 MiB saved where it
# measures 271 alone (CI, 2026-11-25): the kernel's high-water mark is not independent of the rest of the machine
def test_activation_checkpointing_saves_the_activation_memory(tmp_path, cache):
    """Issue 16: the activation-checkpointing test compared losses only, and checkpointing was in fact never on
    (transformers gates it on module.training; runs trained in eval mode). 8 layers x 8 x 512 tokens: the
    estimate says checkpointing keeps 338 -> 92 MiB of activations; measured peaks fell 441 -> 171 MiB."""
    peaks, estimates = {}, {}
    for on in ("false", "true"):
        run = tmp_path / on
        launch(["--model.name_or_path=recipes/tiny/model", "--model.config_overrides={num_hidden_layers: 8}",
                "--train.seq_len=512", "--train.micro_batch_size=8", "--train.max_steps=2", "--eval.every=0",
                "--checkpoint.every=0", "--checkpoint.export_hf=false", "--log.wandb=false", "--log.plot=false",
                "--log.progress_bar=false", "--train.precision=fp32", "--data.val_fraction=0",
                f"--train.activation_checkpointing={on}", "--output_dir", str(run)], cache, launcher="warm-python",
               **MEASURED)
        m = json.loads((run / "memory.json").read_text())
        peaks[on], estimates[on] = m["peak_above_baseline_bytes"], m["estimate"]["activations"]
    saved, predicted = peaks["false"] - peaks["true"], estimates["false"] - estimates["true"]
    print(f"activation checkpointing: measured {saved / 2**20:.0f} MiB less, estimated {predicted / 2**20:.0f}")
    assert predicted > 200 * 2**20 and saved > 0.6 * predicted, (saved, predicted)


def test_preflight_cli(cache, tmp_path, medium_llama):
    common = ["--preflight", "--world_size", "2", f"--model.name_or_path={medium_llama}", "--ds_config", "zero2.json"]
    ok = launch(common, cache, launcher="warm-python", check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "23.5M parameters, zero2.json, fp32, world 2 = data-parallel 2 x pipeline 1" in ok.stdout
    assert "fits:" in ok.stdout and "longest train.seq_len that fits with this config: 512 (the model's maximum" \
        in ok.stdout
    # a node so crowded that each rank gets a sliver of RAM: refused, with the reason, exit 1
    tight = launch(common + ["--ranks_per_node", "100000"], cache, launcher="warm-python", check=False)
    assert tight.returncode == 1 and "does not fit" in tight.stdout, tight.stdout[-2000:]
    # planning for GPUs this machine lacks (issue 16): the config's bf16, the GPU's memory, not host RAM / ranks
    planned = launch(common + ["--device", "h100-80gb", "--ranks_per_node", "100000"], cache, launcher="warm-python",
                     check=False)
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-2000:]
    assert "zero2.json, bf16, world 2" in planned.stdout and "of 80.00 GiB (h100-80gb)" in planned.stdout


@pytest.fixture(scope="module")
def wide_tower_vlm(tmp_path_factory):
    """recipes/tiny/vlm_model's LLaVA with a tower whose activations are most of a rank's memory: CLIP of 12 layers
    256 wide (9.5M parameters) on 84-pixel images in 7-pixel patches, 144 image tokens an image; the language model
    the tiny Llama of 2 layers."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    out = tmp_path_factory.mktemp("models") / "wide-tower-vlm"
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/vlm_model")
    config.vision_config.update({"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 12,
                                 "num_attention_heads": 4, "image_size": 84, "patch_size": 7})
    processor = AutoProcessor.from_pretrained(ROOT / "recipes/tiny/vlm_model")
    processor.image_processor.size = {"shortest_edge": 84}
    processor.image_processor.crop_size = {"height": 84, "width": 84}
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def test_a_trained_vision_towers_activations_are_counted(tmp_path, cache, wide_tower_vlm):
    """Issue 86: the preflight counted a vision-language model's language-model activations only. A tower that
    trains keeps every layer's activations for backward: here 8 rows of one image (145 patches with CLIP's class
    token, 164 tokens with the text) in sequences of 168 tokens, which the estimate bounds by 168 patches a row
    (every token an image token). ZeRO-0: no reduce bucket, whose estimate (a whole bucket) is a term of its own.
    Measured 2026-12-08 on warm ranks: 382 MiB against 443 estimated (0.86, twice); before the tower was counted the
    estimate was 191 MiB (ratio 2.0, this test failing)."""
    run = tmp_path / "run"
    launch(["--ds_config", "zero0.json", "--output_dir", str(run), f"--model.name_or_path={wide_tower_vlm}",
            "--model.train_vision_tower=true", "--model.train_projector=true", "--data.path=data/tiny_vlm/train.jsonl",
            "--data.format=chat", "--train.seq_len=168", "--train.micro_batch_size=8", "--train.max_steps=3",
            "--log.wandb=false", "--log.progress_bar=false", "--eval.max_batches=1", "--checkpoint.export_hf=false"],
           cache, **MEASURED)
    m = json.loads((run / "memory.json").read_text())
    ratio = m["peak_above_baseline_bytes"] / m["estimated_device_bytes"]
    print(f"vision tower trained: measured {m['peak_above_baseline_bytes'] / 2**20:.0f} MiB, estimated "
          f"{m['estimated_device_bytes'] / 2**20:.0f} MiB (activations {m['estimate']['activations'] / 2**20:.0f}), "
          f"ratio {ratio:.2f}")
    assert m["estimated_device_bytes"] > 300 * 2**20 and m["estimate"]["activations"] > 200 * 2**20
    assert abs(ratio - 1) <= 0.25
