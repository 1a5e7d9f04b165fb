"""The recipe's LR schedule, against values worked out by hand."""
import math

import pytest
import torch

from dstrain.config import load_recipe, parse_overrides
from dstrain.trainer.schedule import lr_factor, make


def test_warmup_starts_above_zero_and_reaches_peak():
    assert lr_factor(0, warmup=4, total=10, kind="cosine", min_ratio=0.1) == pytest.approx(0.25)
    assert lr_factor(3, warmup=4, total=10, kind="cosine", min_ratio=0.1) == pytest.approx(1.0)


def test_cosine_midpoint_and_floor():
    # step 7 of 10 after 4 warmup steps: progress 3/6, cos(pi/2)=0 -> halfway between 1 and 0.1
    assert lr_factor(6, 4, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(9, 4, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 4, 10, "cosine", 0.1) == pytest.approx(0.1)   # past the end: stays at the floor


def test_linear_and_constant():
    assert lr_factor(6, 4, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(9, 4, 10, "linear", 0.0) == pytest.approx(0.0)
    assert lr_factor(9, 4, 10, "constant", 0.0) == 1.0
    assert lr_factor(0, 0, 10, "constant", 0.0) == 1.0                  # no warmup


def test_scheduler_drives_an_optimizer_step_by_step():
    r = load_recipe(None, parse_overrides(["--train.max_steps=10", "--train.warmup_steps=2", "--train.lr=1.0",
                                           "--train.min_lr_ratio=0"]))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt, r.train)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.5, 1.0] + [(1 + math.cos(math.pi * k / 8)) / 2 for k in range(1, 9)]
    assert seen == pytest.approx(expected)
