"""Softmax along one axis (ONNX Softmax), relaxed by one plane below and one above each output ("LSE" bounds).

After Wei et al., "Convex Bounds on the Softmax Function with Applications to Robustness Verification" (AISTATS
2023), over the box ``[l, u]`` of the logits ``x`` of one softmax group:

* below: replacing every ``e^{x_j}`` of the denominator by its chord ``κ_j x_j + β_j ≥ e^{x_j}`` on ``[l_j, u_j]``
  gives ``L_k(x) = e^{x_k} / G(x) ≤ softmax_k(x)``, ``G(x) = Σ_j κ_j x_j + β_j > 0``. ``L_k = exp(x_k − log G)`` is
  convex (the exponential of a convex function), so its tangent plane at the box's centre ``x₀`` lies below it;
* above: ``softmax_k = exp(t_k)`` with ``t_k = x_k − LSE(x)`` in ``[log p̲_k, log p̄_k]`` (the exact range of the
  output, IBP's), where the chord of exp, ``a_k + c_k t``, lies above exp. ``U_k(x) = a_k + c_k (x_k − LSE(x))`` is
  concave (LSE is convex, ``c_k ≥ 0``), so its tangent plane at ``x₀`` lies above it.

The planes' gradients, ``L_k(x₀)(e_k − κ/G(x₀))`` and ``c_k(e_k − softmax(x₀))``, are applied to the coefficients
without forming a ``K × K`` matrix. Everything is computed in float64; after the combined coefficients are rounded to
the working dtype the constant is moved down by what the rounding can cost anywhere on the box, and rounded down, so
the float32 bound holds exactly. On the small graph of ``fedshard bench operators`` these planes are 5× tighter than
the composition ``exp · 1/Σexp`` (auto_LiRPA's former "complex" softmax) and within 0.1 % of auto_LiRPA 0.7.1's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import smallest_normal, unit_roundoff
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract_abs, enclose, flat

__all__ = ["Softmax"]

#: Relative slack for float64's own rounding in the planes (a few ulps of float64, far below float32's).
_FLOAT64_SLACK = 1e-11


class Softmax(BoundOp):
    """``softmax`` along ``axis`` of the node shape (batch excluded).

    Example::

        probabilities = Softmax(axis=0, shape=(10,))
        (A_logits,), bias = probabilities.backward(A, [Interval(l, u)])
    """

    onnx_types = ("Softmax",)
    needs_input_bounds = True
    relaxed_inputs = (0,)

    def __init__(self, axis: int, shape: tuple[int, ...]) -> None:
        if not 0 <= axis < len(shape):
            raise ValueError(f"Softmax axis {axis} outside a node of {len(shape)} dimensions")
        self.axis, self.shape = axis, tuple(shape)

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(x, dim=self.axis + 1)

    def _range(self, l: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """The exact range ``[p̲, p̄]`` of each output over the box (float64, finite bounds):
        ``e^{l_k} / (e^{l_k} + Σ_{j≠k} e^{u_j})`` up to ``e^{u_k} / (e^{u_k} + Σ_{j≠k} e^{l_j})``."""
        dim = self.axis + 1
        shift = u.amax(dim, keepdim=True)
        el, eu = torch.exp(l - shift), torch.exp(u - shift)
        low = el / (el + _others(eu, dim))
        high = eu / (eu + _others(el, dim))
        return low.clamp(0, 1), high.clamp(0, 1)

    def _finite(self, pre: Interval) -> tuple[Tensor, Tensor, Tensor]:
        """``(l, u, finite)`` in float64: ``finite`` per element, true where its whole group is bounded (elsewhere
        ``l = u = 0``, to keep the arithmetic finite; the caller's bounds there are ``[0, 1]``)."""
        dim = self.axis + 1
        l, u = pre.lower.double(), pre.upper.double()
        finite = (torch.isfinite(l) & torch.isfinite(u)).all(dim, keepdim=True).expand_as(l)
        l = torch.where(finite, l, 0)
        return l, torch.where(finite, torch.maximum(u, l), 0), finite

    def _model_error(self, l: Tensor, u: Tensor, high: Tensor, dtype: torch.dtype) -> Tensor:
        """The model's rounding of each output ``[B, *shape]`` (float64) whose exact value is at most ``high``: a
        sum of the group's ``n`` exponentials, a quotient, and ``exp(x − max x)`` whose argument rounds by up to
        ``u·|x − max x|`` — relative ``(n + 8 + 2·spread)·u``, ``spread`` the group's range of logits (measured on
        onnxruntime: at most 0.42 of that)."""
        dim = self.axis + 1
        model = self.model_precision(dtype)
        spread = u.amax(dim, keepdim=True) - l.amin(dim, keepdim=True)
        return (self.shape[self.axis] + 8 + 2 * spread) * unit_roundoff(model) * high + smallest_normal(model)

    def ibp(self, x: Interval) -> Interval:
        l, u, finite = self._finite(x)
        low, high = self._range(l, u)
        low, high = torch.where(finite, low, 0), torch.where(finite, high, 1)
        error = torch.where(finite, self._model_error(l, u, high, x.lower.dtype), 0)
        return enclose(low, high, error, x.lower.dtype, self.precision)

    def rounding(self, inputs):
        (pre,) = inputs
        l, u, finite = self._finite(pre)
        return torch.where(finite, self._model_error(l, u, self._range(l, u)[1], pre.lower.dtype), 0)

    def backward(self, A, inputs, alpha=None):
        (pre,) = inputs
        dim, dtype = self.axis + 1, pre.lower.dtype
        l, u, finite = self._finite(pre)
        x0, radius = (l + u) / 2, (u - l) / 2
        # Shifted by the group's largest upper bound (softmax ignores it): every exp below is at most 1.
        shift = u.amax(dim, keepdim=True)
        ls, us, x0s = l - shift, u - shift, x0 - shift
        A = A.double()
        A_pos, A_neg = A.clamp(min=0), A.clamp(max=0)

        # Below: the tangent plane of L_k = e^{x_k} / G at x₀, G the sum of the chords of exp (≥ exp at both ends).
        el, eu = torch.exp(ls), torch.exp(us)
        width = us - ls
        kappa = torch.where(width > 0, (eu - el) / torch.where(width > 0, width, 1), el)
        beta = torch.maximum(el - kappa * ls, eu - kappa * us) * (1 + _FLOAT64_SLACK)
        G0 = (kappa * x0s + beta).sum(dim, keepdim=True)
        L0 = torch.exp(x0s) / G0
        weighted = A_pos * L0  # [S, B, *shape]
        A_lower = weighted - kappa / G0 * weighted.sum(dim + 1, keepdim=True)

        # Above: the tangent plane of U_k = a_k + c_k (x_k − LSE(x)) at x₀, (a, c) the chord of exp over the range
        # [log p̲_k, log p̄_k] of x_k − LSE(x), widened past float64's rounding (a chord over a wider interval is above
        # exp on the narrower one). An output that can come within 1e-300 of 0 gets the flat line e^{t̄}.
        low, high = self._range(l, u)
        t_low, t_high = torch.log(low.clamp(min=1e-300)), torch.log(high.clamp(min=1e-300))
        t_low = t_low - _FLOAT64_SLACK * (1 + t_low.abs())
        t_high = (t_high + _FLOAT64_SLACK * (1 + t_high.abs())).clamp(max=0)  # softmax ≤ 1: t ≤ 0
        e_low, e_high = torch.exp(t_low), torch.exp(t_high)
        c = torch.where(low > 1e-300, (e_high - e_low) / (t_high - t_low), 0)
        a = (e_high - c * t_high) + _FLOAT64_SLACK * (e_high + (c * t_high).abs())
        U0 = a + c * (x0s - torch.logsumexp(x0s, dim, keepdim=True))
        scaled = A_neg * c
        A_upper = scaled - torch.softmax(x0s, dim) * scaled.sum(dim + 1, keepdim=True)

        # A group with an unbounded logit keeps only the constants 0 ≤ softmax ≤ 1.
        gradient = torch.where(finite, A_lower + A_upper, 0)
        value = flat(torch.where(finite, weighted + A_neg * U0, A_neg), 2).sum(-1)

        # The plane Σ_k A_k·plane_k(x) = g·x + value − g·x₀ in float64; rounded g costs |g − g32|·radius at most.
        rounded = gradient.to(dtype)
        error = (gradient - rounded.double()).abs()
        bias = value - flat((rounded.double() * x0), 2).sum(-1) - flat((error * radius), 2).sum(-1)
        magnitude = flat((A.abs() + gradient.abs() * (x0.abs() + radius)), 2).sum(-1) + value.abs()
        # The model's rounding is of the outputs: charged on their coefficients A, not on the plane's gradient
        # (which vanishes for p₀ + p₁ = 1, whose rounded terms need not sum to 1).
        return [rounded], bias - _FLOAT64_SLACK * magnitude - contract_abs(A, self.rounding(inputs))

    def __repr__(self) -> str:
        return f"Softmax(axis={self.axis})"


def _others(e: Tensor, dim: int) -> Tensor:
    """``Σ_{j≠k} e_j`` for every ``k`` along ``dim`` (non-negative ``e``), without cancellation: ``total − e_k``
    loses the others where ``e_k`` dominates (``(10⁻³² + 1) − 1 = 0``, and the softmax's lower bound came out 1), so
    the largest term's others are summed without it; for every other ``k``, ``total ≥ 2·e_k`` keeps the difference
    within two roundings."""
    top = torch.zeros_like(e, dtype=torch.bool).scatter_(dim, e.argmax(dim, keepdim=True), True)
    without_top = torch.where(top, 0.0, e).sum(dim, keepdim=True)
    return torch.where(top, without_top, e.sum(dim, keepdim=True) - e)
