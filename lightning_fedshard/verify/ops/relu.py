"""ReLU: the one non-linear operator, relaxed by two lines between its pre-activation bounds."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract

__all__ = ["ReLU"]


class ReLU(BoundOp):
    """``y = max(x, 0)``.

    For a neuron with pre-activation bounds ``l < 0 < u`` (unstable) the relaxation is the chord
    ``y ≤ λ(x − l)`` with ``λ = u/(u−l)`` above, and ``y ≥ α·x`` below for any ``α ∈ [0, 1]``. CROWN takes the
    adaptive slope (``α = 1`` when ``u > −l``, else 0); α-CROWN optimises α per neuron and per bounded row.
    Stable neurons are exact lines (slope 1 or 0). A lower bound takes the lower line where its coefficient is
    positive and the upper line where it is negative.

    Example::

        relu = ReLU()
        (A_pre,), bias = relu.backward(A, [pre_activation_bounds], alpha=None)
    """

    onnx_types = ("Relu",)
    accepts_patches = True  # backward only clamps, multiplies by [B, *shape] slopes, adds and contracts
    needs_input_bounds = True

    def forward(self, x: Tensor) -> Tensor:
        return x.clamp(min=0)

    def ibp(self, x: Interval) -> Interval:
        return Interval(x.lower.clamp(min=0), x.upper.clamp(min=0))

    @staticmethod
    def adaptive_slope(pre: Interval) -> Tensor:
        """CROWN's default lower slope ``[B, *shape]``: 1 where ``u > −l``, else 0."""
        return (pre.upper > -pre.lower).to(pre.lower.dtype)

    @staticmethod
    def unstable(pre: Interval) -> Tensor:
        return (pre.lower < 0) & (pre.upper > 0)

    @staticmethod
    def upper_line(pre: Interval) -> tuple[Tensor, Tensor]:
        """Slope and intercept ``[B, *shape]`` of the line above the ReLU (exact for stable neurons)."""
        l, u = pre.lower, pre.upper
        unstable = ReLU.unstable(pre)
        slope = torch.where(unstable, u / torch.where(unstable, u - l, 1.0), (l >= 0).to(l.dtype))
        return slope, torch.where(unstable, -slope * l, 0.0)

    def lower_slope(self, pre: Interval, alpha: Tensor | None) -> Tensor:
        """``[B, *shape]`` or ``[S, B, *shape]``: α (or the adaptive slope) on unstable neurons, exact elsewhere."""
        exact = (pre.lower >= 0).to(pre.lower.dtype)
        chosen = self.adaptive_slope(pre) if alpha is None else alpha
        return torch.where(self.unstable(pre), chosen, exact)

    def backward(self, A, inputs, alpha=None):
        (pre,) = inputs
        upper_slope, upper_intercept = self.upper_line(pre)
        A_pos, A_neg = A.clamp(min=0), A.clamp(max=0)
        A_pre = A_pos * self.lower_slope(pre, alpha) + A_neg * upper_slope
        return [A_pre], contract(A_neg, upper_intercept)
