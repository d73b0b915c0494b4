"""Indicators: the 0/1 values of a strict comparison (``[x > 0]``) and of an equality (ONNX Equal), the pieces
ArgMax, OneHot and Equal become (:mod:`~lightning_fedshard.verify.onnx.discrete`).

Both are step functions: their interval bounds are exact, and linear bounds across a jump are either flat or
pass through the jump's corners. Two facts make them settle under branch-and-bound where a plain step would not
(:class:`~.steps.Sign` can only be narrowed): :class:`Positive` knows that its input takes only multiples of a
*quantum* (a difference of two floats is a multiple of the smallest positive float of their type), so a split
between 0 and one quantum leaves both halves constant; :class:`Equal` knows which of its operands take integer
values only (indicators, class indices), so an indicator compared with a fixed 0 or 1 is linear in it.

Their forward passes give the exact 0/1 values the model computes; under autograd they also carry the gradient of
a smooth surrogate (added as ``s − s.detach()``, exactly 0), so that gradient attacks see which way the count moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import gamma, round_down, round_up
from lightning_fedshard.verify.ops.activation import Activation
from lightning_fedshard.verify.ops.base import BoundOp, Interval, LinearOp, contract, contract_abs, contract_error

__all__ = ["ClassMargins", "Equal", "Positive"]


def _with_surrogate(value: Tensor, surrogate: Tensor) -> Tensor:
    """``value`` with the gradient of ``surrogate`` (finite), where autograd is recording: ``value`` exactly."""
    if not (torch.is_grad_enabled() and surrogate.requires_grad):
        return value
    return value + (surrogate - surrogate.detach())


class ClassMargins(LinearOp):
    """``y[…, p] = 2·(x[…, losers[p]] − x[…, winners[p]])`` over the last axis (the classes): per pair of classes,
    how far the one ArgMax passes over on a tie is above the other, doubled (see :class:`Positive`).

    The model never computes these differences (it compares the logits), so nothing of the model's rounding is
    charged, and the intervals are exact: the differences of the ends in float64, rounded outwards.

    Example::

        margins = ClassMargins(winners=torch.tensor([0]), losers=torch.tensor([1]), classes=2)
        margins.ibp(Interval(torch.tensor([[0.5, 0.5]]), torch.tensor([[0.5, 0.5]])))   # [0, 0]: a tie
    """

    onnx_types = ("ArgMax", "ArgMin")

    def __init__(self, winners: Tensor, losers: Tensor, classes: int) -> None:
        self.winners, self.losers, self.classes = winners, losers, classes

    def linear(self, x: Tensor) -> Tensor:
        return 2 * (x[..., self.losers] - x[..., self.winners])

    def abs_linear(self, x: Tensor) -> Tensor:
        return 2 * (x[..., self.losers] + x[..., self.winners])

    def transpose(self, A: Tensor) -> Tensor:
        A_in = A.new_zeros(*A.shape[:-1], self.classes)
        A_in.index_add_(-1, self.losers, 2 * A)
        A_in.index_add_(-1, self.winners, -2 * A)
        return A_in

    def terms(self) -> tuple[int, int]:
        return 2, self.classes - 1

    def ibp(self, x: Interval) -> Interval:
        low = 2 * (x.lower[..., self.losers].double() - x.upper[..., self.winners].double())
        high = 2 * (x.upper[..., self.losers].double() - x.lower[..., self.winners].double())
        return Interval(round_down(low, x.lower.dtype), round_up(high, x.lower.dtype))

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor | None:
        """Only the transpose's sums: a class is in ``classes − 1`` pairs (none to sum with two classes)."""
        if self.classes == 2:
            return None
        (x,) = inputs
        dtype = x.lower.dtype
        return gamma(self.classes, dtype) * (1 + 2 * gamma(2, dtype)) * self.abs_linear(x.magnitude).double()

    def __repr__(self) -> str:
        return f"ClassMargins({self.classes} classes, {self.losers.numel()} pairs)"


class Positive(Activation):
    """``[x > 0]``: 1 where the input is positive, else 0, for an input whose values are multiples of ``quantum``
    (so ``[x > 0] = [x ≥ quantum]``; the jump lies anywhere between, at ``quantum / 2`` for the lines).

    An interval ``[l, u]`` gives 1 where ``l > 0``, 0 where ``u < quantum``, else ``[0, 1]``; across the jump the
    tight lines are ``a·(x − quantum/2)`` below (``a ∈ [0, 1/(u − quantum/2)]``) and ``1 + a·(x − quantum/2)`` above
    (CROWN takes the flat ones, α-CROWN any). Branch-and-bound splits at ``quantum / 2``, which must be a number of
    the working dtype (the loader doubles the logit differences for that).

    Example::

        step = Positive(quantum=2.0**-148)
        step.ibp(Interval(torch.tensor([[-1.0, 0.0, 1e-3]]), torch.tensor([[2.0, 2.0**-149, 1.0]])))
        # lower [0, 0, 1], upper [1, 0, 1]
    """

    onnx_types = ("ArgMax", "OneHot")
    exact_when_split = True

    def __init__(self, quantum: float) -> None:
        if not quantum > 0:
            raise ValueError(f"Positive needs a positive quantum, got {quantum}")
        self.quantum = quantum

    def forward(self, x: Tensor) -> Tensor:
        return _with_surrogate((x > 0).to(x.dtype), torch.atan(x))

    def ibp(self, x: Interval) -> Interval:
        # Comparisons, no arithmetic: the range is exact (the generic one widens by float64's slack).
        return Interval((x.lower > 0).to(x.lower.dtype), (x.upper >= self.quantum).to(x.upper.dtype))

    def _snapped(self, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor]:
        """The interval shrunk to the input's possible values where that moves an end across the jump (float64):
        a positive lower end to at least one quantum, an upper end below one quantum to at most 0."""
        lower = torch.where(lower > 0, lower.clamp(min=self.quantum), lower)
        upper = torch.where(upper < self.quantum, upper.clamp(max=0), upper)
        return lower, torch.maximum(upper, lower)

    def offset(self, slope, lower, upper, maximum):
        lower, upper = self._snapped(lower, upper)
        jump = self.quantum / 2
        crosses = (lower < jump) & (upper > jump)
        step = lambda x: (x > jump).to(x.dtype)  # noqa: E731
        values = [step(lower) - slope * lower, step(upper) - slope * upper]
        never = torch.full_like(lower, -torch.inf if maximum else torch.inf)
        values.append(torch.where(crosses, -slope * jump, never))  # the limit from the left of the jump
        values.append(torch.where(crosses, 1 - slope * jump, never))  # and from its right
        stacked = torch.stack(torch.broadcast_tensors(*values))
        return stacked.amax(0) if maximum else stacked.amin(0)

    def slope_range(self, lower, upper):
        lower, upper = self._snapped(lower, upper)
        jump = self.quantum / 2
        crosses = (lower < jump) & (upper > jump)
        reach = torch.minimum(jump - lower, upper - jump).clamp(min=1e-12)
        return torch.zeros_like(lower), torch.where(crosses, (1 / reach).clamp(max=1e12), 0)

    def candidate_slopes(self, lower, upper):
        jump = self.quantum / 2
        return [
            torch.zeros_like(lower),
            1 / (upper - jump).clamp(min=1e-12),
            1 / (jump - lower).clamp(min=1e-12),
        ]

    def _chosen_slopes(self, lower, upper, low, high, sides=(False, True), search=True):
        # Flat lines, as for Sign: a sloped line across a jump is tighter on one side only, and carries its slope
        # backwards; α-CROWN still tries every slope.
        return tuple(torch.zeros_like(lower) for _ in sides)

    def refine_mask(self, inputs, index):
        pre = inputs[index]
        return (pre.lower <= 0) & (pre.upper >= self.quantum)

    split_mask = refine_mask

    def split_point(self, inputs, index):
        return torch.full_like(inputs[index].lower, self.quantum / 2)

    def __repr__(self) -> str:
        return f"Positive(quantum={self.quantum:g})"


class Equal(BoundOp):
    """``[a == b]`` element-wise (ONNX Equal) of two computed tensors of one shape, or of one and a ``constant``
    (broadcastable to it). ``integer`` says, per operand, whether the model's values of it are integers.

    Intervals: 1 where both operands are the same point, 0 where they cannot meet (an integer operand's interval
    rounded inwards first), else ``[0, 1]``. Linear bounds: where one operand is fixed at an integer ``m`` (a point
    interval: a mask channel the box fixes) and the other is an integer operand that can take only ``m`` and one
    neighbour, the indicator is exactly ``1 ∓ (x − m)`` on those two values (an indicator compared with a fixed 0/1
    mask is the indicator or its complement); elsewhere the interval's constants.

    Example::

        agree = Equal(integer=(True, False))
        one = Interval(torch.ones(1, 2), torch.ones(1, 2))
        agree.ibp(Interval(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 1.0]])), one)   # [0, 1] and [1, 1]
    """

    onnx_types = ("Equal",)
    needs_input_bounds = True

    def __init__(self, integer: tuple[bool, bool], constant: Tensor | None = None) -> None:
        self.integer = tuple(integer)
        self.constant = constant

    def _operands(self, inputs: Sequence) -> tuple:
        return (inputs[0], inputs[1]) if self.constant is None else (inputs[0], None)

    def forward(self, *inputs: Tensor) -> Tensor:
        a, b = self._operands(inputs)
        b = self.constant.to(a.dtype) if b is None else b
        same = (a == b).to(a.dtype)
        # The multilinear extension 1 − a − b + 2ab: the indicator on {0, 1}², with a gradient that says which way
        # a comparison of an indicator with a mask flips.
        return _with_surrogate(same, 1 - a - b + 2 * a * b)

    def _ends(self, inputs: Sequence[Interval]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(a_lower, a_upper, b_lower, b_upper)`` in float64, broadcast, an integer operand's rounded inwards."""
        a, b = self._operands(inputs)
        b_ends = (self.constant, self.constant) if b is None else (b.lower, b.upper)
        ends = []
        for (low, high), integer in zip(((a.lower, a.upper), b_ends), self.integer, strict=True):
            low, high = low.double(), high.double()
            ends += [torch.ceil(low), torch.floor(high)] if integer else [low, high]
        return tuple(torch.broadcast_tensors(*ends))

    def _range(self, ends: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        al, au, bl, bu = ends
        same = (al == au) & (bl == bu) & (al == bl)
        apart = (au < bl) | (bu < al)
        return same.double(), (~apart).double()

    def ibp(self, *inputs: Interval) -> Interval:
        low, high = self._range(self._ends(inputs))
        dtype = inputs[0].lower.dtype
        return Interval(low.to(dtype), high.to(dtype))

    def _linear_pieces(self, ends: tuple[Tensor, ...]) -> list[tuple[int, Tensor, Tensor]]:
        """``(operand, slope, intercept)`` per integer computed operand ``x``: ``[x == m] = slope·x + intercept``
        where ``slope ≠ 0`` (the other operand fixed at an integer ``m``, ``x ∈ {m, m ± 1}``), float64."""
        al, au, bl, bu = ends
        pieces = []
        for index, (xl, xu, ml, mu) in enumerate(((al, au, bl, bu), (bl, bu, al, au))):
            if not self.integer[index] or (index == 1 and self.constant is not None):
                continue
            fixed = (ml == mu) & (ml == torch.round(ml))
            above, below = fixed & (xl == ml) & (xu == ml + 1), fixed & (xu == ml) & (xl == ml - 1)
            slope = torch.where(above, -1.0, torch.where(below, 1.0, 0.0))
            pieces.append((index, slope, 1 - slope * ml))
        return pieces

    def backward(self, A, inputs, alpha=None):
        ends = self._ends(inputs)
        low, high = self._range(ends)
        constant = torch.where(A >= 0, low, high)  # the lower bound of Σ A·y: the low end under A ≥ 0
        magnitude = high
        A_inputs: list[Tensor | None] = [None, None]
        for index, slope, intercept in self._linear_pieces(ends):
            use = slope != 0  # the two operands' pieces never meet: each needs the other operand fixed
            if not bool(use.any()):
                continue
            constant = torch.where(use, intercept, constant)
            magnitude = torch.maximum(magnitude, torch.where(use, intercept.abs(), 0))
            A_inputs[index] = A * slope.to(A.dtype)
        constant = constant.to(A.dtype)  # small integers: exact
        term = contract(A, constant) - contract_abs(A, contract_error(low[0].numel(), A.dtype) * magnitude)
        return (A_inputs if self.constant is None else A_inputs[:1]), term

    def __repr__(self) -> str:
        return f"Equal(integer={self.integer}{', constant' if self.constant is not None else ''})"
