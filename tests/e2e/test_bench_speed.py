"""`make bench` must keep working: bench/speed.py runs train.py, a plain PyTorch loop and the Hugging Face Trainer on
the same job, checks that the Trainer really built a DeepSpeed engine, and reports comparable figures for all.
bench/profile_steps.py traces the same steps of train.py and the plain loop and says where the time goes."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# The speed bench's test checks no speed (its figures are only printed; the losses are compared with the plain
# loop's), so it runs in the parallel part: alone in the serial part it held both cores for 72-86 s while using 1.5
# of them (107 CPU-s, measured 2026-12-07); in the parallel part its work fills the other worker's idle moments.
# The profile bench compares a traced step with an untraced one: serial.


def test_speed_bench_runs_both_sides_on_the_same_job(tmp_path):
    import glob
    results = tmp_path / "speed.json"
    # the bench's smallest job (preset cpu-check: 12 steps of a 0.3M-parameter Llama): 55 CPU-s against 109 with
    # 12 steps of the `cpu` preset's 3M (measured alone, 2026-12-08); the figures are only printed here
    proc = subprocess.run([sys.executable, "bench/speed.py", "--preset", "cpu-check", "--repeats", "1",
                           "--systems", "plain", "dstrain", "hf_trainer", "--results", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(results.read_text())
    left = [p for r in out["runs"] for p in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{r['master_port']}_*")]
    assert not left, f"the bench left /dev/shm buffers: {left}"  # its own ports: the other worker's runs have theirs
    ours, peer = out["summary"]["systems"]["dstrain"], out["summary"]["systems"]["hf_trainer"]
    print(f"dstrain {ours['tokens_per_s']:.0f} tok/s, first step {ours['first_step_s']:.1f} s, loss "
          f"{ours['final_loss']:.3f}; Trainer {peer['tokens_per_s']:.0f}, {peer['first_step_s']:.1f} s, "
          f"{peer['final_loss']:.3f}")
    for side in (ours, peer):
        assert side["engine"] == "DeepSpeedEngine" and side["zero_stage"] == 2
        assert side["tokens_per_s"] > 0 and side["first_step_s"] > 0 and side["peak_rss_bytes"] > 100 * 2**20
    runs = out["runs"]
    assert len({r["tokens_per_step"] for r in runs}) == 1 and len({len(r["losses"]) for r in runs}) == 1
    # the same model, data, optimizer and schedule: both start at ln(vocab) and learn to a similar loss
    for r in runs:
        assert abs(r["losses"][0] - 6.36) < 0.2 and r["final_loss"] < r["losses"][0] - 0.8
    assert abs(ours["final_loss"] - peer["final_loss"]) < 0.15 * peer["final_loss"]
    ratio = out["summary"]["ratios"]["dstrain / hf_trainer"]["tokens_per_s"]
    assert ratio == ours["tokens_per_s"] / peer["tokens_per_s"] and f"**{ratio:.2f}x**" in proc.stdout
    # the plain loop (written apart from dstrain) trains on the same blocks in the same order with the same update:
    # train.py's losses equal its step by step, so its speed is a ratio against the same work
    losses = {r["system"]: r["losses"] for r in out["runs"]}
    assert max(abs(a - b) for a, b in zip(losses["dstrain"], losses["plain"])) < 1e-4
    assert out["summary"]["loss_gap_to_plain"]["dstrain - plain"]["max"] < 1e-4
    overhead = out["summary"]["ratios"]["dstrain / plain"]
    assert overhead["step_s"] == pytest.approx(1 / overhead["tokens_per_s"]) and "dstrain / plain" in proc.stdout


@pytest.mark.serial
def test_profile_bench_traces_both_loops(tmp_path):
    """log.trace_steps writes a trace of exactly the steps asked for; the bench reads its and the plain loop's."""
    results = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "bench/profile_steps.py", "--steps", "5", "--trace", "3-4", "--results",
                           str(results), "--keep", str(tmp_path / "traces")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(results.read_text())
    for side in ("train.py", "plain"):
        ops = out[side]["self_cpu"]
        assert ops.get("aten::mm", 0) + ops.get("aten::addmm", 0) + ops.get("aten::bmm", 0) > 0  # the matmuls
        # two steps traced, figures per step: about one untraced step's time (the profiler's cost on top)
        assert 0.6 < out[side]["wall_ms"] / out["ms_per_step"][side] < 1.9, (side, out[side]["wall_ms"])
        assert (tmp_path / "traces" / f"{side}.trace.json.gz").stat().st_size > 10_000
    assert "largest excess of train.py first" in proc.stdout and "aten::" in proc.stdout
