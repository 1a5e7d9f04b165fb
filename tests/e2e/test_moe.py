"""Mixture-of-Experts models (issue 71) on 2 CPU ranks against the plain single-process loop (tests/helpers.py:
reference_losses), whose loss adds transformers' own load-balancing loss per micro-batch (consecutive runs of
micro_batch_size rows of the global batch), averaged over the global batch, at the model config's weight."""
import json
import os

import pytest

from tests.e2e.test_vs_reference import STEPS, _step_rows, run_and_compare
from tests.helpers import ROOT, launch


def test_expert_parallel_run_killed_resumes_exactly_regroups_and_finishes_on_one_rank(tmp_path, cache, tiny_mixtral):
    """EP 2 under ZeRO-2 (ds_configs/ep2_zero2.json in fp32), the config's load-balancing weight 0.02 (nothing in
    the recipe), a checkpoint every 2 steps: rank 1 is killed with SIGKILL after step 5 (the deepspeed launcher
    then stops the job), the job is started again on the same 2 ranks until step 6 (DeepSpeed's own AutoEP
    checkpoint loaded), then on the same 2 ranks with autoep_size 1 until step 7 (the universal conversion gathers
    each layer's experts over the old EP group), and finished on 1 rank (converted again; accumulation 2 -> 4, the
    same micro-batches). Every step's loss and grad norm
    are the single-process reference's, the logged aux_loss and lm_loss its two parts, the routing figures its
    count's, and the 1-rank export its weights. Without the aux loss (--model.router_aux_loss_coef=0) every step
    differs from this reference, by up to 8.8e-3 relative."""
    import signal
    import subprocess

    from tests.e2e.test_faults import rank_process, wait_for_steps
    from tests.e2e.test_vs_reference import COMMON, LR
    from tests.helpers import BIN, env, free_port, kill_tree, launch, metrics, reference_losses

    run_dir = tmp_path / "run"
    args = [*COMMON, f"--train.lr={LR}", f"--model.name_or_path={tiny_mixtral}", "--ds_config", "ep2_zero2.json",
            "--train.precision=fp32", "--checkpoint.every=2", "--output_dir", str(run_dir)]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for_steps(run_dir, 5, proc)
        rank_process(proc.pid, 1).send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode != 0, err[-3000:]
    again = launch(args + ["--train.exit_at_step=6"], cache)
    assert "resumed from" in again.stderr and "universal" not in again.stderr, again.stderr[-3000:]
    # the same 2 ranks with autoep_size 1 (each rank holds every expert): DeepSpeed loaded the EP 2 checkpoint
    # without a word and trained on 4.0e-4 off this reference until the regrouping went through the conversion
    regrouped = launch(args + ["--ds.expert_parallel.autoep_size=1", "--train.exit_at_step=7"], cache)
    assert "expert parallelism from autoep_size=2 to 1" in regrouped.stderr, regrouped.stderr[-3000:]
    assert "to a universal checkpoint for the new layout" in regrouped.stderr, regrouped.stderr[-3000:]
    last = launch(args + ["--ds.expert_parallel.autoep_size=1"], cache, nproc=1)
    said = last.stderr
    assert "to a universal checkpoint for the new layout" in said, said[-3000:]
    assert "expert parallelism: 2 MoE blocks, their experts split over 1 ranks (4 per rank)" in said, said[-3000:]
    assert "router load-balancing loss: 0.02 x the model's aux_loss" in said, said[-3000:]
    got = metrics(run_dir)[0]
    record = {}
    want, ref_model = reference_losses(tiny_mixtral, run_dir, STEPS, LR, 2, 0.1, weight_decay=0.1, record=record,
                                       router_aux={"coef": 0.02, "micro": 4})
    rows = _step_rows(run_dir)
    gap = max(abs(g - w) / w for g, w in zip(got, want))
    norm_gap = max(abs(r["grad_norm"] - w) / w for r, w in zip(rows, record["grad_norm"]))
    print(f"EP 2 killed at step 5, resumed on 2 ranks, regrouped to EP 1, finished on 1 rank: loss within {gap:.1e}, grad norm {norm_gap:.1e}")
    assert len(got) == STEPS and got == pytest.approx(want, rel=2e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx(record["grad_norm"], rel=1e-5)
    assert [r["aux_loss"] for r in rows] == pytest.approx(record["aux_loss"], rel=2e-6)
    assert [r["lm_loss"] for r in rows] == pytest.approx(record["lm_loss"], rel=2e-6)
    assert all(1.0 <= a < 4.0 for a in record["aux_loss"])  # E x sum(f p): 1 when balanced, E = 4 when collapsed
    # the routing figures over the global batch (both ranks' micro-batches) against the reference's own count; a
    # token whose 2nd and 3rd logits tie to rounding may route apart: one token moves a figure by about 1/2048
    tables = record["expert_load"]
    peaks, cvs = [(t.max(1) / t.mean(1)).max() for t in tables], [(t.std(1) / t.mean(1)).max() for t in tables]
    assert [r["expert_load_max"] for r in rows] == pytest.approx(peaks, rel=1e-3)
    assert [r["expert_load_cv"] for r in rows] == pytest.approx(cvs, rel=1e-3)
    assert [r["expert_load_worst_layer"] for r in rows] == [int((t.std(1) / t.mean(1)).argmax()) for t in tables]
    health = json.loads((run_dir / "summary.json").read_text())["health"]
    assert health["expert_load_cv"]["last"] == round(rows[-1]["expert_load_cv"], 4)
    assert health["expert_load_cv"]["first"] == round(rows[0]["expert_load_cv"], 4)  # kept over both resumes
    assert health["routing_collapsed_at"] is None
    assert json.loads((run_dir / "run_info.json").read_text())["world_size"] == 1
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict()
    worst = max((exported[k] - v).abs().max().item() for k, v in ref_model.state_dict().items())
    print(f"the 1-rank export within {worst:.1e} of the reference")
    assert worst < 1e-4, f"the export differs from the reference by {worst:.1e}"


FIXTURES = {"mixtral": "tiny_mixtral", "deepseek_v3": "tiny_deepseek", "qwen3_moe": "tiny_qwen3_moe",
            "qwen2_moe": "tiny_qwen2_moe"}
# (family, ZeRO stage, activation checkpointing, ranks). The suite's seven launches cover every family of the three
# the issue names with recomputation on and off, every ZeRO stage with two families, Qwen2-MoE's shared expert and
# its gate (AutoEP names them its own way: the export maps them back) and, on 4 ranks, EP 2 beside data parallelism
# (each expert held by 2 ranks whose gradients are averaged over the expert-data-parallel group). `make
# test-moe-matrix` runs every family x stage x recomputation on 2 ranks as well (26 more launches, about 6 minutes:
# docs/moe.md has its table).
SUITE_CELLS = [("mixtral", 2, False, 2), ("mixtral", 1, True, 4), ("deepseek_v3", 1, False, 2),
               ("deepseek_v3", 0, True, 2), ("qwen3_moe", 3, True, 2), ("qwen3_moe", 0, False, 2),
               ("qwen2_moe", 3, False, 2)]
CELLS = SUITE_CELLS + ([(family, stage, recompute, 2) for family in FIXTURES for stage in range(4)
                        for recompute in (False, True)] if os.environ.get("DSTRAIN_TEST_MOE_MATRIX") else [])
# AdamW's eps for the matrix. At 1e-8 a gradient element that is ~0 (its tokens' contributions cancel) steps by
# up to lr x its rounding noise / eps, and two correct runs that sum in another order end that element up to 1e-5
# apart (DeepSeek-V3 at ZeRO-3: one element of 6,144 in a kv_a_proj_with_mqa, 1.1e-5 from the one-rank run's, the
# single-process loop between the two); at 1e-6 that noise steps 100x less, while every gradient that is not
# rounding noise is far above eps. The export bounds then see the export, not AdamW's noise.
EPS = 1e-6
_one_rank_exports: dict[str, dict] = {}
# the one-rank run to compare exports with costs a launch per family: the suite's is Mixtral's (its two cells), the
# matrix compares every family's
ONE_RANK_FAMILIES = FIXTURES if os.environ.get("DSTRAIN_TEST_MOE_MATRIX") else ("mixtral",)


def one_rank_export(tmp_path_factory, cache, family: str, model) -> dict:
    """The same training on one rank without expert parallelism (ZeRO-2 with the 4 micro-batches in a row, every
    expert in transformers' own block): its export, loaded by from_pretrained. Launched once per family."""
    if family not in _one_rank_exports:
        from transformers import AutoModelForCausalLM

        from tests.e2e.test_vs_reference import COMMON
        out = tmp_path_factory.mktemp(f"one-rank-{family}")
        launch([*COMMON, f"--model.name_or_path={model}", "--ds_config", "zero2.json", "--output_dir", str(out),
                "--train.grad_accum_steps=4", f"--train.eps={EPS}"], cache, launcher="warm-python", nproc=1)
        _one_rank_exports[family] = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    return _one_rank_exports[family]


@pytest.mark.parametrize("family,stage,recompute,ranks", list(dict.fromkeys(CELLS)))
def test_expert_parallel_2_trains_as_the_plain_loop_and_exports_every_expert(tmp_path, tmp_path_factory, cache,
                                                                               request, family, stage, recompute,
                                                                               ranks):
    """DeepSpeed's AutoEP with autoep_size 2 (ds_configs/ep2_zero2.json at the stage given; each rank holds 2 of
    each layer's 4 routed experts, tokens sent to them by all-to-all; on 4 ranks two EP groups, each expert on 2
    ranks), the load-balancing loss on where the family has one, activation checkpointing in some: every step's
    loss and grad norm are the single-process reference's, and hf/ holds all 4 experts of both layers in
    transformers' fused layout (gate_up_proj [E, 2F, H], down_proj [E, H, F]) equal to the reference's weights
    and to a one-rank run's export of the same training (1e-5; ONE_RANK_FAMILIES). Before this component the same JSON failed
    at deepspeed.initialize (TypeError in AutoEP's output-registry code); with the experts left out of the
    replicas' checksum the SDC check stopped it at step 3; the export took AutoEP's per-expert files for model
    states (ZeRO-0/1/2) and zero_to_fp32 refused ZeRO-3's (NotImplementedError)."""
    import json as _json
    config = _json.loads((ROOT / "ds_configs/ep2_zero2.json").read_text())
    config["zero_optimization"]["stage"] = stage
    (tmp_path / "ep.json").write_text(_json.dumps(config))
    model = request.getfixturevalue(FIXTURES[family])
    record = {}
    # 4 ranks keep the global batch of 16: one micro-batch of 4 each
    extra = [f"--train.activation_checkpointing={str(recompute).lower()}", f"--train.eps={EPS}"] + \
        (["--train.grad_accum_steps=1"] if ranks == 4 else [])
    run_dir, ref_model = run_and_compare(tmp_path, cache, model, str(tmp_path / "ep.json"), extra=extra, nproc=ranks,
                                         router_aux={"coef": 0.02, "micro": 4} if family != "deepseek_v3" else None,
                                         record=record, eps=EPS)
    said = (run_dir / "launch_stderr.txt").read_text()
    assert "expert parallelism: 2 MoE blocks, their experts split over 2 ranks (2 per rank)" in said, said[-3000:]
    # save_pretrained writes Mixtral in its hub names (block_sparse_moe.experts.N.w1, ...): compared as loaded
    from transformers import AutoModelForCausalLM
    got, want = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict(), ref_model.state_dict()
    fused = (4, 256, 128) if family == "mixtral" else (4, 128, 128)  # [E, 2F, H]
    info = _json.loads((run_dir / "run_info.json").read_text())
    assert info["activation_checkpointing"] is recompute and info["world_size"] == ranks
    # the tokens' all-to-alls are counted apart from the rest of what a rank sends (bench/moe.py prints both)
    rows = _step_rows(run_dir)
    assert all(0 < r["comm_bytes_all_to_all"] < r["comm_bytes"] for r in rows)
    # the routing figures, counted at AutoEP's routers, also without a load-balancing loss (DeepSeek-V3)
    assert all(1.0 <= r["expert_load_max"] <= 2.0 and ("aux_loss" in r) == (family != "deepseek_v3") for r in rows)
    if "expert_load" in record:  # the reference's own count (recomputation in backward must not count twice)
        peaks = [(t.max(1) / t.mean(1)).max() for t in record["expert_load"]]
        assert [r["expert_load_max"] for r in rows] == pytest.approx(peaks, rel=1e-3)
    assert got.keys() == want.keys() and got["model.layers.1.mlp.experts.gate_up_proj"].shape == fused
    # the export against the plain loop's weights and against a one-rank run's export, both within 1e-5 (measured
    # up to 1.5e-6 and 1.2e-6 over the whole matrix, EPS above); gate and up swapped in the export, or one layer's
    # experts in the wrong order, miss by the weights' own size (~1e-1)
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    print(f"{family} ZeRO-{stage}{' recompute' if recompute else ''} EP 2 on {ranks} ranks: export within "
          f"{worst:.1e} of the plain loop's weights")
    assert worst < 1e-5, f"the export differs from the reference by {worst:.1e}"
    if family in ONE_RANK_FAMILIES:
        one_rank = one_rank_export(tmp_path_factory, cache, family, model)
        assert one_rank.keys() == got.keys()
        beside = max((got[k] - one_rank[k]).abs().max().item() for k in got)
        print(f"  and within {beside:.1e} of the one-rank run's export")
        assert beside < 1e-5, f"the export differs from the one-rank run's by {beside:.1e}"


def test_tiny_moe_recipe_learns_and_exports_every_expert(tmp_path, cache):
    """The README's MoE command as written (recipes/tiny/moe.yaml: a from-scratch tiny Mixtral of 4 layers x 8
    experts, EP 2, ZeRO-2, fp32 on 2 CPU ranks): it learns, logs the load-balancing loss and the routing figures,
    and hf/ holds every expert of every layer, loadable by from_pretrained."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import launch, metrics, readme_command

    run = tmp_path / "run"
    proc = launch(readme_command("--recipe tiny/moe") + ["--output_dir", str(run), "--log.wandb=false"], cache)
    _, evals = metrics(run)
    print(f"tiny MoE recipe: eval loss {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.3f}")
    assert evals[-1]["eval_loss"] < 0.6 * evals[0]["eval_loss"]  # measured 6.40 -> 2.41 at step 50
    # evaluation is the language model's loss alone: DeepSpeedEngine.eval() leaves the engine's own `training`
    # flag set, and eval_loss held 0.02 x the aux loss (eval_aux_loss and eval_expert_load_* logged) until the
    # objective read the module's
    assert all(set(e) == {"step", "eval_loss", "perplexity"} for e in evals), evals[0]
    assert "expert parallelism: 4 MoE blocks, their experts split over 2 ranks (4 per rank)" in proc.stderr
    rows = _step_rows(run)
    assert len(rows) == 50 and all(r["aux_loss"] > 0 and 1.0 <= r["expert_load_max"] <= 4.0 for r in rows)
    # every expert of every layer is in the file (save_pretrained writes Mixtral's hub names, one tensor per
    # expert: a missing one would be initialised at random by from_pretrained, with only a warning)
    from safetensors import safe_open
    with safe_open(run / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    want = {f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for layer in range(4) for e in range(8)
            for w in ("w1", "w2", "w3")}
    assert want <= names, sorted(want - names)[:4]
    experts = AutoModelForCausalLM.from_pretrained(run / "hf").model.layers[3].mlp.experts
    assert experts.gate_up_proj.shape == (8, 256, 128) and experts.down_proj.shape == (8, 128, 128)


def test_lora_on_an_moe_model_matches_peft(tmp_path, cache, tiny_mixtral):
    """LoRA (r=8, all-linear: peft's choice on an MoE model also adapts each block's router and its fused routed
    experts, through ParamWrapper) on the tiny Mixtral under ZeRO-3 without expert parallelism, the load-balancing
    loss on: every step is peft's own model's in the single-process loop."""
    from tests.e2e.test_lora import LORA, LORA_ARGS, LR, PARTITIONED

    run_dir, ref = run_and_compare(tmp_path, cache, tiny_mixtral, "zero3.json", extra=LORA_ARGS + PARTITIONED,
                                   lora=LORA, lr=LR, learns=0.1, router_aux={"coef": 0.02, "micro": 4})
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert json.loads((run_dir / "run_info.json").read_text())["trainable_parameters"] == trainable
    assert any(".experts." in n for n, p in ref.named_parameters() if p.requires_grad)  # what peft adapted
    assert all("expert_load_cv" in r for r in _step_rows(run_dir))  # counted at the routers peft wrapped


def test_dpo_on_an_moe_model_under_expert_parallelism_matches_the_loop(tmp_path, cache, tiny_mixtral):
    """DPO (preference training) on the tiny Mixtral with EP 2 under ZeRO-2, against the plain single-process DPO
    loop (tests/e2e/test_preference.py's): the same losses and grad norms. The run says that the preference loss
    does not add the router's load-balancing loss (its micro-batches hold pairs, its loss is no token mean)."""
    from tests.e2e.test_preference import args_for, compare_with_loop

    run_dir = tmp_path / "dpo"
    proc = launch(args_for(tiny_mixtral, "ep2_zero2.json", run_dir), cache)
    assert "expert parallelism: 2 MoE blocks, their experts split over 2 ranks" in proc.stderr
    assert "trains this Mixture-of-Experts model without its router's load-balancing loss" in proc.stderr
    compare_with_loop(run_dir, tiny_mixtral)


def test_lora_on_attention_under_expert_parallelism_matches_peft(tmp_path, cache, tiny_mixtral):
    """LoRA (r=8, all-linear) on the tiny Mixtral with EP 2 under ZeRO-2, the load-balancing loss on: under expert
    parallelism all-linear adapts the attention projections only (peft's own all-linear would also adapt each
    router and the fused experts, which AutoEP replaces), the frozen experts are split over the 2 ranks, and every
    step is peft's model with those targets in the single-process loop, also across a stop at step 4 and a resume
    on the same 2 ranks. The merged export equals the reference's merged weights, every expert included. Before this test LoRA beside
    expert_parallel was refused; without the component's moe_layer_pattern AutoEP found no MoE block under peft's
    base_model.model. prefix, and without the ZeRO mend DeepSpeed asserted that no parameter group held an expert."""
    from tests.e2e.test_lora import LORA_ARGS, LR

    attention = ["k_proj", "o_proj", "q_proj", "v_proj"]
    run_dir, ref = run_and_compare(tmp_path, cache, tiny_mixtral, "ep2_zero2.json", extra=LORA_ARGS,
                                   lora={"r": 8, "lora_alpha": 12, "target_modules": attention}, lr=LR, learns=0.1,
                                   router_aux={"coef": 0.02, "micro": 4}, resume_on=2)
    said = (run_dir / "launch_stderr.txt").read_text()
    assert f"under expert parallelism all-linear adapts {attention}" in said and "resumed from" in said, said[-3000:]
    assert "expert parallelism: 2 MoE blocks, their experts split over 2 ranks (2 per rank)" in said, said[-3000:]
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert trainable and not any(".mlp." in n for n in trainable)
    assert json.loads((run_dir / "run_info.json").read_text())["trainable_parameters"] == \
        sum(p.numel() for p in ref.parameters() if p.requires_grad)
    from transformers import AutoModelForCausalLM
    merged = ref.merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict()
    assert got.keys() == merged.keys() and got["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 256, 128)
    worst = max((got[k] - merged[k]).abs().max().item() for k in got)
    print(f"LoRA under EP 2 ZeRO-2: merged export within {worst:.1e} of peft's")
    assert worst < 1e-4, f"the export differs from the reference by {worst:.1e}"
