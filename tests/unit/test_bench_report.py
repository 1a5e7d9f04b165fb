"""bench/slow_links.py's report: what its tables say must match the runs it was given."""
from tests.helpers import ROOT


def _slow_links(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import slow_links
    return slow_links


def _run(name, shaped, losses, seconds_per_step, cpu=None):
    evals = [(step, loss, step * seconds_per_step) for step, loss in losses]
    run = {"name": name, "shaped": shaped, "seed": 42, "shaping": "tbf rate 100mbit" if shaped else "",
           "evals": evals, "losses": [1.0] * evals[-1][0], "bytes_per_step": 1e6 if shaped else 1e8,
           "step_s": seconds_per_step}
    if cpu:
        run["cpu"] = cpu
    return run


def _state(steps, runs):
    return {"params": 31.76e6, "runs": runs,
            "args": {"steps": steps, "target_step": 300, "seed": 42, "corpus": "once", "model": "30m"}}


def test_a_run_as_long_as_its_target_shows_one_target(monkeypatch):
    sl = _slow_links(monkeypatch)
    ref = _run(sl.REFERENCE, False, [(0, 6.0), (150, 1.2), (300, 1.0)], 3.0, cpu="A")
    diloco = _run("DiLoCo H=25", True, [(0, 6.0), (150, 1.1), (300, 0.9)], 2.0, cpu="A")
    text = sl.report(_state(300, [ref, diloco]))
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert header.count("eval loss at 300") == 1 and header.count("time to the step-300 loss") == 1, header
    rows = [line for line in text.splitlines() if line.startswith("| DiLoCo")]
    assert len(rows) == 1 and rows[0].count("|") == header.count("|"), (header, rows)
    assert "the target: its eval loss at step 300 (1.0000)" in text and "two targets" not in text
    # DiLoCo reaches 1.0 between its evaluations at 150 (1.1, 300 s) and 300 (0.9, 600 s): 450 s against 900 s
    assert "450 s (0.50x)" in rows[0], rows[0]
    assert "different machines" not in text


def test_runs_timed_on_different_machines_are_marked(monkeypatch):
    sl = _slow_links(monkeypatch)
    ref = _run(sl.REFERENCE, False, [(0, 6.0), (300, 1.0), (1000, 0.7)], 3.0)  # an older run: no CPU recorded
    diloco = _run("DiLoCo H=25", True, [(0, 6.0), (300, 0.9), (1000, 0.69)], 2.0, cpu="AMD EPYC")
    text = sl.report(_state(1000, [ref, diloco]))
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert header.count("eval loss at") == 2 and "two targets" in text
    assert "Timed on different machines" in text and "on AMD EPYC" in text and "a CPU not recorded" in text


def test_the_streaming_table_shows_each_ways_bytes_and_hold_up(monkeypatch):
    """bench/streaming.py's table: the medians over repeats, and each way's hold-up against the whole-model sync's."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import streaming

    def run(name, holdup, peak):
        return {"name": name, "shaping": "tbf rate 100mbit", "median_s": 3.0, "mean_s": 3.1, "holdup_s": holdup,
                "bytes_mean": 6.6e5, "bytes_peak": peak, "final_loss": 2.0}
    runs = [run("whole", 2.0, 16.8e6), run("fragments", 2.2, 3.4e6), run("overlapped", 0.5, 3.4e6),
            run("whole", 3.0, 16.8e6), run("fragments", 2.0, 3.4e6), run("overlapped", 0.7, 3.4e6)]
    text = streaming.report({"args": {"model": "30m", "steps": 100}, "params": 31.76e6, "runs": runs})
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ") and "way" not in line}
    assert "16.80 MB" in rows["whole"] and "3.40 MB" in rows["overlapped"]
    assert rows["whole"].endswith("| 2.50 s | 1.00x |") and rows["overlapped"].endswith("| 0.60 s | 0.24x |"), rows
    assert "2 run(s) of each" in text


def test_the_orders_mean_carries_its_standard_error(monkeypatch):
    """The 2% judgement needs the orders' spread: +1% and +3% are a mean of +2.00% with a standard error of 1.0%
    (sample deviation 1.41% / sqrt(2)); one order has none."""
    sl = _slow_links(monkeypatch)
    assert sl._mean_cell([0.01, 0.03]) == "**+2.00%** ± 1.0% (2)"
    assert sl._mean_cell([-0.05]) == "**-5.00%** (1)" and sl._mean_cell([]) == ""


def test_the_side_by_side_table_times_each_run_against_its_own_reference(monkeypatch):
    sl = _slow_links(monkeypatch)
    ref = _run(sl.REFERENCE, False, [(0, 6.0), (150, 1.2), (300, 1.0)], 3.0)
    diloco = _run("DiLoCo H=25", True, [(0, 6.0), (200, 1.1), (400, 0.9)], 2.5)
    late = _run("DiLoCo H=50", True, [(0, 6.0), (200, 1.3), (400, 1.1)], 2.5)
    contrast = _run(sl.REFERENCE, True, [(0, 6.0)], 12.0)
    for r, stop in ((ref, 300), (diloco, 400), (late, 400), (contrast, 30)):
        r["stopped"] = stop
    sbs = {"cpu": "A", "date": "2026-11-28", "commit": "abc", "seed": 42, "runs": [ref, diloco, late, contrast]}
    text = sl.report({**_state(300, [ref, diloco]), "side_by_side": sbs})
    table = text.split("Timed side by side")[1].splitlines()
    rows = {line.split(" | ")[0][2:] + line.split(" | ")[1]: line for line in table if line.startswith("| ")}
    # the target is the reference's eval at 300 (1.0, reached at 900 s); DiLoCo crosses 1.0 halfway between its
    # evals at 200 (500 s) and 400 (1,000 s): 750 s, 0.83x
    assert "(1.0000)" in text and "750 s (measured) | **0.83x**" in rows["DiLoCo H=25shaped"], rows
    assert "not reached by step 400 | > 1.11x" in rows["DiLoCo H=50shaped"], rows
    # the shaped synchronous run: 300 of its 12 s steps, projected
    assert "3600 s (projected: 300 x its median step) | **4.00x**" in rows[sl.REFERENCE + "shaped"], rows
    assert "900 s (measured) | **1.00x**" in rows[sl.REFERENCE + "unshaped"], rows


def test_profile_analysis_of_a_known_trace(monkeypatch, tmp_path):
    """bench/profile_steps.py: own time is an op's time less its children's; device busy time is the union of the
    kernels' intervals; idle gaps over 50 us are counted; everything per traced step."""
    import json
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import profile_steps

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}
    events = [op("aten::linear", 0, 100), op("aten::mm", 10, 60), op("aten::add", 80, 10),
              op("aten::mm", 0, 30, tid=2),  # another thread: no parent
              kernel("gemm", 20, 40), kernel("gemm", 50, 30),  # overlapping: 20-80 busy
              kernel("add", 200, 10)]  # 120 us idle before it: one gap over 50 us
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events + [{"ph": "i", "name": "marker", "ts": 5}]}))
    got = profile_steps.analyse(path, steps=2)
    assert got["self_cpu"] == {"aten::linear": (100 - 60 - 10) / 2e3, "aten::mm": 90 / 2e3, "aten::add": 10 / 2e3}
    assert got["device_busy_ms"] == (60 + 10) / 2e3 and got["wall_ms"] == 210 / 2e3
    assert got["idle_gaps_over_50us"] == 0.5 and got["kernels"]["gemm"] == (70 / 2e3, 1.0)
