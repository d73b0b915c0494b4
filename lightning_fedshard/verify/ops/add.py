"""Sum or difference of two computed nodes (ONNX Add/Sub of two variables): residual connections."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_fedshard.verify.floats import smallest_normal, unit_roundoff
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract_abs, enclose

__all__ = ["Add"]


class Add(BoundOp):
    """``y = a + b`` (or ``a − b`` with ``subtract=True``) for two nodes of the same shape.

    The backward step hands the same coefficients to both inputs; where a node feeds several consumers (the
    skip branch of a residual block) the graph sums what each consumer hands back before going further.

    Example::

        residual = Add()
        (A_a, A_b), bias = residual.backward(A, [Interval(al, au), Interval(bl, bu)])
    """

    onnx_types = ("Add", "Sub")
    accepts_patches = True
    needs_input_bounds = True  # the model's sum rounds by up to half an ulp of |a ± b|

    def __init__(self, subtract: bool = False) -> None:
        self.subtract = subtract

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a - b if self.subtract else a + b

    def ibp(self, a: Interval, b: Interval) -> Interval:
        if self.subtract:
            low, high = a.lower.double() - b.upper.double(), a.upper.double() - b.lower.double()
        else:
            low, high = a.lower.double() + b.lower.double(), a.upper.double() + b.upper.double()
        # The model's sum is within half an ulp of the exact one: each end widens by that of its own value.
        u, tiny = unit_roundoff(self.model_precision(a.lower.dtype)), self._flushed(a, b)
        return enclose(low - u * low.abs() - tiny, high + u * high.abs() + tiny, 0.0, a.lower.dtype, self.precision)

    def _flushed(self, a: Interval, b: Interval) -> Tensor:
        """What flushing subnormal inputs and results to zero can add: the smallest normal number, but nothing where
        both inputs are exactly 0 (then so is the sum: MaxPool's tree of gaps over dead ReLUs stays stable)."""
        nonzero = (a.magnitude > 0) | (b.magnitude > 0)
        return smallest_normal(self.model_precision(a.lower.dtype)) * nonzero.double()

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor:
        a, b = inputs
        model = self.model_precision(a.lower.dtype)
        return unit_roundoff(model) * (a.magnitude.double() + b.magnitude.double()) + self._flushed(a, b)

    def backward(self, A, inputs, alpha=None):
        return [A, -A if self.subtract else A], -contract_abs(A, self.rounding(inputs))

    def __repr__(self) -> str:
        return "Sub" if self.subtract else "Add"
