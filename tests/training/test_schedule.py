import math

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from lightning_fedshard.training import warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    f = warmup_cosine(total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert [f(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # half-way: 0.55
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)


def test_drives_lambda_lr_per_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = LambdaLR(optimizer, warmup_cosine(total_steps=4, warmup_steps=2, min_ratio=0.0))
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1.0, 2.0, 2.0, 1.0])


def test_no_warmup():
    assert warmup_cosine(total_steps=5, warmup_steps=0, min_ratio=0.0)(0) == pytest.approx(1.0)


@pytest.mark.parametrize(("total", "warmup", "floor"), [(0, 0, 0.1), (10, 11, 0.1), (10, 1, 1.5)])
def test_bad_arguments(total, warmup, floor):
    with pytest.raises(ValueError, match="warmup_cosine"):
        warmup_cosine(total, warmup, floor)
