"""Sum or difference of two computed nodes (ONNX Add/Sub of two variables): residual connections."""

from __future__ import annotations

from torch import Tensor

from lightning_fedshard.verify.ops.base import BoundOp, Interval

__all__ = ["Add"]


class Add(BoundOp):
    """``y = a + b`` (or ``a − b`` with ``subtract=True``) for two nodes of the same shape.

    The backward step hands the same coefficients to both inputs; where a node feeds several consumers (the
    skip branch of a residual block) the graph sums what each consumer hands back before going further.

    Example::

        residual = Add()
        (A_a, A_b), _ = residual.backward(A, [None, None])
    """

    onnx_types = ("Add", "Sub")
    accepts_patches = True

    def __init__(self, subtract: bool = False) -> None:
        self.subtract = subtract

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a - b if self.subtract else a + b

    def ibp(self, a: Interval, b: Interval) -> Interval:
        if self.subtract:
            return Interval(a.lower - b.upper, a.upper - b.lower)
        return Interval(a.lower + b.lower, a.upper + b.upper)

    def backward(self, A, inputs, alpha=None):
        return [A, -A if self.subtract else A], None

    def __repr__(self) -> str:
        return "Sub" if self.subtract else "Add"
