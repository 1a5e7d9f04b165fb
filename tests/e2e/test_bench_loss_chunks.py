"""bench/loss_chunks.py must keep working, and its claim must hold on a small job: the chunked head trains the
same losses as full logits with a clearly lower peak (full fp32 logits here: 1,024 tokens x 32,000 = 125 MiB,
which the plain path holds several times over: output, log-softmax, their gradients)."""
import json
import subprocess
import sys

from tests.helpers import ROOT


def test_chunked_loss_bench_same_losses_less_memory(tmp_path):
    results = tmp_path / "loss.json"
    proc = subprocess.run([sys.executable, "bench/loss_chunks.py", "--vocab", "32000", "--seq_len", "256",
                           "--steps", "3", "--repeats", "1", "--chunks", "0", "256", "--results", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(results.read_text())
    print(proc.stdout[-1500:])
    assert out["loss_gap"] < 1e-5
    assert len(out["runs"]["256"][0]["losses"]) == 3
    assert out["peak_mib"]["256"] < out["peak_mib"]["0"] - 150, out["peak_mib"]
