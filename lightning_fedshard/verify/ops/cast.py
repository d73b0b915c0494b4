"""A Cast to a narrower float type (ONNX Cast to float16, bfloat16, or float32 from float64): a rounding.

The model rounds each value to the target type: monotonically, so the interval of the result is the rounded ends
(each rounded outwards, so that any rounding mode is covered), and within one spacing of the target type at the
value's magnitude, so a linear bound carries the coefficients through unchanged and charges that spacing. Past the
target's largest number the result is infinite, and so is the bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import round_down, round_up, smallest_normal
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract_abs

__all__ = ["RoundToFloat"]


class RoundToFloat(BoundOp):
    """``y = x`` rounded to the float type ``target`` (and held in the graph's dtype).

    Example::

        half = RoundToFloat(torch.float16)
        half.ibp(Interval(torch.tensor([[1000.1]]), torch.tensor([[1000.2]])))   # [1000.0, 1000.5]
    """

    onnx_types = ("Cast",)
    needs_input_bounds = True
    accepts_patches = True

    def __init__(self, target: torch.dtype) -> None:
        self.target = target
        self.precision = target

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.target).to(x.dtype)

    def ibp(self, x: Interval) -> Interval:
        low = round_down(x.lower.double(), self.target).to(x.lower.dtype)
        high = round_up(x.upper.double(), self.target).to(x.upper.dtype)
        return Interval(low, high)

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor:
        """One spacing of the target type at the input's magnitude (its smallest normal number's below it;
        infinite past its largest number)."""
        (x,) = inputs
        reach = round_up(x.magnitude.double(), self.target)
        spacing = torch.nextafter(reach, torch.full_like(reach, torch.inf)).double() - reach.double()
        return torch.maximum(spacing, torch.full_like(spacing, smallest_normal(self.target)))

    def backward(self, A, inputs, alpha=None):
        return [A], -contract_abs(A, self.rounding(inputs))

    def __repr__(self) -> str:
        return f"RoundToFloat({str(self.target).removeprefix('torch.')})"
