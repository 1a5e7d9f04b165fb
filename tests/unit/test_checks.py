"""The run's quiet checks in-process, against the bugs the launched tests missed (issue 70: each planted on main,
every test passed): the rollout's nucleus cut on ties, the skipped-step counts across a resume, slow-rank strikes
that must be consecutive, and the weights checksum's majority with two replicas."""
from __future__ import annotations

import json

import pytest
import torch

from dstrain.config import FaultConfig


def test_top_p_keeps_the_smallest_set_that_reaches_it_also_on_ties():
    """Four equal logits, top_p 0.5: two tokens reach it exactly; a cut on `>` kept three."""
    from dstrain.objectives.rollout import Sampling, filtered_probs

    probs = filtered_probs(torch.zeros(1, 4), Sampling(max_new_tokens=1, temperature=1.0, top_p=0.5, top_k=0))
    assert int((probs > 0).sum()) == 2 and probs.sum().item() == pytest.approx(1.0)
    probs = filtered_probs(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), Sampling(1, 1.0, 0.99, 0))
    assert int((probs > 0).sum()) == 4  # 0.99 is reached only with the last token


def test_a_resumed_run_keeps_its_skipped_step_counts():
    """The health state goes into the checkpoint's manifest (JSON) and back; summary.json and the metrics' running
    total continue from it rather than from 0."""
    from dstrain.run.health import StepHealth

    first = StepHealth(FaultConfig(), False, print)
    first.skipped, first.spikes, first.in_a_row = {"non-finite": 2, "spike": 1}, {"loss": 3}, 1
    first.losses.extend([2.0, 1.9])
    state = json.loads(json.dumps(first.state()))
    resumed = StepHealth(FaultConfig(), False, print)
    resumed.restore(state)
    assert resumed.skipped == {"non-finite": 2, "spike": 1} and resumed.spikes == {"loss": 3}
    assert resumed.in_a_row == 1 and list(resumed.losses) == [2.0, 1.9]
    resumed.sdc = resumed.stragglers = None
    assert resumed.summary()["skipped_steps"] == {"non-finite": 2, "spike": 1}


def _stragglers(monkeypatch, tmp_path, windows, checks=2):
    """Stragglers of rank 0 in a world of 2, the all-gather replaced by each window's (rank 0, rank 1) compute
    times; returns what it said."""
    from dstrain.run.stragglers import Stragglers

    said = []
    cfg = FaultConfig(straggler_every=1, straggler_factor=1.5, straggler_checks=checks)
    check = Stragglers(cfg, 0, 2, ["a", "b"], tmp_path, said.append, torch.device("cpu"))
    times = iter(windows)

    def all_gather(out, mine):
        for slot, value in zip(out, next(times)):
            slot.fill_(value)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    for step in range(1, len(windows) + 1):
        check.step(step, 1.0, 0.0)
    return check, said


def test_slow_windows_that_are_not_consecutive_name_no_rank(monkeypatch, tmp_path):
    check, said = _stragglers(monkeypatch, tmp_path, [(1.0, 2.0), (1.0, 1.0), (1.0, 2.0), (1.0, 1.0), (1.0, 2.0)])
    assert said == [] and check.named == {}


def test_a_named_rank_that_recovers_is_said_again(monkeypatch, tmp_path):
    check, said = _stragglers(monkeypatch, tmp_path, [(1.0, 2.0), (1.0, 2.0), (1.0, 1.0)])
    assert len(said) == 2 and said[0].startswith("slow rank: rank 1 on b") and check.named[1]["step"] == 2
    assert said[1] == "rank 1 (b) is no longer slow at step 3 (1.00x the median)"
    assert check.named[1]["recovered_at"] == 3
    assert json.loads((tmp_path / "events.jsonl").read_text())["rank"] == 1


def test_two_replicas_that_differ_are_both_named(monkeypatch):
    """With two data-parallel ranks there is no majority: the message names both, never one at random."""
    from dstrain.parallel.layout import Layout
    from dstrain.run import sdc

    said = []
    check = sdc.CorruptionCheck(FaultConfig(sdc_check_every=1), Layout(2), 2, ["a", "b"], said.append)
    model = torch.nn.Linear(4, 4)
    mine = sdc.checksum(model.parameters())
    for theirs in ((mine + 1, mine), (mine, mine + 1)):  # which rank's copy differs cannot be told
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(torch.distributed, "all_gather_object",
                            lambda out, obj, group=None, sums=theirs: out.__setitem__(slice(None), list(sums)))
        monkeypatch.setattr(sdc, "all_gather_objects", lambda text: [text, text])
        check.found = check.checked_at = None
        engine = type("Engine", (), {"module": model})()
        assert check.replicas(engine, 5, "before") is False
        assert check.found.startswith("the weights of rank 0 (a) and rank 1 (b) differ from each other' before step 5")


def test_three_replicas_name_the_odd_one(monkeypatch):
    from dstrain.parallel.layout import Layout
    from dstrain.run import sdc

    check = sdc.CorruptionCheck(FaultConfig(sdc_check_every=1), Layout(3), 2, ["a", "b", "c"], lambda text: None)
    model = torch.nn.Linear(4, 4)
    mine = sdc.checksum(model.parameters())
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(torch.distributed, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [mine, mine + 1, mine]))
    monkeypatch.setattr(sdc, "all_gather_objects", lambda text: [text] * 3)
    assert check.replicas(type("Engine", (), {"module": model})(), 5, "before") is False
    assert check.found.startswith("the weights of rank 1 (b) differ from the other ranks'")

