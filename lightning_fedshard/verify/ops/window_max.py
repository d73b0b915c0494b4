"""The maximum over windows of a node (ONNX MaxPool with any kernel, stride, padding and dilation; ReduceMax).

Each output is the maximum of a fixed set of input elements, given as flat indices (``windows [outputs, k]``, −1
for padding), so one class serves pools of every shape and reductions over any axes. Below, the maximum is at
least its element with the largest lower bound. Above it is exact where that element dominates the window
(``l_i ≥ u_j`` for every other ``j``); otherwise the better, at the box centre, of the constant ``max_j u_j`` and
the plane ``Σ_{j∈T} (x_j − l_j) + max_j l_j`` over the elements ``T`` that can be the maximum (``u_j > max l``):
if the maximum is ``x_k`` with ``k ∈ T`` the plane is at least ``x_k − l_k + max l ≥ x_k``, and an element
outside ``T`` is at most ``max l``.

Non-overlapping 2-D pools are loaded as pairwise maxima ``max(a, b) = ReLU(a − b) + b`` instead
(:mod:`~lightning_fedshard.verify.onnx.reductions`), whose ReLUs get intermediate bounds, α and splits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedshard.verify.floats import FLOAT64_EPSILON, gamma, round_up
from lightning_fedshard.verify.ops.base import BoundOp, Interval, contract, contract_abs, contract_error, flat

__all__ = ["WindowMax"]


class WindowMax(BoundOp):
    """``y[i] = max_j x[windows[i, j]]`` over the flattened input (entries −1 are padding, never the maximum).

    Example::

        windows = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7]])     # 2×2 pooling of a 2×4 image
        pool = WindowMax(windows, in_shape=(1, 2, 4), out_shape=(1, 1, 2))
    """

    onnx_types = ("MaxPool", "ReduceMax", "ReduceMin")
    needs_input_bounds = True
    relaxed_inputs = (0,)

    def __init__(self, windows: Tensor, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> None:
        if windows.dim() != 2 or windows.shape[0] != int(torch.Size(out_shape).numel()):
            raise ValueError(f"windows must be [outputs, k] for {out_shape}, got {tuple(windows.shape)}")
        if bool((windows < 0).all(1).any()):
            raise ValueError("a window holds nothing but padding")
        self.windows = windows
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        #: The most windows one input element lies in: the backward step sums that many coefficients onto it.
        self.overlap = int(torch.bincount(windows[windows >= 0].flatten()).max()) if bool((windows >= 0).any()) else 1

    def _gather(self, x: Tensor, fill: float) -> Tensor:
        """``x [..., *in_shape]`` → ``[..., outputs, k]``, padding as ``fill``."""
        flat = x.flatten(-len(self.in_shape))
        taken = flat[..., self.windows.clamp(min=0)]
        return taken.masked_fill(self.windows < 0, fill)

    def _unflatten(self, y: Tensor) -> Tensor:
        return y.reshape(*y.shape[:-1], *self.out_shape)

    def forward(self, x: Tensor) -> Tensor:
        return self._unflatten(self._gather(x, -torch.inf).amax(-1))

    def ibp(self, x: Interval) -> Interval:
        return Interval(
            self._unflatten(self._gather(x.lower, -torch.inf).amax(-1)),
            self._unflatten(self._gather(x.upper, -torch.inf).amax(-1)),
        )

    def lines(self, pre: Interval) -> tuple[Tensor, Tensor, Tensor]:
        """``(lower, upper, intercept)``: per window element ``[B, outputs, k]`` the coefficients of the lower bound
        ``Σ lower·x`` and of the upper bound ``Σ upper·x + intercept`` (``[B, outputs]``)."""
        low, high = self._gather(pre.lower, -torch.inf), self._gather(pre.upper, -torch.inf)
        best_low, best = low.max(-1, keepdim=True)
        lower = torch.zeros_like(low).scatter_(-1, best, 1.0)
        others_high = high.scatter(-1, best, -torch.inf).amax(-1, keepdim=True)
        dominated = (best_low >= others_high)[..., 0]
        candidates = high > best_low  # the elements that can be the maximum
        low64 = low.double().masked_fill(~candidates, 0)
        plane_intercept = round_up(best_low[..., 0].double() - low64.sum(-1), pre.lower.dtype)
        constant = high.amax(-1)
        centre = self._gather((pre.lower + pre.upper) / 2, 0.0)
        plane_at_centre = ((centre - low.masked_fill(~candidates, 0)) * candidates).sum(-1) + best_low[..., 0]
        use_plane = plane_at_centre < constant
        upper = torch.where(
            dominated[..., None], lower, torch.where(use_plane[..., None], candidates.to(low.dtype), 0.0)
        )
        intercept = torch.where(dominated, 0.0, torch.where(use_plane, plane_intercept, constant))
        return lower, upper, intercept

    def rounding(self, inputs: Sequence[Interval | None]) -> Tensor:
        (pre,) = inputs
        return self._rounding(pre, self.lines(pre)[2])

    def _rounding(self, pre: Interval, intercept: Tensor) -> Tensor:
        """Exact in the model (a maximum). The backward step's coefficients are copies (products with 0 and 1); where
        windows overlap it sums up to :attr:`overlap` of them per input element (``γ`` of the window's magnitudes),
        and its intercept's products round by half an ulp each."""
        error = contract_error(intercept[0].numel(), intercept.dtype) * intercept.abs().double()
        if self.overlap > 1:
            reach = self._gather(pre.magnitude, 0.0).sum(-1).double()  # [B, outputs]
            error = error + (gamma(self.overlap + 1, reach.dtype) + FLOAT64_EPSILON) * reach
        return self._unflatten(error)

    def backward(self, A, inputs, alpha=None):
        (pre,) = inputs
        lower, upper, intercept = self.lines(pre)
        rows = flat(A, 2)  # [S, B, outputs]
        A_pos, A_neg = rows.clamp(min=0), rows.clamp(max=0)
        per_element = A_pos.unsqueeze(-1) * lower + A_neg.unsqueeze(-1) * upper  # [S, B, outputs, k]
        size = int(torch.Size(self.in_shape).numel())
        index = self.windows.clamp(min=0).flatten().expand(*rows.shape[:2], -1)
        weights = flat(per_element.masked_fill(self.windows < 0, 0), 2)
        A_in = rows.new_zeros(*rows.shape[:2], size).scatter_add_(2, index, weights)
        bias = contract(A_neg, intercept) - contract_abs(rows, flat(self._rounding(pre, intercept), 1))
        return [A_in.reshape(*A.shape[:2], *self.in_shape)], bias

    def __repr__(self) -> str:
        return f"WindowMax({self.windows.shape[1]} of {list(self.in_shape)} → {list(self.out_shape)})"
