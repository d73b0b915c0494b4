"""PGD falsification: search input boxes for a point whose output lies in the unsafe set."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.budget import time_is_up
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec, first_counterexample
from lightning_fedshard.verify.ops import Interval

__all__ = ["ATTACK_ACTIVATIONS", "newton_attack", "pgd_attack"]

#: The most activations (points × the net's summed node sizes) one forward and backward pass of the attack holds:
#: more points are evaluated in chunks, the deadline checked after each, so that one step of a large net stays short
#: (10,000 starts on a CIFAR conv net of cifar_biasfield made a single step take 30 s of an 8 s timeout). Small nets
#: (ACAS Xu: 10,000 starts × ~300 activations) still take every point in one pass.
ATTACK_ACTIVATIONS = 1 << 23
#: Newton steps from each candidate, and the depth below the unsafe set's boundary each aims at (a multiple of
#: the candidate's value: the step lands as far inside as it started outside).
NEWTON_STEPS, NEWTON_OVERSHOOT = 3, 2.0


def _value_and_gradient(graph: BoundGraph, spec: OutputSpec, points: Tensor) -> tuple[Tensor, Tensor]:
    """The spec value ``[P]`` at ``points`` and its gradient with respect to them (both detached)."""
    x = points.detach().requires_grad_(True)
    with torch.enable_grad():
        value = spec.point_value(graph(x))
        (grad,) = torch.autograd.grad(value.sum(), x)
    return value.detach(), grad


def pgd_attack(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    restarts: int = 50,
    steps: int = 100,
    starts: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """Projected sign-gradient descent on the spec value ``min_d max_r (M y − b)_r``; returns an input
    ``[*input shape]`` with value ``≤ 0`` (a counterexample), or ``None``.

    ``box [K, *input shape]`` holds one box or ``K`` boxes searched together, each point staying in its own box.
    The points are the box centres, then ``starts`` (e.g. the minimising corners of branch-and-bound domains;
    with ``K`` boxes, ``starts[j]`` lies in box ``j mod K``), then ``restarts`` uniform random points per box. The
    step starts at a quarter of the box width and decays by 0.97 per step. The points go through the net in chunks
    of at most :data:`ATTACK_ACTIVATIONS` activations, and the search stops (``None``) at the first chunk that ends
    past the run's deadline (:func:`~lightning_fedshard.verify.budget.time_is_up`), so a step of many points on a
    large net does not outlive it.
    """
    boxes = box.lower.shape[0]
    shape = box.lower.shape[1:]
    device = box.lower.device
    # Drawn on the generator's device (the CPU's) and moved: the same starts, so the same answer, on every device.
    random = torch.rand(restarts, boxes, *shape, generator=generator, dtype=box.lower.dtype).to(device)
    starts = box.lower.new_zeros(0, *shape) if starts is None else starts.reshape(-1, *shape).to(box.lower.dtype)
    x = torch.cat([box.center, starts, (box.lower + (box.upper - box.lower) * random).reshape(-1, *shape)])
    owner = torch.cat(
        [
            torch.arange(boxes, device=device),
            torch.arange(starts.shape[0], device=device) % boxes,
            torch.arange(boxes, device=device).repeat(restarts),
        ]
    )
    lower, upper = box.lower[owner], box.upper[owner]
    x = torch.minimum(torch.maximum(x, lower), upper)
    step = (upper - lower) / 4
    chunk = max(1, ATTACK_ACTIVATIONS // sum(node.size for node in graph.nodes))
    for t in range(steps + 1):
        grads = []
        for first in range(0, x.shape[0], chunk):
            part = x[first : first + chunk]
            value, grad = _value_and_gradient(graph, spec, part)
            found = first_counterexample(graph, spec, part, value)
            if found is not None:
                return found
            if time_is_up():
                return None
            grads.append(grad)
        if t == steps:
            return None
        with torch.no_grad():
            x = torch.minimum(torch.maximum(x - step * 0.97**t * torch.cat(grads).sign(), lower), upper)
    return None


def newton_attack(
    graph: BoundGraph, spec: OutputSpec, points: Tensor, box: Interval, steps: int = NEWTON_STEPS
) -> Tensor | None:
    """Newton steps on the spec value from ``points [P, *input shape]`` near the unsafe set, each in its own
    ``box [P, *input shape]``; returns a counterexample or ``None``.

    A ReLU net is linear around almost every point, so where a candidate's linear piece reaches into the unsafe set
    one step along the gradient lands there: ``x − NEWTON_OVERSHOOT·v·g/|g|²`` with the coordinates the step would
    push out of the box held at their face. This finds the counterexamples sign-gradient PGD steps over
    (a sliver of the box, a margin of 10⁻⁵ next to outputs of 10⁻²: ACAS Xu 5_3/φ2), from the corners where
    linear bounds say the minimum is. Example::

        cex = newton_attack(graph, spec, corners, Interval(lower[owner], upper[owner]))
    """
    x = points.detach()
    for _ in range(steps):
        value, grad = _value_and_gradient(graph, spec, x)
        found = first_counterexample(graph, spec, x, value)
        if found is not None:
            return found
        with torch.no_grad():
            inward = ((grad > 0) & (x > box.lower)) | ((grad < 0) & (x < box.upper))
            grad = torch.where(inward, grad, 0.0)
            norm = grad.flatten(1).square().sum(1)
            length = torch.where(norm > 0, NEWTON_OVERSHOOT * value.clamp(min=0) / norm, 0.0)
            x = torch.minimum(torch.maximum(x - length.view(-1, *[1] * (x.dim() - 1)) * grad, box.lower), box.upper)
    with torch.no_grad():
        return first_counterexample(graph, spec, x)
