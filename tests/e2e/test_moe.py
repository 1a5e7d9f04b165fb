"""Mixture-of-Experts models (issue 71) on 2 CPU ranks against the plain single-process loop (tests/helpers.py:
reference_losses), whose loss adds transformers' own load-balancing loss per micro-batch (consecutive runs of
micro_batch_size rows of the global batch), averaged over the global batch, at the model config's weight."""
import json

import pytest

from tests.e2e.test_vs_reference import STEPS, _step_rows, run_and_compare
from tests.helpers import ROOT


def test_the_load_balancing_loss_trains_as_the_plain_loop_and_on_another_world_size(tmp_path, cache, tiny_mixtral):
    """ZeRO-2, 4 routed experts (2 per token) in each of 2 layers, the config's weight 0.02 (nothing in the recipe):
    stopped at step 4 on 2 ranks and finished on 1 (accumulation 2 -> 4, the same micro-batches), every step's loss
    and grad norm are the reference's, and the logged aux_loss and lm_loss are the reference's two parts, the routing figures its count's. Without
    the aux loss (--model.router_aux_loss_coef=0) every step differs from this reference, by up to 8.8e-3 relative."""
    record = {}
    run_dir, _ = run_and_compare(tmp_path, cache, tiny_mixtral, "zero2.json", resume_on=1, record=record,
                                 router_aux={"coef": 0.02, "micro": 4})
    rows = _step_rows(run_dir)
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
    assert health["expert_load_cv"]["first"] == round(rows[0]["expert_load_cv"], 4)  # kept over the resume
    assert health["routing_collapsed_at"] is None
    said = (run_dir / "launch_stderr.txt").read_text()
    assert "router load-balancing loss: 0.02 x the model's aux_loss" in said, said[-3000:]
    assert json.loads((run_dir / "run_info.json").read_text())["world_size"] == 1 and len(rows) == STEPS


# two launches for two stages and two families (Mixtral at ZeRO-1 measured 5.7e-8 / 2.1e-6 / 3.1e-5 as at ZeRO-2)
@pytest.mark.parametrize("family,stage", [("mixtral", 2), ("deepseek_v3", 1)])
def test_expert_parallel_2_trains_as_the_plain_loop_and_exports_every_expert(tmp_path, cache, request, family,
                                                                               stage):
    """DeepSpeed's AutoEP with autoep_size 2 on 2 ranks (ds_configs/ep2_zero2.json; each rank holds 2 of each
    layer's 4 routed experts, tokens sent to them by all-to-all), the load-balancing loss on: every step's loss and
    grad norm are the single-process reference's, and hf/ holds all 4 experts of both layers in transformers'
    fused layout (gate_up_proj [E, 2F, H], down_proj [E, H, F]) equal to the reference's weights. Before this
    component the same JSON failed at deepspeed.initialize (TypeError in AutoEP's output-registry code); with the
    experts left out of the replicas' checksum the SDC check stopped it at step 3; the export took AutoEP's
    per-expert files for model states."""
    import json as _json
    config = _json.loads((ROOT / "ds_configs/ep2_zero2.json").read_text())
    config["zero_optimization"]["stage"] = stage
    (tmp_path / "ep.json").write_text(_json.dumps(config))
    # Mixtral with its load-balancing loss; DeepSeek-V3 (a shared expert beside the routed ones, no aux loss)
    model = request.getfixturevalue("tiny_mixtral" if family == "mixtral" else "tiny_deepseek")
    run_dir, ref_model = run_and_compare(tmp_path, cache, model, str(tmp_path / "ep.json"),
                                         router_aux={"coef": 0.02, "micro": 4} if family == "mixtral" else None)
    said = (run_dir / "launch_stderr.txt").read_text()
    assert "expert parallelism: 2 MoE blocks, their experts split over 2 ranks (2 per rank)" in said, said[-3000:]
    # save_pretrained writes Mixtral in its hub names (block_sparse_moe.experts.N.w1, ...): compared as loaded
    from transformers import AutoModelForCausalLM
    got, want = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict(), ref_model.state_dict()
    fused = (4, 256, 128) if family == "mixtral" else (4, 128, 128)  # [E, 2F, H]
    assert got.keys() == want.keys() and got["model.layers.1.mlp.experts.gate_up_proj"].shape == fused
    # the suite's export bound against the reference (test_vs_reference.py); measured 3.1e-5 at ZeRO-1 (AdamW's
    # normalised step magnifies a reduction order's rounding where a gradient is near 0); gate and up swapped in
    # the export, or one layer's experts in the wrong order, miss by the weights' own size (~1e-1)
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    print(f"{family} ZeRO-{stage} EP 2: export within {worst:.1e} of the reference")
    assert worst < 1e-4, f"the export differs from the reference by {worst:.1e}"
