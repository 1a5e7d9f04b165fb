"""Issue 33's wire formats on a CUDA GPU: the gradient compressors (powersgd, sign, topk with error feedback) and
DiLoCo's pseudo-gradient encodings (bf16, int8, int4 with error feedback) computed on CUDA tensors give what the
CPU gives, and keep their error-feedback sums. GPU users run exactly this code on their gradients; the CPU tests
cannot see a tensor made on the wrong device or a kernel that rounds differently. Skipped without a GPU.

Two processes on one GPU cannot form an NCCL group (NCCL refuses a duplicate device), so the compressors' two
ranks talk through gloo here, which carries CUDA tensors; the arithmetic is on the GPU either way."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_compression import SHAPES, _run, _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("method", ["topk", "sign", "powersgd"])
def test_compressors_on_cuda_tensors_match_the_cpu_and_keep_the_sum(method, tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cuda").mkdir()
    cpu = _run(2, _train, tmp_path / "cpu", method, 12, 2)
    gpu = _run(2, _train, tmp_path / "cuda", method, 12, 2, None, 0, "cuda")  # the gradients on the GPU
    worst = max(float((g - c).abs().max() / c.abs().max()) for a, b in zip(gpu[0]["applied"], cpu[0]["applied"])
                for g, c in zip(a, b))
    print(f"{method}: {torch.cuda.get_device_name()}, worst relative difference to the CPU over 12 steps "
          f"{worst:.2e}")
    for i in range(len(SHAPES)):  # error feedback on the GPU: applied + mean residual == the true mean's sum
        applied = sum(step[i] for step in gpu[0]["applied"])
        truth = sum(step[i] for step in gpu[0]["mean"])
        residual = sum(r["state"]["errors"].get(i, torch.zeros(SHAPES[i])) for r in gpu) / 2
        torch.testing.assert_close(applied + residual, truth, rtol=1e-4, atol=1e-4)
    # topk's selection and sums are exact on both (the same entries, added in the same order); sign's block means
    # and powersgd's matrix products and QR are reduced in another order on the GPU
    assert worst == 0 if method == "topk" else worst < 1e-3, worst


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_diloco_wire_encodings_on_cuda_match_the_cpu(dtype):
    from dstrain.components.diloco import decode, encode

    g = torch.Generator().manual_seed(3)
    values = torch.randn(100_003, generator=g) * torch.logspace(-6, 0, 100_003)
    carry = torch.randn(100_003, generator=g) * 1e-4
    for device in ("cpu", "cuda"):
        pseudo = values.to(device) + carry.to(device)
        payload = encode(pseudo, dtype)
        assert all(t.device.type == device for t in payload)
        sent = decode(payload, dtype, pseudo.numel())
        kept = pseudo - sent
        assert torch.equal(sent + kept, pseudo)  # what is sent plus what is carried to the next sync
        if device == "cpu":
            want = [t.clone() for t in payload]
        else:
            mismatched = sum(int((t.cpu() != w).sum()) for t, w in zip(payload, want))
            print(f"{dtype}: {mismatched} of {sum(w.numel() for w in want)} wire elements differ from the CPU's")
            assert mismatched == 0


@pytest.mark.parametrize("dtype", ["int4", "fp32"])
def test_diloco_sync_with_the_outer_state_in_host_memory_and_the_weights_on_the_gpu(tmp_path, dtype):
    """An offloaded optimizer's DiLoCo: the outer state in host memory, the weights and the collectives' buckets
    on the GPU (4 gloo ranks in 2 replicas of 2 on the one GPU); after two syncs the weights are the outer step
    written out by hand (tests/unit/test_diloco.py's worker, there all on the CPU)."""
    import torch.multiprocessing as mp

    from tests.unit.test_diloco import _sync_worker

    mp.start_processes(_sync_worker, args=(str(tmp_path / "store"), dtype, 128, "cuda", "cpu"), nprocs=4,
                       start_method="spawn")
