"""Continuous piecewise-linear functions — ReLU, LeakyReLU, Abs, Clip — linear between their kinks.

On ``[l, u]`` the extreme of ``f(x) − a·x`` lies at an endpoint or a kink, so every slope has an exact intercept
(:meth:`PiecewiseLinear.offset`), and a neuron whose interval holds no kink is exact. Splitting a neuron at a kink
removes it from both halves, so a branch-and-bound domain with nothing left to split is linear
(``exact_when_split``). ReLU, the operator every bound pass crosses most, builds its lines directly in the working
dtype (the same lines, a few element-wise operations instead of a float64 search).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import unit_roundoff
from lightning_fedshard.verify.ops.activation import Activation, Lines
from lightning_fedshard.verify.ops.base import Interval, contract, contract_abs, contract_error

__all__ = ["Clip", "LeakyReLU", "PiecewiseLinear", "ReLU"]


class PiecewiseLinear(Activation):
    """A continuous function with slope ``piece_slopes[i]`` between ``kinks[i-1]`` and ``kinks[i]``, and
    ``value(kinks[0]) = kink_values[0]``.

    Example (a subclass)::

        LeakyReLU(0.1).relax(Interval(l, u))
    """

    exact_when_split = True
    kinks: tuple[float, ...] = ()
    piece_slopes: tuple[float, ...] = ()

    def value(self, x: Tensor) -> Tensor:
        """``f(x)`` in float64, from the slopes and the value at the first kink (:meth:`kink_value`)."""
        y = torch.full_like(x, self.kink_value()) + self.piece_slopes[0] * (x - self.kinks[0]).clamp(max=0)
        for i, kink in enumerate(self.kinks):
            end = self.kinks[i + 1] if i + 1 < len(self.kinks) else math.inf
            y = y + self.piece_slopes[i + 1] * (x.clamp(max=end) - kink).clamp(min=0)
        return y

    def kink_value(self) -> float:
        return 0.0

    def offset(self, slope, lower, upper, maximum):
        points = [lower, upper] + [torch.full_like(lower, k).clamp(lower, upper) for k in self.kinks]
        values = torch.stack(torch.broadcast_tensors(*(self.value(p) - slope * p for p in points)))
        return values.amax(0) if maximum else values.amin(0)

    def _pieces_met(self, lower: Tensor, upper: Tensor) -> list[Tensor]:
        edges = (-math.inf, *self.kinks, math.inf)
        met = []
        for start, end in itertools.pairwise(edges):
            point = (lower == upper) & (lower >= start) & (lower <= end)  # a point interval meets its own piece
            met.append((lower < end) & (upper > start) | point)
        return met

    def slope_range(self, lower, upper):
        met = self._pieces_met(lower, upper)
        low = torch.full_like(lower, math.inf)
        high = torch.full_like(lower, -math.inf)
        for slope, present in zip(self.piece_slopes, met, strict=True):
            low = torch.where(present, torch.clamp(low, max=slope), low)
            high = torch.where(present, torch.clamp(high, min=slope), high)
        return low, high

    def candidate_slopes(self, lower, upper):
        width = upper - lower
        secant = (self.value(upper) - self.value(lower)) / torch.where(width > 0, width, 1)
        return [torch.full_like(lower, s) for s in self.piece_slopes] + [secant]

    def _kink_inside(self, pre: Interval) -> list[Tensor]:
        return [(pre.lower < k) & (pre.upper > k) for k in self.kinks]

    def refine_mask(self, inputs, index):
        inside = self._kink_inside(inputs[index])
        return torch.stack(inside).any(0)

    split_mask = refine_mask

    def split_point(self, inputs, index):
        """The kink inside the interval nearest its midpoint: both halves lose it."""
        pre = inputs[index]
        middle = (pre.lower + pre.upper) / 2
        point, distance = middle.clone(), torch.full_like(middle, math.inf)
        for k, inside in zip(self.kinks, self._kink_inside(pre), strict=True):
            closer = inside & ((middle - k).abs() < distance)
            point = torch.where(closer, k, point)
            distance = torch.where(closer, (middle - k).abs(), distance)
        return point


@functools.cache
def _below_zero(dtype: torch.dtype) -> float:
    """Minus the smallest positive number of ``dtype`` (a subnormal): the largest number below ``−0``."""
    zero = torch.zeros((), dtype=dtype)
    return -torch.nextafter(zero, torch.ones((), dtype=dtype)).item()


class _Rectify(torch.autograd.Function):
    """``max(x, 0)`` with ``clamp``'s gradient (passed where ``x ≥ 0``, ``−0`` included), the gradient by
    ``threshold_backward`` at the largest number below ``−0``: the same mask, 28x faster than the ``where`` of clamp's
    own backward on the attack's ``[10001, 50]`` activations (torch's CPU ``where`` slows down past ~32k elements).
    A NaN input passes the gradient (clamp's backward stops it); the value there is NaN anyway."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, x, _below_zero(x.dtype))


class ReLU(PiecewiseLinear):
    """``y = max(x, 0)``.

    For a neuron with pre-activation bounds ``l < 0 < u`` (unstable) the relaxation is the chord
    ``y ≤ λ(x − l)`` with ``λ = u/(u−l)`` above, and ``y ≥ α·x`` below for any ``α ∈ [0, 1]``. CROWN takes the
    adaptive slope (``α = 1`` when ``u > −l``, else 0: the better line at the interval's midpoint); α-CROWN optimises
    α per neuron and per bounded row. Stable neurons are exact lines (slope 1 or 0). A lower bound takes the lower
    line where its coefficient is positive and the upper line where it is negative. The chord's intercept is raised
    past the rounding of ``λ`` and ``−λl`` (:meth:`upper_line`): the line is above the ReLU on all of ``[l, u]`` in
    exact arithmetic, not only up to rounding.

    Example::

        relu = ReLU()
        (A_pre,), bias = relu.backward(A, [pre_activation_bounds], alpha=None)
    """

    onnx_types = ("Relu",)
    kinks = (0.0,)
    piece_slopes = (0.0, 1.0)
    alpha_per_neuron = 1

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # the attacks' gradients
            return _Rectify.apply(x)
        return x.clamp(min=0)

    @staticmethod
    def adaptive_slope(pre: Interval) -> Tensor:
        """CROWN's default lower slope ``[B, *shape]``: 1 where ``u > −l``, else 0."""
        return (pre.upper > -pre.lower).to(pre.lower.dtype)

    @staticmethod
    def unstable(pre: Interval) -> Tensor:
        return (pre.lower < 0) & (pre.upper > 0)

    @staticmethod
    def upper_line(pre: Interval, unstable: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Slope and intercept ``[B, *shape]`` of the line above the ReLU (exact for stable neurons).

        The exact intercept for the rounded slope ``λ`` is ``max(−λl, u − λu)``, at most ``−λl + 2⁻²³·u`` (``λ`` and
        ``u − l`` are each rounded once); ``fl(−λl) + 3ε·u`` (ε = 2⁻²³, the dtype's machine epsilon, in general)
        stays above it after its own two roundings. Done in the working dtype: this is the hottest relaxation."""
        l, u = pre.lower, pre.upper
        if unstable is None:
            unstable = ReLU.unstable(pre)
        slope = torch.where(unstable, u / torch.where(unstable, u - l, 1.0), (l >= 0).to(l.dtype))
        margin = 3 * torch.finfo(l.dtype).eps
        return slope, torch.where(unstable, torch.addcmul(-slope * l, u, torch.full_like(u, margin)), 0.0)

    def lower_slope(self, pre: Interval, alpha: Tensor | None, unstable: Tensor | None = None) -> Tensor:
        """``[B, *shape]`` or ``[S, B, *shape]``: α (or the adaptive slope) on unstable neurons, exact elsewhere."""
        if unstable is None:
            unstable = self.unstable(pre)
        exact = (pre.lower >= 0).to(pre.lower.dtype)
        chosen = self.adaptive_slope(pre) if alpha is None else alpha.clamp(0, 1)
        return torch.where(unstable, chosen, exact)

    def relax(self, pre: Interval, alpha: Tensor | None = None) -> Lines:
        unstable = self.unstable(pre)
        upper_slope, upper_intercept = self.upper_line(pre, unstable)
        return Lines(self.lower_slope(pre, alpha, unstable), None, upper_slope, upper_intercept)

    def ibp(self, x: Interval) -> Interval:
        return Interval(x.lower.clamp(min=0), x.upper.clamp(min=0))

    def rounding(self, inputs):
        """Exact in the model; the backward step rounds its products with slopes in [0, 1] (``u·|A|·|x|``) and sums
        those with intercepts up to ``|l|`` (:func:`~.base.contract_error`)."""
        (pre,) = inputs
        dtype = pre.lower.dtype
        return (unit_roundoff(dtype) + contract_error(pre.lower[0].numel(), dtype)) * (1 + 2**-20) * pre.magnitude

    def backward(self, A, inputs, alpha=None):
        # Activation's step without its check for infinite intercepts (a ReLU's are finite on finite bounds).
        lines = self.relax(inputs[0], alpha)
        A_pos, A_neg = A.clamp(min=0), A.clamp(max=0)
        term = contract(A_neg, lines.upper_bias) - contract_abs(A, self.rounding(inputs))
        return [A_pos * lines.lower_slope + A_neg * lines.upper_slope], term

    def initial_alpha(self, inputs: Sequence[Interval]) -> Tensor:
        return self.adaptive_slope(inputs[0])

    def refine_mask(self, inputs, index):
        return self.unstable(inputs[index])

    split_mask = refine_mask

    def split_point(self, inputs, index):
        return torch.zeros_like(inputs[index].lower)

    def branch_gain(self, A_out, inputs, index, bias):
        """BaBSR's score: the bound's share of the pre-activation's constant through the chord (``A·b·λ`` against
        ``A·b·(λ−1)``) plus the chord's intercept ``min(A, 0)·(−λl)``."""
        pre = inputs[index]
        slope, intercept = self.upper_line(pre)
        bias = torch.zeros_like(pre.lower) if bias is None else bias
        through_bias = torch.maximum(A_out * bias * (slope - 1), A_out * bias * slope)
        return through_bias + A_out.clamp(max=0) * intercept


class LeakyReLU(PiecewiseLinear):
    """``y = x`` for ``x ≥ 0``, ``s·x`` below (ONNX LeakyRelu; ``s = −1`` is ONNX Abs).

    Example::

        LeakyReLU(0.01).forward(torch.tensor([-1.0, 2.0]))   # tensor([-0.0100, 2.0000])
    """

    onnx_types = ("LeakyRelu", "Abs")
    kinks = (0.0,)

    def __init__(self, negative_slope: float) -> None:
        self.negative_slope = float(negative_slope)
        self.piece_slopes = (self.negative_slope, 1.0)
        self.relative_ulps = 0.0 if self.negative_slope in (-1.0, 0.0, 1.0) else 1.0  # the model's s·x

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x >= 0, x, x * self.negative_slope)

    def _chosen_slopes(self, lower, upper, low, high, sides=(False, True), search=True):
        chosen = super()._chosen_slopes(lower, upper, low, high, sides, search)
        if self.negative_slope >= 0:
            return chosen
        # A V (Abs) across its kink: below, the flat line through its minimum, as auto_LiRPA takes. The sloped line
        # of the piece the midpoint is in has the larger integral, but carries the slope backwards: on ``fedshard
        # bench operators`` CROWN's bound is 1.3x wider with it; α-CROWN still tries every slope.
        straddling = (lower < 0) & (upper > 0)
        return tuple(s if maximum else torch.where(straddling, 0, s) for s, maximum in zip(chosen, sides, strict=True))

    def __repr__(self) -> str:
        return "Abs" if self.negative_slope == -1 else f"LeakyReLU({self.negative_slope:g})"


class Clip(PiecewiseLinear):
    """``y = min(max(x, low), high)`` (ONNX Clip; either bound may be absent, i.e. infinite).

    Example::

        Clip(0.0, 6.0)   # ReLU6
    """

    onnx_types = ("Clip",)

    def __init__(self, low: float = -math.inf, high: float = math.inf) -> None:
        if not low <= high:
            raise ValueError(f"Clip needs min ≤ max, got {low} and {high}")
        if not (math.isfinite(low) or math.isfinite(high)):
            raise ValueError("Clip without a finite min or max is the identity")
        self.low, self.high = float(low), float(high)
        self.kinks = tuple(k for k in (self.low, self.high) if math.isfinite(k))
        flat = (0.0,)
        self.piece_slopes = (*(flat if math.isfinite(low) else ()), 1.0, *(flat if math.isfinite(high) else ()))

    def kink_value(self) -> float:
        return self.kinks[0] if self.kinks else 0.0

    def value(self, x):
        return x.clamp(self.low if math.isfinite(self.low) else None, self.high if math.isfinite(self.high) else None)

    def forward(self, x: Tensor) -> Tensor:
        return self.value(x)

    def ibp(self, x: Interval) -> Interval:
        return Interval(self.value(x.lower), self.value(x.upper))

    def __repr__(self) -> str:
        return f"Clip({self.low:g}, {self.high:g})"
