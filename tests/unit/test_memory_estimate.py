"""Preflight arithmetic on an 8B-shaped Llama (built on the meta device, nothing downloaded)."""
import re

import pytest

from dstrain.config import load_recipe, parse_overrides
from dstrain.parallel import ds_config as dsc
from dstrain.parallel.layout import Layout
from dstrain.planner import memory
from dstrain.run import checkpoint

GPU = dsc.DeviceCaps("cuda", bf16=True, fp16=True)
GiB = 1024 ** 3


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    from transformers import LlamaConfig
    out = tmp_path_factory.mktemp("llama8b")
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192).save_pretrained(out)
    return out


def recipe(path, *extra):
    return load_recipe("llama-3.1-8b/pretrain_multinode.yaml",
                       parse_overrides([f"--model.name_or_path={path}", "--model.tokenizer=recipes/tiny/model", *extra]))


def test_zero_paper_model_states(llama8b):
    r = recipe(llama8b)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(llama8b)
    psi = memory.count_parameters(config)
    assert 8.0e9 < psi < 8.1e9                               # Llama-3.1-8B has 8.03B parameters
    per = {}
    for stage in (1, 2, 3):
        cfg = dsc.resolve(dsc.load(f"zero{stage}.json"), r, 32, GPU, hidden_size=4096)
        est = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32))
        per[stage] = (est.device["parameters"] + est.device["gradients"] + est.device["optimizer_states"]) / psi
    # the persistent model states are the ZeRO paper's, bf16 + Adam, N=32: 4 + 12/N, 2 + 14/N, 16/N
    assert per[1] == pytest.approx(4 + 12 / 32, rel=1e-3)
    assert per[2] == pytest.approx(2 + 14 / 32, rel=1e-3)
    assert per[3] == pytest.approx(16 / 32, rel=1e-3)


def test_preflight_refuses_and_suggests(llama8b, monkeypatch):
    monkeypatch.setattr(memory, "device_memory", lambda name, ranks: (80 * GiB, "H100 80GB"))
    r = recipe(llama8b, "--train.activation_checkpointing=false")
    fits, text = memory.preflight(r, dsc.load("zero1.json"), "zero1.json", 8, 8, GPU)
    assert not fits and "does not fit;" in text and "would" in text
    fits, text = memory.preflight(recipe(llama8b), dsc.load("zero3.json"), "zero3.json", 32, 8, GPU)
    assert fits, text
    assert "parameters" in text and "activations" in text and "of 80.00 GiB (H100 80GB)" in text


def test_activation_checkpointing_shrinks_activations(llama8b):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(llama8b)
    r = recipe(llama8b, "--train.loss_chunk_tokens=0")  # full logits (the recipe chunks them)
    cfg = dsc.resolve(dsc.load("zero3.json"), r, 32, GPU, hidden_size=4096)
    est = memory.estimate(config, 8_030_261_248, r, cfg, Layout.from_ds_config(cfg, 32))
    # 2 x 4096 tokens, 32 layers of 8h+4f = 90112 bf16 elements per token, logits 128256 x 14 bytes
    tokens = 2 * 4096
    assert est.activations_full == 32 * tokens * 90112 * 2 + tokens * 128256 * 14 + tokens * 4096 * 2
    assert est.activations_checkpointed < est.activations_full / 3


def test_chunked_loss_replaces_the_logits_term(llama8b):
    """train.loss_chunk_tokens: only one chunk's logits (bf16 output, fp32 copy, bf16 gradient) plus the kept
    gradients of the hidden states and head weight, instead of every token's logits and softmax state."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(llama8b)
    ests = []
    for chunk in (0, 1024):
        r = recipe(llama8b, f"--train.loss_chunk_tokens={chunk}")
        cfg = dsc.resolve(dsc.load("zero3.json"), r, 32, GPU, hidden_size=4096)
        ests.append(memory.estimate(config, 8_030_261_248, r, cfg, Layout.from_ds_config(cfg, 32)))
    tokens, vocab = 2 * 4096, 128256
    chunked_head = 1024 * vocab * (2 + 4 + 2) + (tokens + vocab) * 4096 * 2
    assert ests[0].activations_full - ests[1].activations_full == tokens * vocab * 14 - chunked_head
    assert ests[1].activations_checkpointed < ests[0].activations_checkpointed - 10 * GiB


def test_plan_a_gpu_run_from_a_cpu_machine(llama8b):
    """Issue 16: `--preflight --world_size 8` on a Llama-3-8B config from a CPU machine estimated fp32 against
    host RAM / 8 and refused everything, printing the whole 8,030M as each rank's parameters."""
    target = memory.target_device("h100-80gb", None)
    assert target == (80 * GiB, "h100-80gb")
    r = recipe(llama8b, "--train.micro_batch_size=1")
    fits, text = memory.preflight(r, dsc.load("zero3.json"), "zero3.json", 8, 8, GPU, target)
    assert fits, text
    assert "bf16" in text.splitlines()[0] and "of 80.00 GiB (h100-80gb)" in text
    # ZeRO-3 holds 1/8 of the 8,030M on each rank
    assert "1,003.8M parameters held per rank (ZeRO-3 partitions 8,030.3M over 8 ranks)" in text, text
    assert memory.target_device(None, "24GiB") == (24 * GiB, "GPU, --device_memory 24GiB")
    assert memory.target_device("a100-40gb", "40GB")[0] == 40 * 1000 ** 3
    fits, text = memory.preflight(r, dsc.load("zero3.json"), "zero3.json", 8, 8, GPU,
                                  memory.target_device(None, "8GiB"))
    assert not fits and "does not fit" in text


@pytest.mark.parametrize("device,memory_arg,message", [
    ("h100", None, "--device h100 is not in the table (did you mean h100-80gb or h100-94gb?)"),
    ("a100-80", None, "(did you mean a100-80gb?)"),
    (None, "80 gigs", "--device_memory 80 gigs: write a size such as 80GiB"),
])
def test_bad_device_arguments(device, memory_arg, message):
    from dstrain.errors import UserError
    with pytest.raises(UserError) as err:
        memory.target_device(device, memory_arg)
    assert message in str(err.value)


def test_sequence_parallel_preflight_fits_128k_and_names_the_longest_length(tmp_path, monkeypatch):
    """The shipped long-context recipe (Llama-3.1-8B, 128k tokens, sp=8 on one 8-GPU node) fits an 80 GB GPU, and
    the longest length is 8x that of the same run without sequence parallelism (activations split, states not)."""
    from transformers import LlamaConfig
    # positions far beyond Llama-3.1's 131072, so the preflight's longest length is memory's bound, not the model's
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2 ** 22).save_pretrained(tmp_path)
    r = load_recipe("llama-3.1-8b/long_context_sft.yaml", parse_overrides([
        f"--model.name_or_path={tmp_path}", "--model.tokenizer=recipes/tiny/model"]))
    h100 = (80 * GiB, "H100 80GB")
    fits, text = memory.preflight(r, dsc.load("sp8_zero3.json"), "sp8_zero3.json", 8, 8, GPU, h100)
    assert fits, text
    assert "sequence-parallel 8" in text and "micro batch 1 x 131072 tokens" in text
    longest = {}
    for name in ("sp8_zero3.json", "zero3.json"):
        text = memory.preflight(r, dsc.load(name), name, 8, 8, GPU, h100)[1]
        line = next(x for x in text.splitlines() if x.startswith("longest train.seq_len that fits"))
        assert "maximum positions" not in line
        longest[name] = int(line.split(": ")[1].split()[0].replace(",", ""))
    assert longest["sp8_zero3.json"] >= 131072
    assert longest["sp8_zero3.json"] == pytest.approx(8 * longest["zero3.json"], rel=0.02)


def test_ring_attention_preflight_halves_each_ranks_part_and_counts_the_rings_bytes(tmp_path):
    """Issue 57: the 128k recipe with Ulysses 8 x a ring of 2 on 16 GPUs: each rank holds 1/16 of every sequence,
    the longest length is about twice Ulysses 8's on 8 (activations halve, ZeRO-3's states spread over twice the
    ranks, the ring's buffers take a little back),
    and the ring's bytes per layer are said: keys/values (bf16, 8 kv heads x 128) of the rank's 8,192 tokens sent
    once forward and once backward, their fp32 gradients twice."""
    import json

    from transformers import LlamaConfig
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2 ** 22).save_pretrained(tmp_path)
    r = load_recipe("llama-3.1-8b/long_context_sft.yaml", parse_overrides([
        f"--model.name_or_path={tmp_path}", "--model.tokenizer=recipes/tiny/model"]))
    h100 = (80 * GiB, "H100 80GB")
    ring = dict(dsc.load("sp8_zero3.json"), context_parallel_size=2)
    fits, text = memory.preflight(r, json.loads(json.dumps(ring)), "sp8cp2", 16, 8, GPU, h100)
    assert fits, text
    assert "context-parallel (ring) 2 x sequence-parallel 8" in text
    tokens = 131072 // 16
    sent = tokens * 2 * 1024 * 2 + tokens * 8  # one pass of the keys and values (+ each token's document start)
    want = (2 * sent + 2 * tokens * 2 * 1024 * 4) / 2 ** 20
    assert f"each rank holds {tokens:,} tokens of every sequence and sends {want:,.1f} MiB per layer" in text
    longest = {}
    for name, cfg, world in (("sp8", dsc.load("sp8_zero3.json"), 8), ("sp8cp2", ring, 16)):
        text = memory.preflight(r, json.loads(json.dumps(cfg)), name, world, 8, GPU, h100)[1]
        line = next(x for x in text.splitlines() if x.startswith("longest train.seq_len that fits"))
        longest[name] = int(line.split(": ")[1].split()[0].replace(",", ""))
    assert 1.9 < longest["sp8cp2"] / longest["sp8"] < 2.3, longest  # measured 2.13


def test_diloco_counts_its_outer_state_and_partitions_within_a_replica(llama8b, monkeypatch):
    """Issue 33: the preflight partitioned ZeRO over the whole world and left out DiLoCo's outer state (the shared
    weights and the momentum, fp32, the whole model on every rank: 64 GB for 8B) and its sync's full vector; with
    the optimizer offloaded, the outer state is in host memory too."""
    from transformers import AutoConfig

    from dstrain.components.diloco import replicas_for
    monkeypatch.setattr(memory, "device_memory", lambda name, ranks: (80 * GiB, "H100 80GB"))
    config = AutoConfig.from_pretrained(llama8b)
    psi = memory.count_parameters(config)
    plain = recipe(llama8b)
    fits, text = memory.preflight(plain, dsc.load("zero3.json"), "zero3.json", 32, 8, GPU)
    assert fits, text
    r = recipe(llama8b, "--diloco.every=50", "--diloco.dtype=int8")
    assert replicas_for(r, 32, 8) == 4  # one per node
    cfg = dsc.resolve(dsc.load("zero3.json"), r, 32, GPU, hidden_size=4096, replicas=4)
    est = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32, replicas=4))
    assert est.device["optimizer_states"] == pytest.approx(12 * psi / 8, rel=1e-6)  # 8 ranks a replica, not 32
    chunk = -(-psi // 8 // 128) * 128
    # this rank's slice (one of its replica's 8) of the shared weights, the momentum and int8's carried rounding
    assert est.device["diloco_state"] == 12 * chunk
    # at the sync, no copy of the whole model: the pseudo-gradient's slice, then the larger of a bucket's int8
    # payloads (the 4 replicas' and this rank's) with two decoded buckets, and the writing of the weights: a
    # broadcast bucket, the embedding's full fp32 weight and its gathered bf16 working copy
    bucket, embedding = 2 ** 25, config.hidden_size * config.vocab_size
    assert int(5 * (1 + 4 / 128) * bucket) + 8 * bucket < 4 * bucket + 6 * embedding
    assert est.device["diloco_sync"] == 4 * chunk + 4 * bucket + 6 * embedding < psi  # 2.2 psi before buckets
    assert not est.host
    assert est.device_total > 12 * chunk + 4 * chunk
    fits, text = memory.preflight(r, dsc.load("zero3.json"), "zero3.json", 32, 8, GPU)
    assert fits, text  # with the whole model's outer state on every rank, it did not
    no_momentum = recipe(llama8b, "--diloco.every=50", "--diloco.outer_momentum=0", "--diloco.dtype=fp32")
    est = memory.estimate(config, psi, no_momentum, cfg, Layout.from_ds_config(cfg, 32, replicas=4))
    assert est.device["diloco_state"] == 4 * chunk
    # one rank a node: a replica of one rank keeps the whole model's (here too big for an 80 GB GPU beside ZeRO-3's
    # states, which one rank keeps whole)
    fits, text = memory.preflight(r, dsc.load("zero3.json"), "zero3.json", 4, 1, GPU)
    assert not fits and "diloco_state" in text and "diloco_sync do not coexist" in text, text
    # ZeRO-3 with CPU offload: the outer state, the pseudo-gradient's slice and the full weight being written are
    # in host memory beside the optimizer's; the accelerator holds what the collectives carry and the gathered
    # bf16 copy of the parameter being written
    cfg = dsc.resolve(dsc.load("zero3_offload.json"), r, 32, GPU, hidden_size=4096, replicas=4)
    est = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32, replicas=4))
    assert "diloco_state" not in est.device
    assert est.host["diloco_state"] == 12 * chunk + 4 * chunk + 4 * embedding
    assert est.device["diloco_sync"] == 4 * bucket + 2 * embedding
    fits, text = memory.preflight(r, dsc.load("zero3_offload.json"), "zero3_offload.json", 32, 8, GPU)
    assert fits and "offloaded to host: diloco_state" in text, text
    # streaming: 5 fragments each in flight for 2 of the 10 steps between their sends (one at a time): this rank's
    # part of one fragment's pseudo-gradient and its int8 codes (this rank's and the 4 replicas') stay through them
    stream = recipe(llama8b, "--diloco.every=50", "--diloco.dtype=int8", "--diloco.fragments=5",
                    "--diloco.overlap=2")
    cfg = dsc.resolve(dsc.load("zero3.json"), stream, 32, GPU, hidden_size=4096, replicas=4)
    est = memory.estimate(config, psi, stream, cfg, Layout.from_ds_config(cfg, 32, replicas=4))
    part = -(-chunk // 5)
    assert est.device["diloco_state"] == 12 * chunk + 4 * part + int(5 * (1 + 4 / 128) * part)
    many = recipe(llama8b, "--diloco.every=50", "--diloco.dtype=int8", "--diloco.fragments=5", "--diloco.overlap=12")
    est = memory.estimate(config, psi, many, cfg, Layout.from_ds_config(cfg, 32, replicas=4))
    assert est.device["diloco_state"] == 12 * chunk + 2 * (4 * part + int(5 * (1 + 4 / 128) * part))  # 2 at a time
    # Ulysses (sp 2) inside replicas of 8 ranks: the 8 hold the same parameters (dp 4 x sp 2), each a slice of 8
    cfg = dsc.resolve(dsc.load("sp2_zero2.json"), r, 32, GPU, hidden_size=4096, replicas=4)
    est = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32, replicas=4))
    assert est.device["diloco_state"] == 12 * chunk


def test_background_checkpoints_host_memory_is_said(llama8b, monkeypatch):
    """The host copy a background save keeps per rank: 12 bytes a parameter of the optimizer share, plus the
    16-bit weights whole on rank 0 under ZeRO-1/2 (14 bytes a parameter); none of it with NVMe offload or
    checkpoint.background=false. On GPU hosts the copy is page-locked at its own size (background_save.HostPages):
    PyTorch's pinned allocator, used before 2026-11-27 (e5c2e33), rounded each buffer up to a power of two, 28.0 GiB for
    gpu-1b's 1.24B on one GPU, which the preflight did not say (30.8 GB peak RSS on an H200 and an H100)."""
    monkeypatch.setattr(memory, "device_memory", lambda name, ranks: (80 * GiB, "H100 80GB"))
    r = recipe(llama8b)
    cfg = dsc.resolve(dsc.load("zero2.json"), r, 1, GPU, hidden_size=4096)
    one = Layout.from_ds_config(cfg, 1)
    assert checkpoint.checkpoint_copy_bytes(cfg, one, 1_240_000_000) == 14 * 1_240_000_000
    cfg = dsc.resolve(dsc.load("zero3.json"), r, 32, GPU, hidden_size=4096)
    assert checkpoint.checkpoint_copy_bytes(cfg, Layout.from_ds_config(cfg, 32), 32 * 10**9) == 12 * 10**9
    text = memory.preflight(r, dsc.load("zero3.json"), "zero3.json", 32, 8, GPU)[1]
    psi = float(re.search(r"preflight: ([\d,.]+)M parameters", text).group(1).replace(",", "")) * 1e6
    line = next(line for line in text.splitlines() if "background checkpoints" in line)
    per_rank = 12 * psi / 32  # the three fp32 buffers of a rank's share, exactly
    assert f"up to {per_rank / GiB:,.1f} GiB a rank, {8 * per_rank / GiB:,.1f} GiB per node, page-locked" in line
    off = recipe(llama8b, "--checkpoint.background=false")
    assert "background checkpoints" not in memory.preflight(off, dsc.load("zero3.json"), "zero3.json", 32, 8, GPU)[1]
    assert "background checkpoints" not in memory.preflight(r, dsc.load("zero3_nvme.json"), "zero3_nvme.json", 32,
                                                            8, GPU)[1]


def test_memory_json_says_what_a_cpu_ranks_peak_holds(tmp_path, monkeypatch):
    """The launch scripts no longer set MALLOC_MMAP_THRESHOLD_ (1.5x slower CPU steps): a CPU rank's RSS peak then
    includes glibc's reusable heap, and memory.json says which of the two it measured."""
    import json
    from types import SimpleNamespace
    estimate = memory.Estimate(parameters=1, params_per_rank=1, device={"params": 1 << 20})
    for value in ("131072", None):
        if value:
            monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", value)
        else:
            monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
        memory.record(tmp_path / "memory.json", SimpleNamespace(is_main=True), 0, 0, estimate)
        said = json.loads((tmp_path / "memory.json").read_text())["allocator"]
        assert ("MALLOC_MMAP_THRESHOLD_=131072: freed tensors leave RSS" in said) if value else \
            said.startswith("glibc's default: the peak includes freed tensors"), said


def test_rl_counts_the_reference_and_the_rollouts_kv_cache(llama8b):
    """data.format=prompt: the reference (rl.beta > 0, not with LoRA) is one more copy of the 16-bit weights,
    partitioned under ZeRO-3; the rollout's KV cache (prompts x generations rows, K and V of every layer, 8
    key/value heads x 128) is its own phase, beside the gathered parameters, not on top of the activations."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(llama8b)
    psi = memory.count_parameters(config)
    rl = ["--data.format=prompt", "--rl.reward_funcs=[exact_answer]", "--rl.num_generations=8",
          "--train.micro_batch_size=2", "--train.grad_accum_steps=4", "--train.seq_len=1024"]
    for stage, beta, lora in ((3, 0.04, False), (2, 0.04, False), (3, 0.0, False), (3, 0.04, True)):
        r = recipe(llama8b, *rl, f"--rl.beta={beta}", *(["--lora.r=16"] if lora else []))
        cfg = dsc.resolve(dsc.load(f"zero{stage}.json"), r, 32, GPU, hidden_size=4096)
        est = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32))
        rows = 2 * 4 * 8
        assert est.device["rollout_kv_cache"] == 2 * 32 * rows * 1024 * 8 * 128 * 2 + rows * 128256 * 12
        if beta and not lora:
            assert est.device["reference_model"] == 2 * psi // (32 if stage == 3 else 1)
        else:
            assert "reference_model" not in est.device
        without = memory.Estimate(psi, psi, dict(est.device, rollout_kv_cache=0)).device_total
        phases = memory.BACKWARD + memory.STEP + memory.OUTER + memory.ROLLOUT
        persistent = sum(v for k, v in est.device.items() if k not in phases)
        rollout = persistent + est.device["rollout_kv_cache"] + est.device["buffers"]
        assert est.device_total == max(without, rollout) < without + est.device["rollout_kv_cache"]


def test_rl_counts_the_teacher_in_the_runs_precision(llama8b):
    """rl.teacher: the teacher's own parameter count (here the 8B shape itself), 2 bytes each in bf16, partitioned
    over the 32 ranks under ZeRO-3 and whole on each under ZeRO-2."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(llama8b)
    psi = memory.count_parameters(config)
    for stage in (2, 3):
        r = recipe(llama8b, "--data.format=prompt", f"--rl.teacher={llama8b}")
        cfg = dsc.resolve(dsc.load(f"zero{stage}.json"), r, 32, GPU, hidden_size=4096)
        est = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32))
        assert est.device["teacher_model"] == 2 * psi // (32 if stage == 3 else 1)


def test_muon_keeps_one_momentum_per_matrix(llama8b):
    """Muon's matrices (all but the untied embeddings and head, and the norms) hold one fp32 momentum where AdamW
    holds two moments: ZeRO-3 and ZeRO-0 count 4 bytes fewer per Muon element; ZeRO-1/2 keep a staged copy of the
    momentum too, as many bytes as AdamW's."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(llama8b)
    psi = memory.count_parameters(config)
    adamw_part = 2 * 128256 * 4096 + 65 * 4096
    for stage, fewer in ((3, 4), (2, 0)):
        states = {}
        for optimizer in ("adamw", "muon"):
            r = recipe(llama8b, f"--train.optimizer={optimizer}", "--train.max_grad_norm=0")
            cfg = dsc.resolve(dsc.load(f"zero{stage}.json"), r, 32, GPU, hidden_size=4096)
            states[optimizer] = memory.estimate(config, psi, r, cfg, Layout.from_ds_config(cfg, 32)).device[
                "optimizer_states"]
        assert states["adamw"] - states["muon"] == pytest.approx(fewer * (psi - adamw_part) / 32, rel=1e-3), stage
