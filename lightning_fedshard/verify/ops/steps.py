"""Discontinuous element-wise functions: Sign, and the staircases Floor, Ceil and Round, constant between jumps.

The extreme of ``f(x) − a·x`` over ``[l, u]`` is then at an endpoint or at one side of a jump (a limit: the line
must stay below the infimum, which need not be attained), so these too have an exact intercept for every slope. A
jump point belongs to one side only, so splitting there never makes both halves constant: branch-and-bound can
narrow these neurons but not settle them.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from lightning_fedshard.verify.ops.activation import Activation

__all__ = ["Ceil", "Floor", "Round", "Sign", "Staircase"]


def _extreme(values: list[Tensor], maximum: bool) -> Tensor:
    stacked = torch.stack(torch.broadcast_tensors(*values))
    return stacked.amax(0) if maximum else stacked.amin(0)


class Sign(Activation):
    """``sign(x)``: −1, 0 at 0, +1 (ONNX Sign). Across 0 the tight lines pass through the jump's corners:
    ``−1 + a·x`` below with ``a ∈ [0, 2/u]``, ``1 + a·x`` above with ``a ∈ [0, 2/|l|]``.

    Example::

        Sign().relax(Interval(torch.tensor([[-1.0]]), torch.tensor([[2.0]])))
    """

    onnx_types = ("Sign",)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sign(x)

    def offset(self, slope, lower, upper, maximum):
        values = [torch.sign(lower) - slope * lower, torch.sign(upper) - slope * upper]
        neither = torch.full_like(lower, torch.inf if not maximum else -torch.inf)  # a value that never wins
        zero_inside = (lower <= 0) & (upper >= 0)
        values.append(torch.where((lower < 0) & (upper >= 0), -1.0, neither))  # the limit from the left of 0
        values.append(torch.where(zero_inside, 0.0, neither))  # at 0
        values.append(torch.where((lower <= 0) & (upper > 0), 1.0, neither))  # the limit from the right
        return _extreme(values, maximum)

    def slope_range(self, lower, upper):
        jump = (lower <= 0) & (upper >= 0) & (upper > lower)
        reach = torch.minimum(-lower, upper)
        reach = torch.where(reach > 0, reach, torch.maximum(-lower, upper))
        high = (2 / reach.clamp(min=1e-12)).clamp(max=1e12)
        return torch.zeros_like(lower), torch.where(jump, high, 0)

    def candidate_slopes(self, lower, upper):
        return [
            torch.zeros_like(lower),
            2 / upper.clamp(min=1e-12),
            2 / (-lower).clamp(min=1e-12),
            1 / upper.clamp(min=1e-12),
            1 / (-lower).clamp(min=1e-12),
        ]

    def _chosen_slopes(self, lower, upper, low, high, sides=(False, True), search=True):
        # CROWN's lines are the flat ones, as auto_LiRPA's: across the jump a sloped line is tighter on one side only
        # and carries its slope backwards (CROWN's bound 1.2x wider with the midpoint's best lines on ``fedshard bench
        # operators``); α-CROWN still tries every slope.
        return tuple(torch.zeros_like(lower) for _ in sides)

    def refine_mask(self, inputs, index):
        pre = inputs[index]
        return (pre.lower <= 0) & (pre.upper >= 0) & (pre.upper > pre.lower)

    split_mask = refine_mask

    def split_point(self, inputs, index):
        return torch.zeros_like(inputs[index].lower)


class Staircase(Activation):
    """A monotone integer-valued step function ``g``: over ``[l, u]`` it takes the values ``g(l)`` … ``g(u)``, value
    ``k`` on a piece whose hull is ``[k + start, k + 1 + start]``. Exact on an interval with no jump inside;
    otherwise between the lines ``x + start ≤ g(x) ≤ x + start + 1`` and the constants ``g(l)``, ``g(u)`` (slopes in
    [0, 1], intercepts exact). Subclasses give ``g`` and ``start``.

    Example (a subclass)::

        Floor().ibp(Interval(torch.tensor([[0.2]]), torch.tensor([[1.5]])))   # [0, 1]
    """

    alpha_per_neuron = 0
    #: Where piece ``k`` starts, relative to ``k``: 0 for ⌊x⌋ (``[k, k + 1)``), −1 for ⌈x⌉, −0.5 for rounding.
    start = 0.0

    @abstractmethod
    def step(self, x: Tensor) -> Tensor:
        """``g`` element-wise (float64 or the working dtype)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.step(x)

    def offset(self, slope, lower, upper, maximum):
        # On piece k the function is k − a·x, extreme at the ends of the piece's hull (a limit at an open end still
        # bounds it); over the pieces between the first and the last those ends are linear in k, so only the first
        # two pieces and the last two matter.
        first, last = self.step(lower), self.step(upper)
        values = []
        for k in (first, (first + 1).clamp(max=last), (last - 1).clamp(min=first), last):
            begin, end = torch.maximum(k + self.start, lower), torch.minimum(k + 1 + self.start, upper)
            values += [k - slope * begin, k - slope * end]
        return _extreme(values, maximum)

    def slope_range(self, lower, upper):
        crosses = self.step(lower) < self.step(upper)
        return torch.zeros_like(lower), crosses.to(lower.dtype)

    def candidate_slopes(self, lower, upper):
        return [torch.zeros_like(lower), torch.ones_like(lower)]

    def refine_mask(self, inputs, index):
        pre = inputs[index]
        return self.step(pre.lower) < self.step(pre.upper)

    split_mask = refine_mask

    def split_point(self, inputs, index):
        """The jump inside the interval nearest its midpoint (jumps lie at ``k + start``)."""
        pre = inputs[index]
        middle = (pre.lower + pre.upper) / 2
        k = torch.round(middle - self.start).clamp(self.step(pre.lower) + 1, self.step(pre.upper))
        return k + self.start


class Floor(Staircase):
    """``⌊x⌋`` (ONNX Floor), value ``k`` on ``[k, k + 1)``.

    Example::

        Floor().ibp(Interval(torch.tensor([[0.2]]), torch.tensor([[1.5]])))   # [0, 1]
    """

    onnx_types = ("Floor",)

    def step(self, x: Tensor) -> Tensor:
        return torch.floor(x)


class Ceil(Staircase):
    """``⌈x⌉`` (ONNX Ceil), value ``k`` on ``(k − 1, k]``.

    Example::

        Ceil().ibp(Interval(torch.tensor([[0.2]]), torch.tensor([[1.5]])))   # [1, 2]
    """

    onnx_types = ("Ceil",)
    start = -1.0

    def step(self, x: Tensor) -> Tensor:
        return torch.ceil(x)


class Round(Staircase):
    """The nearest integer, ties to even (ONNX Round), value ``k`` on ``[k − ½, k + ½]`` (one end or both: a tie
    belongs to the even neighbour).

    Example::

        Round().ibp(Interval(torch.tensor([[0.5]]), torch.tensor([[2.5]])))   # [0, 2]
    """

    onnx_types = ("Round",)
    start = -0.5

    def step(self, x: Tensor) -> Tensor:
        return torch.round(x)
