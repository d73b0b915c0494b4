"""The product of two computed tensors (ONNX Mul of two variables; MatMul of two variables and Div are built from it).

Over the box ``x ∈ [x_l, x_u]``, ``y ∈ [y_l, y_u]`` the product ``xy`` is bounded by planes ``a·x + b·y + c``. The
McCormick planes are the tight ones: below, ``y_l·x + x_l·y − x_l·y_l`` and ``y_u·x + x_u·y − x_u·y_u``; above,
``y_u·x + x_l·y − x_l·y_u`` and ``y_l·x + x_u·y − x_u·y_l``. A convex combination of the two on each side is valid
too, and its weight is α (one per element and side, CROWN's choice the middle, 0.5). As for the one-input
operators the intercept is not taken from the formula but computed for the coefficients as rounded: ``xy − a·x −
b·y`` is bilinear, so its extremes over the box are at the four corners (float64, rounded outwards).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import (
    FLOAT64_EPSILON,
    gamma,
    round_down,
    round_up,
    smallest_normal,
    unit_roundoff,
)
from lightning_fedshard.verify.ops.activation import bias_term, float64_interval
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract_abs, contract_error, enclose

__all__ = ["Mul"]

_FLOAT64_SLACK = 1e-12


class Mul(BoundOp):
    """``y = a · b`` for two computed tensors of shapes ``in_shapes`` broadcast to ``out_shape`` (node shapes
    without the batch dimension, of equal rank).

    Example::

        product = Mul(((20,), (20,)), (20,))
        (A_a, A_b), bias = product.backward(A, [Interval(al, au), Interval(bl, bu)])
    """

    onnx_types = ("Mul",)
    needs_input_bounds = True
    relaxed_inputs = (0, 1)
    split_inputs = (0, 1)
    exact_when_split = False
    split_min_width = 1e-3

    def __init__(self, in_shapes: tuple[tuple[int, ...], tuple[int, ...]], out_shape: tuple[int, ...]) -> None:
        if any(len(shape) != len(out_shape) for shape in in_shapes):
            raise ValueError(f"Mul inputs {in_shapes} must have the rank of the output {out_shape}")
        self.in_shapes, self.out_shape = tuple(tuple(s) for s in in_shapes), tuple(out_shape)

    def alpha_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (2, *self.out_shape)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a * b

    def _corners(self, a: Interval, b: Interval) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The four bounds in float64, broadcast to ``[B, *out_shape]``, and where either factor is unbounded
        (see :func:`~.activation.float64_interval`)."""
        al, au, a_unbounded = float64_interval(a)
        bl, bu, b_unbounded = float64_interval(b)
        return torch.broadcast_tensors(al, au, bl, bu, a_unbounded | b_unbounded)

    def ibp(self, a: Interval, b: Interval) -> Interval:
        al, au, bl, bu, unbounded = self._corners(a, b)
        products = torch.stack([al * bl, al * bu, au * bl, au * bu])
        low, high = products.amin(0), products.amax(0)
        low = torch.where(unbounded, -torch.inf, low - _FLOAT64_SLACK * (1 + low.abs()))
        high = torch.where(unbounded, torch.inf, high + _FLOAT64_SLACK * (1 + high.abs()))
        # The model's product is within half an ulp of the exact one: each end widens by that of its own value.
        u, tiny = (
            unit_roundoff(self.model_precision(a.lower.dtype)),
            smallest_normal(self.model_precision(a.lower.dtype)),
        )
        return enclose(low - u * low.abs() - tiny, high + u * high.abs() + tiny, 0.0, a.lower.dtype, self.precision)

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor:
        """The model's product (half an ulp of ``|xy|``), and the backward step's products with the planes'
        coefficients (``|a| ≤ |y|``, ``|b| ≤ |x|``, ``|c| ≤ 3|x||y|``) and its sums over broadcast elements."""
        a, b = inputs
        dtype = a.lower.dtype
        reach = a.magnitude.double() * b.magnitude.double()
        model = self.model_precision(dtype)
        out = math.prod(self.out_shape)
        broadcast = max(out // max(math.prod(shape), 1) for shape in self.in_shapes)
        summed = contract_error(math.prod(self.out_shape), dtype)  # Σ A·c, |c| ≤ 3|x||y|
        own = (gamma(broadcast + 2, dtype) + FLOAT64_EPSILON) * 2 * reach + summed * 3 * reach
        return own + unit_roundoff(model) * reach + smallest_normal(model)

    def planes(self, a: Interval, b: Interval, alpha: Tensor | None = None) -> tuple[Tensor, ...]:
        """``(a_L, b_L, c_L, a_U, b_U, c_U)``: ``a_L·x + b_L·y + c_L ≤ xy ≤ a_U·x + b_U·y + c_U`` on the box, in the
        inputs' dtype, ``[B, *out_shape]`` (``[S, B, *out_shape]`` with α ``[S, B, 2, *out_shape]``)."""
        al, au, bl, bu, unbounded = self._corners(a, b)
        if alpha is None:
            low_weight = high_weight = torch.full_like(al, 0.5)
        else:
            alpha = alpha.double().clamp(0, 1)
            low_weight, high_weight = alpha[:, :, 0], alpha[:, :, 1]
        dtype = a.lower.dtype
        coefficients = [
            torch.where(unbounded, 0, c).to(dtype)
            for c in (
                low_weight * bl + (1 - low_weight) * bu,
                low_weight * al + (1 - low_weight) * au,
                high_weight * bu + (1 - high_weight) * bl,
                high_weight * al + (1 - high_weight) * au,
            )
        ]
        corners = [(x, y) for x in (al, au) for y in (bl, bu)]

        def residual(ca: Tensor, cb: Tensor, maximum: bool) -> Tensor:
            """The extreme of ``xy − ca·x − cb·y`` over the corners, moved outwards past float64's rounding."""
            ca, cb = ca.double(), cb.double()
            values = torch.stack(torch.broadcast_tensors(*(x * y - ca * x - cb * y for x, y in corners)))
            sizes = torch.stack(
                torch.broadcast_tensors(*((x * y).abs() + (ca * x).abs() + (cb * y).abs() for x, y in corners))
            )
            slack = _FLOAT64_SLACK * (1 + sizes.amax(0))
            extreme = values.amax(0) + slack if maximum else values.amin(0) - slack
            return torch.where(unbounded, torch.inf if maximum else -torch.inf, extreme)

        below = round_down(residual(*coefficients[:2], maximum=False), dtype)
        above = round_up(residual(*coefficients[2:], maximum=True), dtype)
        return coefficients[0], coefficients[1], below, coefficients[2], coefficients[3], above

    def _to_input(self, A: Tensor, index: int) -> Tensor:
        """Coefficients on the (broadcast) output summed back to input ``index``'s shape."""
        return A.sum_to_size(*A.shape[:2], *self.in_shapes[index])

    def backward(self, A, inputs, alpha=None):
        a_low, b_low, c_low, a_high, b_high, c_high = self.planes(*inputs, alpha)
        A_pos, A_neg = A.clamp(min=0), A.clamp(max=0)
        A_a = A_pos * a_low + A_neg * a_high
        A_b = A_pos * b_low + A_neg * b_high
        bias = bias_term(A_pos, c_low) + bias_term(A_neg, c_high) - contract_abs(A, self.rounding(inputs))
        return [self._to_input(A_a, 0), self._to_input(A_b, 1)], bias

    # -- α, refinement and branching (as for Activation) -------------------------------------------------------

    def initial_alpha(self, inputs: Sequence[Interval]) -> Tensor:
        batch = inputs[0].lower.shape[0]
        return inputs[0].lower.new_full((batch, 2, *self.out_shape), 0.5)

    def refine_mask(self, inputs: Sequence[Interval | None], index: int) -> Tensor:
        pre = inputs[index]
        return pre.upper > pre.lower

    def split_mask(self, inputs: Sequence[Interval], index: int) -> Tensor:
        pre = inputs[index]
        return (pre.upper - pre.lower) > self.split_min_width * (1 + pre.lower.abs() + pre.upper.abs())

    def split_point(self, inputs: Sequence[Interval], index: int) -> Tensor:
        """0 where the factor's interval holds it (the product's sign is then fixed on each side), else the
        midpoint."""
        pre = inputs[index]
        straddles = (pre.lower < 0) & (pre.upper > 0)
        return torch.where(straddles, 0.0, (pre.lower + pre.upper) / 2)

    def _gap(self, a: Interval, b: Interval) -> Tensor:
        """The largest distance between the two planes over the box, ``[B, *out_shape]``."""
        a_low, b_low, c_low, a_high, b_high, c_high = self.planes(a, b)
        al, au, bl, bu = a.lower, a.upper, b.lower, b.upper
        gaps = [(a_high - a_low) * x + (b_high - b_low) * y + (c_high - c_low) for x in (al, au) for y in (bl, bu)]
        return torch.stack(torch.broadcast_tensors(*gaps)).amax(0)

    def branch_gain(self, A_out: Tensor, inputs: Sequence[Interval], index: int, bias: Tensor | None) -> Tensor:
        """``[S, N, *input shape]``: as :meth:`Activation.branch_gain`, summed over the outputs each input element
        feeds."""
        pre = inputs[index]
        point = self.split_point(inputs, index)
        halves = []
        for half in (Interval(pre.lower, point), Interval(point, pre.upper)):
            pair = list(inputs)
            pair[index] = half
            halves.append(self._gap(*pair))
        gain = (self._gap(*inputs) - torch.maximum(*halves)).clamp(min=0)
        return self._to_input(A_out.abs() * gain, index)

    def __repr__(self) -> str:
        return f"Mul({self.in_shapes[0]}×{self.in_shapes[1]})"
