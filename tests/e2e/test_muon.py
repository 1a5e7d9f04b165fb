"""Muon (train.optimizer=muon) on 2 CPU ranks against a plain single-process loop with Muon written in the tests.

The reference (tests/helpers.py: muon_step, newton_schulz) orthogonalises the Nesterov momentum of every trained
matrix that is not an embedding with Jordan et al.'s quintic Newton-Schulz iteration, scales it by
sqrt(max(1, rows / cols)) and applies decoupled weight decay; torch AdamW updates the rest. DeepSpeed on the CPU
accelerator runs its default ("gram") iteration in fp32 where oneDNN has no fp16 matmul (this machine, an AMD EPYC
with avx512_bf16 but no avx512_fp16) and in fp16 where it has one (a CPU with avx512_fp16 or AMX-FP16, as one of
CI's machines is: there every compared test failed by 1.2e-5 to 1.6e-5). The reference stays in fp32; the test
reads DeepSpeed's dtype (ns_compute_dtype, exported for exactly this) and takes the bounds that dtype allows. In
fp32 the only differences are summation order: measured up to 1.0e-7 over 8 steps for ZeRO-0/1/2/3 and ZeRO-2/3
with CPU offload, within test_vs_reference's RTOL (2e-6). In fp16: FP16 below, from the gaps measured with
DeepSpeed made to take its fp16 path on this machine. What the bounds catch (each seen): every parameter left on AdamW (DeepSpeed #8438's failure, made by a fault with the run-time
proof off: the run finished with exit 0) differs from the reference by 1.9e-2 at step 2 and 2.0e-2 at most; GPT-2's
`wte` and `wpe` tagged by DeepSpeed's name rule (keep_muon_tags off: Muon on the embeddings) by 3.7e-2; Muon's
gradients accumulated over steps (a bug of this reference's first draft) by 1.3e-3 at step 3, 1.2e-2 at most.
"""
import json

import pytest

from tests.e2e.test_vs_reference import GRAD_NORM_RTOL, RTOL, STEPS, assert_export_matches, run_and_compare
from tests.helpers import kill_rank_after_checkpoint, launch, metrics, reference_losses

MUON = {"lr": 0.02, "momentum": 0.95}
ARGS = ["--train.optimizer=muon"]
# DeepSpeed's fp16 iteration against the fp32 reference, measured on this machine with DeepSpeed made to take its fp16
# path: losses 1.5e-5 to 2.1e-5 (ZeRO-0/1/3, ZeRO-3 offload, kill -9 and resume), the logged grad norm 3.4e-4
FP16 = {"rtol": 1e-4, "norm_rtol": 2e-3, "export_atol": 2e-3}


def bounds() -> dict[str, float]:
    """The bounds on the losses, the logged grad norm and the exported weights for the dtype DeepSpeed's iteration
    runs in on this machine (the module's docstring)."""
    import torch
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    if ns_compute_dtype("gram") == torch.float32:
        return {"rtol": RTOL, "norm_rtol": GRAD_NORM_RTOL, "export_atol": 1e-4}
    return FP16


def said(run_dir) -> str:
    return (run_dir / "launch_stderr.txt").read_text()


def test_zero1_gpt2_embeddings_stay_on_adamw(tmp_path, cache, tiny_gpt2):
    """GPT-2 names its embeddings wte and wpe: DeepSpeed's own rule ("embed" in the name) would put both on Muon.
    The log line counts what the optimizer did in step 1: 8 matrices orthogonalised, 20 tensors on AdamW."""
    bound = bounds()
    run_dir, _ = run_and_compare(tmp_path, cache, tiny_gpt2, "zero1.json", extra=ARGS, muon=MUON, max_grad_norm=0,
                                 norm_rtol=None, rtol=bound["rtol"])
    line = next(x for x in said(run_dir).splitlines() if x.startswith("muon: "))
    assert "step 1 orthogonalised 8 matrices (98,304 elements" in line, line
    assert "AdamW updated 20 tensors (55,040 elements" in line, line
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["optimizer"]["type"] == "Muon" and ds["gradient_clipping"] == 0.0
    assert ds["optimizer"]["params"]["muon_lr"] == 0.02 and ds["optimizer"]["params"]["adam_lr"] == 3e-3


@pytest.mark.parametrize("ds_config", ["zero3.json", "zero3_offload.json"])
def test_zero3_built_under_zero_init(tmp_path, cache, tiny_llama, ds_config):
    """ZeRO-3 builds the model inside zero.Init (every local tensor flat: the tags read ds_shape); with CPU offload
    DeepSpeed orthogonalises on the host. The ZeRO-3 run stops at step 4 and finishes on 1 rank (Muon's momentum,
    partitioned as the weights, through the universal conversion). The export holds the reference's weights."""
    import torch

    bound = bounds()
    run_dir, ref_model = run_and_compare(tmp_path, cache, tiny_llama, ds_config, extra=ARGS, muon=MUON,
                                         max_grad_norm=0, norm_rtol=None, rtol=bound["rtol"],
                                         resume_on=1 if ds_config == "zero3.json" else None)
    info = json.loads((run_dir / "run_info.json").read_text())
    if ds_config == "zero3_offload.json":  # (the other run's run_info is its 1-rank resume's)
        assert info["parameters_on_rank0_at_build"] <= info["parameters"] / 2 + 1000  # partitioned at build
    assert "orthogonalised 14 matrices (362,496 elements" in said(run_dir)
    assert json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["reduce_scatter"] is False
    assert_export_matches(run_dir, ref_model, bound["export_atol"], torch.float32)


def test_zero0_clips_the_gradient(tmp_path, cache, tiny_llama):
    """ZeRO-0 clips the gradient before Muon's momentum sees it (the reference's clip_grad_norm_): a bound every
    step meets, so the logged pre-clip norm is the gradient's too."""
    bound = bounds()
    run_and_compare(tmp_path, cache, tiny_llama, "zero0.json", extra=ARGS + ["--train.max_grad_norm=0.5"],
                    muon=MUON, max_grad_norm=0.5, rtol=bound["rtol"], norm_rtol=bound["norm_rtol"])


def test_kill9_then_resume_on_one_rank(tmp_path, cache, tiny_llama):
    """ZeRO-2 on 2 ranks, rank 1 killed with SIGKILL after the step-4 checkpoint; resumed on 1 rank (the global
    batch kept, the checkpoint converted to universal with Muon's momentum carried through DeepSpeed's converter,
    which has no place for it: KeyError 'exp_avg' before): every step's loss is the reference's."""
    run_dir = tmp_path / "run"
    args = [f"--model.name_or_path={tiny_llama}", "--ds_config", "zero2.json", "--output_dir", str(run_dir),
            f"--train.max_steps={STEPS}", "--train.lr=3e-3", "--train.warmup_steps=2", "--train.min_lr_ratio=0.1",
            "--train.micro_batch_size=4", "--train.grad_accum_steps=2", "--train.seq_len=64",
            "--train.precision=fp32", "--eval.max_batches=2", "--log.wandb=false", "--log.progress_bar=false",
            "--checkpoint.every=4", "--world_size=2", *ARGS]
    bound = bounds()
    killed = kill_rank_after_checkpoint(args, run_dir, cache, step=4, rank=1)
    assert killed.returncode != 0, killed.stdout[-3000:]
    resumed = launch(args, cache, launcher="warm-python")
    assert "universal checkpoint" in resumed.stderr, resumed.stderr[-3000:]
    import torch
    saved = torch.load(run_dir / "checkpoints/step_00000004/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    assert set(saved) == {"momentum_buffer"}  # the conversion rewrote a copy, never the checkpoint
    got, _ = metrics(run_dir)
    want, _ = reference_losses(tiny_llama, run_dir, STEPS, 3e-3, 2, 0.1, weight_decay=0.1, max_grad_norm=0,
                               muon=MUON)
    assert len(got) == STEPS and got == pytest.approx(want, rel=bound["rtol"])


def test_muon_silently_off_stops_the_run(tmp_path, cache, tiny_llama):
    """DeepSpeed #8438 left every parameter on AdamW without a word (the tags cleared by a fault here): the run
    stops after its first step with one line, exit 2, and writes no checkpoint."""
    run_dir = tmp_path / "run"
    proc = launch([f"--model.name_or_path={tiny_llama}", "--ds_config", "zero2.json", "--output_dir", str(run_dir),
                   "--train.max_steps=4", "--train.micro_batch_size=2", "--train.seq_len=64", "--log.wandb=false",
                   "--log.progress_bar=false", "--eval.every=0", *ARGS], cache, launcher="warm", check=False,
                  DSTRAIN_FAULT="muon:untag")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Muon's update did not run on every tagged matrix in step 1" in errors[0], errors
    assert "0 orthogonalised over the ranks; missing 4 x [64, 128], 4 x [128, 128]" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not list((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else True
