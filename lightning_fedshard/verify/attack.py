"""PGD falsification: search the input box for a point whose output lies in the unsafe set."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.shard.lockstep import past

__all__ = ["pgd_attack"]


def pgd_attack(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    restarts: int = 50,
    steps: int = 100,
    starts: Tensor | None = None,
    generator: torch.Generator | None = None,
    deadline: float | None = None,
) -> Tensor | None:
    """Projected sign-gradient descent on the spec value ``min_d max_r (M y − b)_r``; returns an input
    ``[*input shape]`` with value ``≤ 0`` (a counterexample), or ``None``.

    Restart 0 is the box centre, then ``starts`` (e.g. the minimising corners of branch-and-bound domains),
    then uniform random points. The step starts at a quarter of the box width and decays by 0.97 per step.
    """
    lower, upper = box.lower, box.upper
    random = torch.rand(restarts, *lower.shape[1:], generator=generator, dtype=lower.dtype)
    points = [box.center, lower + (upper - lower) * random]
    if starts is not None:
        points.insert(1, starts.reshape(-1, *lower.shape[1:]).to(lower.dtype))
    x = torch.cat(points).clamp(lower, upper)
    step = (upper - lower) / 4
    for t in range(steps + 1):
        x.requires_grad_(True)
        with torch.enable_grad():
            value = spec.point_value(graph(x))
            (grad,) = torch.autograd.grad(value.sum(), x)
        with torch.no_grad():
            found = (value <= 0).nonzero()
            if found.numel():
                return x[found[0, 0]].detach().clone()
            if t == steps or past(deadline):
                return None
            x = torch.minimum(torch.maximum(x - step * 0.97**t * grad.sign(), lower), upper)
    return None
