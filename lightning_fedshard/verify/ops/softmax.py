"""Softmax along one axis (ONNX Softmax), relaxed as the composition it is.

``softmax(x)_k = e_k · r`` with ``e = exp(x − c)``, ``r = 1 / Σ_j e_j``, for any constant ``c``; the relaxation takes
``c = max_j u_j`` per softmax group, so every ``e`` lies in (0, 1] and the sum is at least ``Σ_j exp(l_j − c) > 0``
(no overflow, a positive denominator). The backward step goes through the parts with their own relaxations over
their interval bounds — the product of two computed values (:class:`~.bilinear.Mul`), the reciprocal and exp
(:mod:`.smooth`) — and the linear sum and shift in between, as auto_LiRPA's "complex" softmax does. IBP is the exact
range of each coordinate over the box: ``e^{l_k} / (e^{l_k} + Σ_{j≠k} e^{u_j})`` up to ``e^{u_k} / (e^{u_k} +
Σ_{j≠k} e^{l_j})``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import round_outwards
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract
from lightning_fedshard.verify.ops.bilinear import Mul
from lightning_fedshard.verify.ops.smooth import Exp, Reciprocal

__all__ = ["Softmax"]


class Softmax(BoundOp):
    """``softmax`` along ``axis`` of the node shape (batch excluded).

    Example::

        probabilities = Softmax(axis=0, shape=(10,))
    """

    onnx_types = ("Softmax",)
    needs_input_bounds = True
    relaxed_inputs = (0,)

    def __init__(self, axis: int, shape: tuple[int, ...]) -> None:
        if not 0 <= axis < len(shape):
            raise ValueError(f"Softmax axis {axis} outside a node of {len(shape)} dimensions")
        self.axis, self.shape = axis, tuple(shape)
        reduced = tuple(1 if i == axis else n for i, n in enumerate(shape))
        self._product = Mul((tuple(shape), reduced), tuple(shape))
        self._exp, self._reciprocal = Exp(), Reciprocal()

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(x, dim=self.axis + 1)

    def ibp(self, x: Interval) -> Interval:
        dim = self.axis + 1
        l, u = x.lower.double(), x.upper.double()
        shift = u.amax(dim, keepdim=True)
        el, eu = torch.exp(l - shift), torch.exp(u - shift)
        low = el / (el + eu.sum(dim, keepdim=True) - eu)
        high = eu / (eu + el.sum(dim, keepdim=True) - el)
        low, high = round_outwards(low.clamp(0, 1), high.clamp(0, 1), x.lower.dtype)
        return Interval(low, high)

    def _parts(self, pre: Interval) -> tuple[Tensor, Interval, Interval, Interval]:
        """The shift ``c`` and the intervals of ``x − c``, ``e`` and ``Σ e`` (in the inputs' dtype, outwards)."""
        dim, dtype = self.axis + 1, pre.lower.dtype
        shift = pre.upper.amax(dim, keepdim=True)
        shifted = Interval(*round_outwards(pre.lower.double() - shift, pre.upper.double() - shift, dtype))
        e = self._exp.ibp(shifted)
        total = round_outwards(e.lower.double().sum(dim, keepdim=True), e.upper.double().sum(dim, keepdim=True), dtype)
        return shift, shifted, e, Interval(*total)

    def backward(self, A, inputs, alpha=None):
        (pre,) = inputs
        shift, shifted, e, total = self._parts(pre)
        r = self._reciprocal.ibp(total)
        (A_e, A_r), bias = self._product.backward(A, [e, r])
        (A_total,), term = self._reciprocal.backward(A_r, [total])
        bias = bias + term
        A_e = A_e + A_total  # Σ e: the sum's coefficient reaches every term
        (A_shifted,), term = self._exp.backward(A_e, [shifted])
        bias = bias + term
        # x − c with c a constant of the box: the shift's contribution is a constant.
        return [A_shifted], bias - contract(A_shifted, shift.expand_as(pre.lower))

    def __repr__(self) -> str:
        return f"Softmax(axis={self.axis})"
