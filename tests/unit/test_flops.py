"""FLOPs per token, the peak table and the measured peak behind MFU."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dstrain import flops
from dstrain.config import REPO_ROOT


def _tiny(**overrides):
    config = AutoConfig.from_pretrained(REPO_ROOT / "recipes/tiny/model")
    config.update(overrides)
    model = AutoModelForCausalLM.from_config(config)
    return config, sum(p.numel() for p in model.parameters())


def _matmul_flops_by_hand(config, seq_len: int) -> float:
    """Forward multiply-adds of every Linear plus attention, counted from the shapes (x2 FLOPs, x3 fwd+bwd)."""
    d, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * inter  # q, k+v, o, gate/up/down
    attention = 2 * seq_len * heads * hd  # QK^T and AV per token, full square
    return 3 * 2 * (layers * (per_layer + attention) + d * vocab)  # + the LM head


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_matches_a_count_of_the_matmuls(tied):
    config, params = _tiny(tie_word_embeddings=tied)
    # the formula counts norm weights as matmul parameters (6 FLOPs each); the hand count does not
    norms = config.hidden_size * (2 * config.num_hidden_layers + 1)
    assert flops.flops_per_token(config, params, 128) - 6 * norms == pytest.approx(_matmul_flops_by_hand(config, 128))


def test_peak_table_takes_the_most_specific_name():
    assert flops.table_peak("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert flops.table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert flops.table_peak("NVIDIA A100-SXM4-80GB", "fp16") == 312e12
    assert flops.table_peak("NVIDIA A10", "bf16") == 125e12
    assert flops.table_peak("NVIDIA H200", "fp32") is None  # no tensor-core figure: measured instead
    assert flops.table_peak("Some Future GPU", "bf16") is None


def test_measured_cpu_peak_is_in_a_plausible_range():
    peak = flops.device_peak(torch.device("cpu"), "fp32")
    assert 1e8 < peak.flops < 1e13 and "fp32 matmul" in peak.source and "measured" in peak.source


def test_profiler_config_names_deepspeeds_zero_based_step(tmp_path):
    cfg = flops.profiler_config(5, str(tmp_path / "p.txt"))
    assert cfg["enabled"] and cfg["profile_step"] == 4 and cfg["output_file"].endswith("p.txt")


def test_a_peak_measured_on_a_busy_machine_gives_way_to_the_best_seen(tmp_path, monkeypatch):
    """Issue 29 item 5: the peak measured while the other ranks imported was 5-10x low, and MFU read 107-233%.
    The best rate ever measured for the machine is cached and used when a measurement comes out lower."""
    monkeypatch.setenv("DSTRAIN_CACHE", str(tmp_path))
    rates, took = iter([2e10, 5e9]), []  # an idle machine, then a busy one
    monkeypatch.setattr(flops, "measure_matmul_peak",
                        lambda precision, device, seconds: took.append(seconds) or next(rates))
    idle = flops.device_peak(torch.device("cpu"), "fp32")
    busy = flops.device_peak(torch.device("cpu"), "fp32")
    assert took == [0.3, 0.1]  # a figure cached: a shorter measurement, only to raise it
    assert idle.flops == 2e10 and "measured fp32 matmul" in idle.source
    assert busy.flops == 2e10 and "cached" in busy.source and "0.005 TFLOP/s now" in busy.source
    flops.record_achieved(torch.device("cpu"), "fp32", 3e10)  # a step beat the peak: the cache learns
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda precision, device, seconds: 1e9)
    assert flops.device_peak(torch.device("cpu"), "fp32").flops == 3e10
    assert flops.device_peak(torch.device("cpu"), "bf16").flops == 1e9  # another key: its own figure


def test_mfu_above_100_percent_is_never_printed(tmp_path, capsys):
    from dstrain.config import LogConfig
    from dstrain.metrics import Metrics, read_metrics
    from dstrain.parallel.dist import DistContext

    raised = []
    metrics = Metrics(tmp_path, LogConfig(wandb=False, progress_bar=False, plot=False), DistContext(0, 0, 1), 0, 3,
                      {}, flops_per_token=1e6, peak_flops=1e9, on_peak_too_low=raised.append)
    metrics.step(1, 2.0, 1e-3, 1.0, 500, 500, 1.0)  # 5e8 FLOP/s: 50%
    metrics.step(2, 2.0, 1e-3, 1.0, 2000, 2000, 1.0)  # 2e9 FLOP/s: above the peak
    metrics.step(3, 2.0, 1e-3, 1.0, 500, 500, 1.0)
    metrics.close({"status": "finished", "max_steps": 3})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["mfu"] for r in rows] == [0.5, None, None]
    assert raised == [2e9]
    err = capsys.readouterr().err
    assert "above the measured peak" in err
    summary = err.split("run finished")[-1]
    assert "median 1,250 tokens/s" in summary and "MFU" not in summary, summary
