"""Element-wise affine maps: ONNX Add/Sub/Mul/Div with a constant operand, and BatchNormalization (eval)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fedshard.verify.ops.base import LinearOp

__all__ = ["BatchNorm", "ElementwiseAffine"]


class ElementwiseAffine(LinearOp):
    """``y = x · scale + shift`` with constants broadcastable to the output (``[*shape]`` or ``[1, *shape]``).

    ``in_shape``/``out_shape`` are the node shapes without batch; they differ only when the constant broadcasts
    the input up (``x [B, 1] + c [10]``), and the backward step then sums the coefficients back down.

    Example::

        normalise = ElementwiseAffine(scale=1 / std, shift=-mean / std, in_shape=(1, 28, 28), out_shape=(1, 28, 28))
    """

    onnx_types = ("Add", "Sub", "Mul", "Div")

    def __init__(
        self, scale: Tensor | None, shift: Tensor | None, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
    ) -> None:
        self.scale, self.shift = scale, shift
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    @property
    def accepts_patches(self) -> bool:
        # Patches multiply by the constants as they are; summing a broadcast back down needs dense coefficients.
        return self.in_shape == self.out_shape

    def linear(self, x: Tensor) -> Tensor:
        return x if self.scale is None else x * self.scale

    def abs_linear(self, x: Tensor) -> Tensor:
        return x if self.scale is None else x * self.scale.abs()

    def transpose(self, A: Tensor) -> Tensor:
        A = A if self.scale is None else A * self.scale
        if self.in_shape != self.out_shape:
            A = A.sum_to_size(*A.shape[:2], *self.in_shape)
        return A

    def terms(self) -> tuple[int, int]:
        broadcast = math.prod(self.out_shape) // max(math.prod(self.in_shape), 1)
        return 1, broadcast  # x·s + c, and the transpose's sum over broadcast copies

    def constant(self) -> Tensor | None:
        return self.shift

    def ibp(self, x):
        out = super().ibp(x)
        if self.in_shape == self.out_shape:
            return out
        # The constant broadcast a smaller input up to the output shape.
        shape = (x.lower.shape[0], *self.out_shape)
        return type(out)(out.lower.expand(shape), out.upper.expand(shape))

    def __repr__(self) -> str:
        return f"ElementwiseAffine({'×' if self.scale is not None else ''}{'+' if self.shift is not None else ''})"


class BatchNorm(ElementwiseAffine):
    """Inference-mode batch normalisation over channel dimension 0 of the node shape, folded to a per-channel
    affine map ``γ/√(var+ε) · x + (β − mean·γ/√(var+ε))``.

    Example::

        bn = BatchNorm(gamma, beta, running_mean, running_var, eps=1e-5, shape=(8, 16, 16))
    """

    onnx_types = ("BatchNormalization",)

    def __init__(
        self, gamma: Tensor, beta: Tensor, mean: Tensor, var: Tensor, eps: float, shape: tuple[int, ...]
    ) -> None:
        if len(shape) < 1 or gamma.numel() != shape[0]:
            raise ValueError(f"BatchNorm has {gamma.numel()} channels but its input has shape {tuple(shape)}")
        # Fold in float64 so the folded constants are the correctly rounded values of the exact formula.
        scale = gamma.double() / torch.sqrt(var.double() + eps)
        shift = beta.double() - mean.double() * scale
        view = (-1,) + (1,) * (len(shape) - 1)
        super().__init__(scale.to(gamma.dtype).view(view), shift.to(gamma.dtype).view(view), shape, shape)
        # The model computes (x − mean)·γ/√(var + ε) + β: its rounding scales with |β| + |mean·scale|, which the
        # folded shift β − mean·scale may cancel.
        self.constant_magnitude = (beta.double().abs() + (mean.double() * scale).abs()).to(gamma.dtype).view(view)

    def __repr__(self) -> str:
        return f"BatchNorm({self.in_shape[0]})"
