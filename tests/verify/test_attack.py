"""Falsification: Newton steps from candidates next to the unsafe set, against the exact arithmetic of a linear piece
(a ReLU net is linear around a point with no pre-activation at zero)."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.verify.attack import newton_attack
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Interval
from tests.verify.nets import random_mlp


def _spec_just_missed_at(graph, point: torch.Tensor, miss: float) -> OutputSpec:
    """``y₀ − y₁ ≤ t`` unsafe, ``t`` ``miss`` below the value at ``point``: the point is that far outside."""
    with torch.no_grad():
        y = graph(point.unsqueeze(0))[0].double()
    threshold = (y[0] - y[1]).item() - miss
    return OutputSpec(torch.tensor([[1.0, -1.0]]), torch.tensor([threshold]), torch.zeros(1, dtype=torch.long), (2,))


@pytest.mark.parametrize("at_a_face", [False, True], ids=["inside", "at-a-face"])
@pytest.mark.parametrize("seed", range(3))
def test_a_newton_step_reaches_the_unsafe_set_next_to_a_candidate(seed, at_a_face):
    graph = random_mlp(seed, (5, 50, 50, 50, 2))
    point = torch.rand(5, generator=torch.Generator().manual_seed(seed)) - 0.5
    spec = _spec_just_missed_at(graph, point, miss=1e-5)  # ACAS Xu 5_3/φ2's counterexample: 1.4e-5 deep
    lower, upper = point - 0.1, point + 0.1
    if at_a_face:  # the point at the faces the descent direction leaves by: those coordinates must stay put
        x = point.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(spec.point_value(graph(x.unsqueeze(0))).sum(), x)
        blocked = torch.arange(5) < 2
        upper = torch.where(blocked & (grad < 0), point, upper)
        lower = torch.where(blocked & (grad > 0), point, lower)
    box = Interval(lower.unsqueeze(0), upper.unsqueeze(0))
    # One step lands where the piece's linear value is −1e-5 (the free coordinates' share of the gradient is large
    # enough that the step, 2e-5 / |g|², stays inside the piece and the box).
    cex = newton_attack(graph, spec, point.unsqueeze(0), box, steps=1)
    assert cex is not None
    assert bool(((cex >= lower) & (cex <= upper)).all())
    if at_a_face:
        assert torch.equal(cex[:2], point[:2])
    with torch.no_grad():
        assert spec.point_value(graph(cex.unsqueeze(0))).item() <= 0
