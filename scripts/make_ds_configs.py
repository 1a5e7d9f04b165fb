#!/usr/bin/env python3
"""Write ds_configs/*.json: one DeepSpeed config per strategy, "auto" wherever the recipe decides.

The JSONs are the product (edit them freely); this script only keeps the family consistent when a
shared setting changes. tests/unit/test_shipped_configs.py checks that its output equals the files.
"""
import copy
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "ds_configs"

# No "scheduler": without one the recipe's schedule runs (dstrain.trainer.schedule), and the Hugging Face Trainer, which
# people carry these files to, builds its own ({"params": "auto"} broke its TrainingArguments, issue 29).
BASE = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "bf16": {"enabled": True},
}
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
        "min_loss_scale": 1}
ZERO12 = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 50_000_000,
          "allgather_bucket_size": 50_000_000}
# "auto": scaled to the model's hidden size by dstrain.parallel.ds_config.zero3_sizes (measured: docs/benchmarks.md)
ZERO3 = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
         "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
         "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto", "sub_group_size": "auto"}
CPU_OPT = {"device": "cpu", "pin_memory": True}
CPU_PARAM = {"device": "cpu", "pin_memory": True}
NVME_OPT = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4}
NVME_PARAM = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
              "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
AIO = {"block_size": 1_048_576, "queue_depth": 8, "single_submit": False, "overlap_events": True}

STRATEGIES = {
    "zero0": {"zero_optimization": {"stage": 0}},
    "zero1": {"zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000}},
    "zero2": {"zero_optimization": {"stage": 2, **ZERO12}},
    "zero3": {"zero_optimization": {"stage": 3, **ZERO3}},
    "zero2_offload": {"zero_optimization": {"stage": 2, **ZERO12, "offload_optimizer": CPU_OPT}},
    "zero3_offload": {"zero_optimization": {"stage": 3, **ZERO3, "offload_optimizer": CPU_OPT,
                                            "offload_param": CPU_PARAM}},
    "zero3_nvme": {"zero_optimization": {"stage": 3, **ZERO3, "offload_optimizer": NVME_OPT,
                                         "offload_param": NVME_PARAM}, "aio": AIO},
    # model parallelism: 2 pipeline stages (with ZeRO-1 across replicas), 2-way AutoTP (with ZeRO-1)
    "pipe2_zero1": {"pipeline": {"stages": 2, "partition_method": "parameters"},
                    "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000}},
    "tp2_zero1": {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": False},
                  "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000}},
}

ZERO1 = {"stage": 1, "reduce_bucket_size": 50_000_000}
# Less gradient traffic, bf16 only (no _fp16 twin): DeepSpeed's communication_data_type, and ZeRO++ (CUDA only; hpZ
# "auto" = ranks per node). The repository's own compression is a recipe section (--compression.method=powersgd
# with zero0.json or zero1.json), not a JSON of its own.
TRAFFIC = {
    "zero1_bf16comm": {"zero_optimization": ZERO1, "communication_data_type": "bf16"},
    "zero1_fp16comm": {"zero_optimization": ZERO1, "communication_data_type": "fp16"},
    # long sequences: DeepSpeed Ulysses sequence parallelism (2 ranks share each sequence; raise for longer ones)
    "sp2_zero2": {"zero_optimization": {"stage": 2, **ZERO12}, "sequence_parallel_size": 2},
    "sp2_zero3": {"zero_optimization": {"stage": 3, **ZERO3}, "sequence_parallel_size": 2},
    "sp8_zero3": {"zero_optimization": {"stage": 3, **ZERO3}, "sequence_parallel_size": 8},
    # longer still: ring attention (context parallelism: any head count; the ring's blocks pass between nodes),
    # alone and with Ulysses inside each node (this repository's key, components/sequence_parallel.py)
    "cp2_zero3": {"zero_optimization": {"stage": 3, **ZERO3}, "context_parallel_size": 2},
    "sp2cp2_zero3": {"zero_optimization": {"stage": 3, **ZERO3}, "sequence_parallel_size": 2,
                     "context_parallel_size": 2},
    # Mixture-of-Experts: DeepSpeed's AutoEP splits each MoE block's routed experts over 2 ranks (the preset picked
    # from the model's type; components/expert_parallel.py)
    "ep2_zero2": {"zero_optimization": {"stage": 2, **ZERO12}, "expert_parallel": {"enabled": True, "autoep_size": 2}},
    # ... over the 8 GPUs of a node (Qwen3-30B-A3B's recipe); ZeRO-2 partitions the dense part's states over all
    # ranks, the experts' stay whole on the one rank that holds them (8 ranks = 8 EP ranks)
    "ep8_zero2": {"zero_optimization": {"stage": 2, **ZERO12}, "expert_parallel": {"enabled": True, "autoep_size": 8}},
    "zero3_zeropp": {"zero_optimization": {"stage": 3, **ZERO3, "zero_quantized_weights": True,
                                           "zero_quantized_gradients": True, "zero_hpz_partition_size": "auto"}},
}


def configs() -> dict[str, dict]:
    out = {}
    for name, extra in STRATEGIES.items():
        cfg = copy.deepcopy(BASE) | copy.deepcopy(extra)
        out[f"{name}.json"] = cfg
        fp16 = copy.deepcopy(cfg)
        del fp16["bf16"]
        fp16["fp16"] = FP16
        out[f"{name}_fp16.json"] = fp16
    for name, extra in TRAFFIC.items():
        out[f"{name}.json"] = copy.deepcopy(BASE) | copy.deepcopy(extra)
    return out


def render(cfg: dict) -> str:
    return json.dumps(cfg, indent=2) + "\n"


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, cfg in configs().items():
        (OUT / name).write_text(render(cfg))
    print(f"wrote {len(configs())} configs to {OUT}")
