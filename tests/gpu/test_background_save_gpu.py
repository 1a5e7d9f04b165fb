"""Background checkpoints on a CUDA GPU (dstrain/run/background_save.py): the copy off the device lands in page-locked
host buffers of exactly its size (background_save.HostPages, cudaHostRegister), where PyTorch's pinned allocator
rounds each up to a power of two (the 30.8 GB host peak of gpu-1b on an H200 and an H100); and a run killed after
a background save resumes from it to the losses the killed run computed. Skipped without a GPU (CI has none)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import launch, metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 2**20


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def test_copies_off_the_gpu_are_page_locked_at_their_own_size(tmp_path):
    from dstrain.run import checkpoint
    from dstrain.run.background_save import Writer

    sizes = [257 * MiB // 4, 300 * MiB // 4, 129 * MiB // 4]  # fp32 elements: each just past a power of two in bytes
    state = {f"b{i}": torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(sizes)}
    writer = Writer(0, checkpoint._file_record)
    before = _rss()
    job = writer.begin(4, tmp_path)
    writer.put(state, tmp_path / "state.pt")
    writer.seal()
    assert job.done.wait(120) and job.error is None, job.error
    grown = _rss() - before
    exact = sum(4 * n for n in sizes)
    held = sorted(s.nbytes() for s in writer.pages.held.values())
    assert held == sorted(4 * n for n in sizes)
    assert all(torch.empty(0, dtype=torch.uint8).set_(s).is_pinned() for s in writer.pages.held.values())
    before_pinned = _rss()
    probe = [torch.empty(4 * n, dtype=torch.uint8, pin_memory=True) for n in sizes]  # PyTorch's own allocator
    for t in probe:
        t.fill_(1)
    rounded = _rss() - before_pinned
    print(f"host copy of {exact / MiB:,.0f} MiB from {torch.cuda.get_device_name()}: RSS grew {grown / MiB:,.0f} MiB "
          f"(page-locked at size); PyTorch's pinned allocator: {rounded / MiB:,.0f} MiB")
    assert grown < exact * 1.15, (grown, exact)
    saved = torch.load(tmp_path / "state.pt")
    assert [saved[f"b{i}"][[0, -1]].tolist() for i in range(3)] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]

    # the next save reuses two buffers and lets the third go (unregistered first); a fresh one registers again
    for t in state.values():
        t.mul_(10)
    job = writer.begin(8, tmp_path)
    writer.put({"b0": state["b0"], "b1": state["b1"]}, tmp_path / "next.pt")
    writer.seal()
    assert job.done.wait(120) and job.error is None, job.error
    assert sorted(s.nbytes() for s in writer.pages.held.values()) == sorted(4 * n for n in sizes[:2])
    job = writer.begin(12, tmp_path)
    writer.put({"b2": state["b2"]}, tmp_path / "last.pt")
    writer.seal()
    assert job.done.wait(120) and job.error is None, job.error
    assert torch.load(tmp_path / "next.pt")["b1"][-1].item() == 20.0
    assert torch.load(tmp_path / "last.pt")["b2"][0].item() == 30.0
    assert [s.nbytes() for s in writer.pages.held.values()] == [4 * sizes[2]]


def test_a_run_killed_after_a_background_save_on_the_gpu_resumes_to_the_same_losses(tmp_path, cache, tiny_llama):
    """Step 4's save is a background one (copied off the GPU into page-locked memory); rank 0 is killed at step 7;
    the resumed run recomputes steps 5 and 6 as the killed run had, and its last save (step 8) is written before
    the run ends."""
    run = tmp_path / "run"
    args = ["--train.max_steps=8", "--train.lr=3e-3", "--train.warmup_steps=3", "--train.micro_batch_size=4",
            "--train.grad_accum_steps=2", "--train.seq_len=64", "--train.precision=fp32", "--eval.every=0",
            "--log.wandb=false", "--log.progress_bar=false", "--ds_config", "zero2.json", "--checkpoint.every=4",
            "--checkpoint.background=true", f"--model.name_or_path={tiny_llama}", "--output_dir", str(run)]
    first = launch(args, cache, check=False, launcher="torchrun", nproc=1, DSTRAIN_FAULT="step:kill:step=7")
    assert first.returncode != 0 and "checkpoints: written in the background" in first.stderr, first.stderr[-3000:]
    killed = metrics(run)[0]
    assert len(killed) == 6 and (run / "checkpoints" / "step_00000004" / "complete.json").exists(), first.stderr[-3000:]
    resumed = launch(args, cache, launcher="torchrun", nproc=1)
    assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr, resumed.stderr[-3000:]
    got = metrics(run)[0]
    print(f"{torch.cuda.get_device_name()}: killed run steps 5-6 {killed[4:6]}, resumed {got[4:6]}")
    assert len(got) == 8 and got[4:6] == pytest.approx(killed[4:6], rel=1e-5, abs=0)
    assert (run / "checkpoints" / "step_00000008" / "complete.json").exists()
