"""Floating-point soundness: directed rounding, and the a-priori error bounds every bound pass charges.

Two kinds of rounding stand between a bound computed here and the values a network takes:

* **the model's**: onnxruntime computes each node in the node's own float type (``BoundOp.precision``), so its value
  differs from the exact operation on the same inputs — by at most ``γ_n·Σ|terms|`` for a sum of ``n`` products
  in any order (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1; ``γ_n = n·u/(1 − n·u)``, ``u`` the
  unit roundoff), a few ulps for a library function (measured, see ``docs/verification.md``), half an ulp of the
  target type for a narrowing Cast;
* **ours**: every interval and linear bound is itself computed in float32 (or float64), so its products and sums
  round too.

Each operator bounds both per element of its output (:meth:`~lightning_fedshard.verify.ops.BoundOp.rounding`):
its interval bounds are widened by that bound, and a backward step charges ``Σ |A|·rounding`` to the constant of
the linear bound it carries. The constants themselves are summed in float64 (:func:`contract`), and every final
float64 value is rounded outwards (:func:`round_down`, :func:`round_up`) to the working dtype.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = [
    "FLOAT64_EPSILON",
    "HUGE",
    "gamma",
    "overflow",
    "round_down",
    "round_outwards",
    "round_up",
    "smallest_normal",
    "unit_roundoff",
]

#: An interval reaching past this magnitude (or infinite) is unbounded to a relaxation: its lines are the
#: constants ±inf, whatever the function (a float32 network's values there are beyond its precision anyway).
HUGE = 1e30

#: Relative error charged for float64 arithmetic on a bound's way to its final rounding: a few dozen float64
#: operations on terms of at most this relative size (2⁻⁴⁵ = 2⁸ float64 ulps), far below one float32 ulp (2⁻²³).
FLOAT64_EPSILON = 2.0**-45


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the distance from 1 to the next number of ``dtype`` (2⁻²⁴ for float32, 2⁻¹¹ for float16)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``γ_n = n·u / (1 − n·u)`` for ``dtype``: a sum of ``n`` rounded products (or ``n`` roundings in a
    row) is within ``γ_n`` of the exact result, relative to the sum of the terms' magnitudes, in any order."""
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu) if nu < 1 else math.inf


def smallest_normal(dtype: torch.dtype) -> float:
    """The smallest normal number of ``dtype``: a result below it may be flushed to zero (or rounded as a
    subnormal, whose spacing no longer shrinks), an absolute error no relative term covers."""
    return torch.finfo(dtype).tiny


def overflow(dtype: torch.dtype) -> float:
    """The magnitude from which a value rounds to ±inf in ``dtype`` (its largest number plus half an ulp)."""
    info = torch.finfo(dtype)
    return info.max + info.eps * 2.0 ** (math.frexp(info.max)[1] - 2)


@functools.cache
def _infinity(sign: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(sign * math.inf, dtype=dtype, device=device)


def _step(value: Tensor, dtype: torch.dtype, sign: float) -> Tensor:
    """``value`` cast to ``dtype`` (to nearest), then one number further towards ``sign·∞``: never on the wrong side of
    ``value`` (the cast moved it by half a spacing at most), ±∞ kept, a finite value past the dtype's range its
    largest number. Under autograd the gradient passes as if the cast were exact (α-CROWN optimises through rounded
    lines)."""
    cast = value.to(dtype)
    exact = cast.detach()
    stepped = torch.nextafter(exact, _infinity(sign, dtype, exact.device))
    if value.dtype.itemsize > dtype.itemsize:
        # A wider zero is exact: sums cancel exactly there, and products of numbers in a narrower type's range (and
        # of the rounding constants) do not underflow the wider one. Kept, so that [0, 0] stays a stable neuron.
        stepped = torch.where(value == 0, exact, stepped)
    if not cast.requires_grad:
        return stepped
    return torch.where(torch.isfinite(exact), cast + (stepped - exact), stepped)


def round_down(value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` (float64, or any wider type) in ``dtype``, never above it."""
    return _step(value, dtype, -1.0)


def round_up(value: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` (float64, or any wider type) in ``dtype``, never below it."""
    return _step(value, dtype, 1.0)


def round_outwards(lower: Tensor, upper: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """float64 bounds cast to ``dtype`` so that they still contain the float64 interval, an end that the cast keeps
    exact kept as it is (for boxes: a model's input box, a clipped box; not differentiable)."""
    low, high = lower.to(dtype), upper.to(dtype)
    low = torch.where(low.double() > lower, torch.nextafter(low, _infinity(-1.0, dtype, low.device)), low)
    high = torch.where(high.double() < upper, torch.nextafter(high, _infinity(1.0, dtype, high.device)), high)
    return low, high
