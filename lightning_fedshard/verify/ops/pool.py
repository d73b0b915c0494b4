"""Average pooling (ONNX AveragePool, and GlobalAveragePool)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fedshard.verify.ops.base import LinearOp
from lightning_fedshard.verify.ops.patches import Patches

__all__ = ["AvgPool2d"]


class AvgPool2d(LinearOp):
    """2-D average pooling on ``[B, C, H, W]``; every coefficient is non-negative, so ``|L| = L``.

    ``count_include_pad=False`` (ONNX's default) divides border windows by the number of real pixels; the
    backward step is the exact transpose for either choice, taken by differentiating the (linear) pooling. Where
    every window holds ``k`` pixels and divides by ``k``, the pooling is a depthwise convolution with a constant
    kernel, and :class:`Patches` coefficients go through it as through a convolution.

    Example::

        pool = AvgPool2d(in_shape=(8, 16, 16), kernel=(2, 2), stride=(2, 2))
    """

    onnx_types = ("AveragePool", "GlobalAveragePool")

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        kernel: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int] = (0, 0),
        count_include_pad: bool = False,
        ceil_mode: bool = False,
    ) -> None:
        if any(2 * p > k for p, k in zip(padding, kernel, strict=True)):
            raise ValueError(f"AveragePool padding {padding} is more than half the kernel {kernel}")
        self.in_shape, self.kernel, self.stride, self.padding = tuple(in_shape), kernel, stride, padding
        self.count_include_pad, self.ceil_mode = count_include_pad, ceil_mode
        out = self.linear(torch.zeros(1, 1, *self.in_shape[1:])).shape[2:]
        # A window hanging over the padded input (ceil_mode), or one that does not count the padding it covers,
        # divides by fewer than k pixels: then no single kernel describes the pooling.
        inside = all((o - 1) * s + k <= n + 2 * p for o, s, k, n, p in zip(out, stride, kernel, in_shape[1:], padding))
        self._depthwise = inside and (count_include_pad or not any(padding))

    def linear(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel, self.stride, self.padding, self.ceil_mode, self.count_include_pad)

    abs_linear = linear

    @property
    def accepts_patches(self) -> bool:
        return self._depthwise

    def transpose(self, A: Tensor | Patches) -> Tensor | Patches:
        if isinstance(A, Patches):
            C = self.in_shape[0]
            kernel = A.values.new_full((C, 1, *self.kernel), 1 / math.prod(self.kernel))
            return A.conv_transpose(kernel, self.stride, self.padding, (1, 1), C, self.in_shape)
        S, B = A.shape[:2]
        with torch.enable_grad():
            probe = torch.zeros(S * B, *self.in_shape, dtype=A.dtype, device=A.device, requires_grad=True)
            (grad,) = torch.autograd.grad(
                self.linear(probe), probe, A.reshape(S * B, *A.shape[2:]), create_graph=A.requires_grad
            )
        return grad.reshape(S, B, *self.in_shape)

    def terms(self) -> tuple[int, int]:
        window = math.prod(self.kernel)
        return window + 1, window  # the window's sum, then the division

    def __repr__(self) -> str:
        return f"AvgPool2d(k={self.kernel}, s={self.stride})"
