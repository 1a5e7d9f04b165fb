"""Every use of a private (underscore or undocumented) DeepSpeed, torch or datasets API, in one place.

Each function names what it reaches into; tests/unit/test_ds_internals.py checks each against the installed
versions and fails with a sentence naming the version when an internal moved. Public APIs are used
wherever one exists (engine.data_parallel_group for the data-parallel group, for example).
Supported range: deepspeed 0.19.8 - 0.19.x, torch 2.4 - 2.13, datasets 5.x (requirements.txt).
"""
# The subsystem modules below each touch one part of DeepSpeed (or torch, or datasets); callers use them through
# this package's names, so a moved internal is mended in one module and nowhere else.
from .checkpoints import (  # noqa: F401
    MUON_UNIVERSAL,
    checkpoint_engine_base,
    load_universal_into_plain_optimizer,
    muon_universal_input,
    muon_universal_load,
    muon_universal_output,
    universal_for_any_stage,
    universal_load_repairs,
    using_checkpoint_engine,
)
from .comm import (  # noqa: F401
    collective_work_type,
    comm_backend,
    cpu_devices_are_the_nodes_ranks,
    replace_zero0_allreduce,
    replace_zero1_reduction,
)
from .data import (  # noqa: F401
    dataset_fingerprint,
)
from .engine import (  # noqa: F401
    autotp_plan_problem,
    autotp_split_weights,
    consolidated_16bit_state_dict,
    drop_frozen_aliases,
    engine_config,
    gate_optimizer_step,
    profile_one_step,
    record_fp32_grad_norm,
)
from .experts import (  # noqa: F401
    autoep_layers,
    autoep_local_experts,
    autoep_preset_for,
    autoep_preset_names,
    autoep_preset_pattern,
    autoep_shared_names,
    let_autoep_use_the_output_registry,
    let_zero_train_beside_frozen_experts,
)
from .groups import (  # noqa: F401
    ReplicaUnit,
    UlyssesInReplicas,
    bind_groups,
    data_parallel_rank,
    init_tensor_parallel_groups,
    model_parallel_unit,
    pipeline_in_replicas,
    replica_unit,
    sequence_parallel_gradient_divisor,
    sequence_parallel_state,
    use_replica_groups_for_tensor_parallel,
)
from .muon import (  # noqa: F401
    MUON_MODULE,
    MUON_UPDATE_MODULES,
    count_muon_updates,
    defer_muon_compile,
    keep_muon_tags,
)
from .ops import (  # noqa: F401
    announce_jit_builds,
    build_turn,
    cuda_arch_list_deepspeed_parses,
    jit_build_dir_root,
    jit_build_key,
    jit_build_needed,
    remember_cpu_info,
    settle_flags,
)
from .torch_apis import (  # noqa: F401
    cpu_flash_attention,
    cpu_flash_attention_backward,
    elastic_agent_exit_barrier,
    inductor_cache_dir,
)

__all__ = [
    "model_parallel_unit",
    "sequence_parallel_state",
    "init_tensor_parallel_groups",
    "replica_unit",
    "use_replica_groups_for_tensor_parallel",
    "pipeline_in_replicas",
    "UlyssesInReplicas",
    "ReplicaUnit",
    "data_parallel_rank",
    "bind_groups",
    "sequence_parallel_gradient_divisor",
    "consolidated_16bit_state_dict",
    "engine_config",
    "profile_one_step",
    "record_fp32_grad_norm",
    "drop_frozen_aliases",
    "gate_optimizer_step",
    "jit_build_needed",
    "jit_build_key",
    "jit_build_dir_root",
    "announce_jit_builds",
    "build_turn",
    "settle_flags",
    "remember_cpu_info",
    "cpu_devices_are_the_nodes_ranks",
    "cuda_arch_list_deepspeed_parses",
    "replace_zero0_allreduce",
    "replace_zero1_reduction",
    "comm_backend",
    "collective_work_type",
    "universal_load_repairs",
    "universal_for_any_stage",
    "load_universal_into_plain_optimizer",
    "MUON_UNIVERSAL",
    "muon_universal_input",
    "muon_universal_output",
    "muon_universal_load",
    "checkpoint_engine_base",
    "using_checkpoint_engine",
    "MUON_MODULE",
    "defer_muon_compile",
    "keep_muon_tags",
    "MUON_UPDATE_MODULES",
    "count_muon_updates",
    "elastic_agent_exit_barrier",
    "inductor_cache_dir",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "dataset_fingerprint",
    "let_autoep_use_the_output_registry",
    "autoep_layers",
    "autoep_local_experts",
    "autoep_preset_for",
    "autoep_preset_names",
    "autoep_shared_names",
]
